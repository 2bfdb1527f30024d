"""Fault injection in the KV data plane, for tests and the fault matrix (off by default).

A sender built with ``faults=...`` (a spec string or a ``FaultSpec``) draws, for every message it
is about to post, at most one fault:

- ``drop``: the message is never posted (counted as sent): the transfer stays incomplete and
  misses its deadline; the receiver drops it and the request is prefilled again on the decode
  worker;
- ``duplicate``: the message is posted twice (landing is idempotent; a late copy is dropped);
- ``reorder``: the message is held back and posted after the next one;
- ``corrupt``: one byte of the payload is flipped after its checksum was taken: the receiver's
  CRC check fails the transfer (NACK ``CORRUPT``) and nothing of it is used.

Spec: comma-separated ``name=probability`` pairs and an optional ``seed=N``, e.g.
``"drop=0.05,corrupt=0.05,seed=1"``. Workers take it from ``PDSERVE_KV_FAULTS`` (read by the
launcher, the edge), never from a default.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, fields

FAULTS_ENV = "PDSERVE_KV_FAULTS"
FAULTS_OPTION = "faults"
KINDS = ("drop", "duplicate", "reorder", "corrupt")


@dataclass(frozen=True)
class FaultSpec:
    drop: float = 0.0
    duplicate: float = 0.0
    reorder: float = 0.0
    corrupt: float = 0.0
    seed: int | None = None

    def __post_init__(self) -> None:
        for kind in KINDS:
            p = getattr(self, kind)
            if not isinstance(p, (int, float)) or isinstance(p, bool) or not 0.0 <= p <= 1.0:
                raise ValueError(f"KV fault {kind!r}: probability must be in [0, 1], got {p!r}")
        if sum(getattr(self, kind) for kind in KINDS) > 1.0:
            raise ValueError(f"KV fault probabilities add up to more than 1: {self}")

    @property
    def active(self) -> bool:
        return any(getattr(self, kind) > 0 for kind in KINDS)


def parse_faults(text: str) -> FaultSpec:
    """``"drop=0.1,corrupt=0.05,seed=3"`` -> FaultSpec; ValueError naming a bad key or value."""
    values: dict[str, object] = {}
    known = {f.name for f in fields(FaultSpec)}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in known:
            raise ValueError(f"KV fault spec {text!r}: {part!r} is not one of {sorted(known)} = value")
        try:
            values[key] = int(value) if key == "seed" else float(value)
        except ValueError:
            raise ValueError(f"KV fault spec {text!r}: {key} needs a number, got {value!r}") from None
    return FaultSpec(**values)  # type: ignore[arg-type]


class FaultInjector:
    """Draws the fault of each message from a ``FaultSpec`` (thread-confined: the sender's loop)."""

    def __init__(self, spec: FaultSpec | str):
        self.spec = parse_faults(spec) if isinstance(spec, str) else spec
        self._rng = random.Random(self.spec.seed)
        self.counts: dict[str, int] = dict.fromkeys(KINDS, 0)

    def draw(self) -> str | None:
        """The fault for the next message, or None."""
        x = self._rng.random()
        for kind in KINDS:
            p = getattr(self.spec, kind)
            if x < p:
                self.counts[kind] += 1
                return kind
            x -= p
        return None

    def byte_to_flip(self, nbytes: int) -> int:
        return self._rng.randrange(nbytes)
