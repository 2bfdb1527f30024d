"""Worker discovery: where the workers are and what role each plays.

A directory answers `endpoints()`; the router asks again periodically, since addresses change
when a worker restarts (the Ray directory re-resolves named actors). `StaticDirectory` is a
fixed list, parsed from command-line strings::

    prefill=127.0.0.1:50051            role=address
    decode@nodeA=10.0.0.2:50052        role@node=address
    mixed#w3@nodeB=10.0.0.3:50053      role#worker_id@node=address

Without `#worker_id` the id is "<role>-<index>" (index counts entries of that role from 0).

Duties: a directory may also hold `duties`, worker id -> role, a role override the router's
worker pool reads at each refresh (as it reads `draining`): a mixed worker given "prefill" duty
is counted and placed as a prefill worker (it prefills for others and sends the KV), one given
"decode" duty as a decode worker (it takes no prefills for others); "mixed" or no entry: its own
role. Only a mixed worker can take a duty (`check_duty`): a prefill or decode worker cannot run
the other phase. The autoscaler shifts hybrid workers' duties this way instead of starting
processes (launcher.autoscale).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from pdserve.router.placement.base import ROLES, Role

_ENTRY = re.compile(
    r"^(?P<role>[a-z]+)(?:#(?P<id>[A-Za-z0-9_.:-]+))?(?:@(?P<node>[A-Za-z0-9_.-]+))?=(?P<address>\S+)$"
)
_HOST_PORT = re.compile(r"^(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(?P<port>\d{1,5})$")


@dataclass(frozen=True)
class WorkerEndpoint:
    worker_id: str
    role: Role
    address: str  # gRPC target, host:port
    node: str = ""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"worker {self.worker_id!r}: role must be one of {ROLES}, got {self.role!r}")
        if not self.worker_id:
            raise ValueError("worker_id must not be empty")


@runtime_checkable
class WorkerDirectory(Protocol):
    async def endpoints(self) -> list[WorkerEndpoint]:
        """The workers now known (ids unique). May raise; the router then keeps its last view."""
        ...


def check_duty(worker_id: str, role: str, duty: str) -> None:
    """ValueError unless a worker of `role` can take `duty` (module docstring: mixed workers only)."""
    if duty not in ROLES:
        raise ValueError(f"worker {worker_id!r}: duty must be one of {ROLES}, got {duty!r}")
    if role != "mixed" and duty != role:
        raise ValueError(f"worker {worker_id!r} is a {role} worker: only a mixed worker can take {duty} duty")


class StaticDirectory:
    """A fixed set of endpoints (and the duties given to its mixed workers)."""

    def __init__(self, endpoints: Iterable[WorkerEndpoint]) -> None:
        self._endpoints = list(endpoints)
        self.duties: dict[str, Role] = {}
        ids = [e.worker_id for e in self._endpoints]
        duplicates = sorted({i for i in ids if ids.count(i) > 1})
        if duplicates:
            raise ValueError(f"duplicate worker ids: {duplicates}")

    @classmethod
    def parse(cls, entries: Iterable[str]) -> StaticDirectory:
        """From strings like "decode@nodeA=host:port" (module docstring); ValueError names a bad entry."""
        endpoints: list[WorkerEndpoint] = []
        counts: dict[str, int] = {}
        for entry in entries:
            endpoints.append(parse_endpoint(entry, counts))
        if not endpoints:
            raise ValueError("no worker entries given")
        return cls(endpoints)

    async def endpoints(self) -> list[WorkerEndpoint]:
        return list(self._endpoints)

    def set_duty(self, worker_id: str, duty: Role) -> None:
        """The router counts and places the mixed worker as `duty` from its next refresh on."""
        endpoint = next((e for e in self._endpoints if e.worker_id == worker_id), None)
        if endpoint is None:
            raise ValueError(f"no worker {worker_id!r} in the directory")
        check_duty(worker_id, endpoint.role, duty)
        if duty == endpoint.role:
            self.duties.pop(worker_id, None)
        else:
            self.duties[worker_id] = duty


def parse_endpoint(entry: str, counts: dict[str, int] | None = None) -> WorkerEndpoint:
    """One entry; `counts` (role -> entries seen) numbers the ids of entries without one."""
    text = entry.strip()
    match = _ENTRY.match(text)
    if match is None:
        raise ValueError(f"bad worker entry {entry!r}: expected role[#id][@node]=host:port, role one of {ROLES}")
    role, address = match["role"], match["address"]
    if role not in ROLES:
        raise ValueError(f"bad worker entry {entry!r}: role must be one of {ROLES}, got {role!r}")
    port = _HOST_PORT.match(address)
    if port is None or not 0 < int(port["port"]) < 65536:
        raise ValueError(f"bad worker entry {entry!r}: address must be host:port with a port in 1..65535")
    counts = {} if counts is None else counts
    index = counts.get(role, 0)
    counts[role] = index + 1
    worker_id = match["id"] or f"{role}-{index}"
    return WorkerEndpoint(worker_id=worker_id, role=role, address=address, node=match["node"] or "")
