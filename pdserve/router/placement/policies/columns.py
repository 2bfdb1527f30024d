"""Network-aware's search works on arrays: the workers, the links between their nodes and the
profile's step times, kept across placements (router.placement.policies.search). Pure.

`Columns` keeps the snapshots' workers as arrays across placements (a row is read again only when
its `WorkerSnapshot` object is not the one seen last time); candidates, loads and capacity checks
are masks; `NodeLinks` prices a transfer over each link between the workers' nodes as the view
has it; `LoadMap` is the candidates' loads as the policy's `load` dict. The decode workers'
context, admit and TPOT come from `decode_steps` and the prefill workers' queue and prefill from
`prefill_times` (router.placement.profiles' interpolation elementwise, the same operations in the
same order, so the same numbers)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from operator import attrgetter

import numpy as np

from pdserve.router.placement.congestion import IDLE, CongestionView, available_gbps, transfer_seconds
from pdserve.router.placement.base import ClusterSnapshot, WorkerSnapshot
from pdserve.router.placement.profiles import Profile
from pdserve.router.placement.topology import Link, Topology

_NUMBERS = ("healthy", "num_waiting", "num_running", "num_free_blocks", "num_blocks", "block_size", "num_inflight",
            "max_model_len", "num_inflight_tokens")
(HEALTHY, WAITING, RUNNING, FREE, BLOCKS, BLOCK_SIZE, INFLIGHT, MAX_LEN, TOKENS) = range(len(_NUMBERS))
_numbers = attrgetter(*_NUMBERS)
ROLE_PREFILL, ROLE_DECODE, ROLE_MIXED = 0, 1, 2
_ROLE = {"prefill": ROLE_PREFILL, "decode": ROLE_DECODE, "mixed": ROLE_MIXED}


# Per topology (immutable; kept by identity, a few at a time): its link classes, the links
# between node pairs asked for with their keys (Topology.link builds a default link anew on
# every call), and the nodes each node has explicit links to.
_TOPOLOGIES: dict[int, tuple] = {}
_MAX_LINKS = 1 << 20


def topology_cache(topology: Topology):
    """(link classes as idle Links, the links asked for by node pair, explicit link targets by node)."""
    found = _TOPOLOGIES.get(id(topology))
    if found is None or found[0] is not topology:
        classes = tuple(Link("", "", gbps, latency_ms) for gbps, latency_ms in sorted(
            {(topology.local_gbps, topology.local_latency_ms), (topology.remote_gbps, topology.remote_latency_ms),
             *((link.capacity_gbps, link.latency_ms) for link in topology.links)}))
        if len(_TOPOLOGIES) >= 16:
            _TOPOLOGIES.clear()
        out: dict[str, set[str]] = {}
        for link in topology.links:
            out.setdefault(link.src, set()).add(link.dst)
        found = _TOPOLOGIES[id(topology)] = (topology, classes, {}, out)
    return found[1], found[2], found[3]


def cached_link(topology: Topology, links: dict[tuple[str, str], tuple[Link, str]], src: str,
                dst: str) -> tuple[Link, str]:
    if len(links) >= _MAX_LINKS:
        links.clear()
    link = topology.link(src, dst)
    found = links[(src, dst)] = (link, link.key)
    return found


# ---------------------------------------------------------------- profile queries on arrays


def interpolate(xs: Sequence[int], ys_at: Callable[[np.ndarray], np.ndarray], x: np.ndarray) -> np.ndarray:
    """pdserve.router.placement.profiles._interpolate elementwise: `xs` the axis, `ys_at(j)` the values at axis
    index j for each element, `x` an integer array. The same operations in the same order (at
    or below the first point the segment is the first one, where ys_at(0) is the answer)."""
    if len(xs) == 1:
        first = ys_at(np.zeros(x.shape, dtype=np.intp))
        return np.where(x <= xs[0], first, first * x / xs[0])
    axis = _axis(xs)
    i = np.searchsorted(axis, x, side="right")
    lo = np.clip(i - 1, 0, len(xs) - 2)
    y_lo, y_hi = ys_at(lo), ys_at(lo + 1)
    slope = (y_hi - y_lo) / (axis[lo + 1] - axis[lo])
    if i.max(initial=0) >= len(xs):
        slope = np.where(i >= len(xs), np.maximum(slope, 0.0), slope)
    value = np.maximum(y_lo + slope * (x - axis[lo]), 0.0)
    return np.where(x <= xs[0], y_lo, value)


_AXES: dict[tuple[int, ...], np.ndarray] = {}


def _axis(xs: Sequence[int]) -> np.ndarray:
    key = tuple(xs)
    found = _AXES.get(key)
    if found is None:
        if len(_AXES) >= 64:
            _AXES.clear()
        found = _AXES[key] = np.asarray(key, dtype=np.int64)
    return found


def decode_steps(profile: Profile, batch: np.ndarray, context: np.ndarray,
                 *more: np.ndarray) -> np.ndarray | tuple[np.ndarray, ...]:
    """`profile.decode_step_seconds(b, c)` for each (b, c); with `more` batch arrays, a tuple:
    the step times at `batch`, then at each of `more`, all at `context` (one interpolation of
    every batch row along the context serves them all)."""
    times = _decode_table(profile)
    rows = interpolate(profile.decode_contexts, lambda k: times[:, k], np.maximum(context, 1))  # [row, element]
    column = np.arange(len(context))
    found = []
    for b in (batch, *more):
        value = interpolate(profile.decode_batch_sizes, lambda j: rows[j, column], b)
        found.append(np.where(b <= 0, 0.0, value))
    return tuple(found) if more else found[0]


def prefill_times(profile: Profile, tokens: np.ndarray) -> np.ndarray:
    """`profile.prefill_seconds(n)` for each n."""
    times = np.asarray(profile.prefill_times, dtype=np.float64)
    value = interpolate(profile.prefill_tokens, lambda k: times[k], tokens)
    return np.where(tokens <= 0, 0.0, value)


def _decode_table(profile: Profile) -> np.ndarray:
    table = profile.__dict__.get("_decode_table")
    if table is None:
        table = np.asarray(profile.decode_times, dtype=np.float64)
        object.__setattr__(profile, "_decode_table", table)
    return table


# ---------------------------------------------------------------- the workers as arrays


class Columns:
    """The workers of the snapshots one policy sees, as arrays kept across placements (module
    docstring). `update` raises ValueError, naming the worker and the field, when a count of
    the snapshot is not an integer."""

    def __init__(self) -> None:
        self.workers: tuple[WorkerSnapshot, ...] = ()  # held: their ids stay distinct from new objects'
        self._ident = np.zeros(0, dtype=np.uintp)
        self.topology: Topology | None = None
        self.ids: list[str] = []
        self.index: dict[str, int] = {}
        self.numbers = np.zeros((0, len(_NUMBERS)), dtype=np.int64)
        self.role = np.zeros(0, dtype=np.int8)
        self.node = np.zeros(0, dtype=np.intp)  # index into node_names
        self.node_names: list[str] = []
        self.by_id = np.zeros(0, dtype=np.intp)  # rows in worker-id order
        self.has_mixed = False
        self._links: NodeLinks | None = None
        self._roles: list[str] = []
        self._reported: list[str] = []  # WorkerSnapshot.node as reported (the topology may place it)

    def update(self, snapshot: ClusterSnapshot) -> None:
        workers = tuple(snapshot.workers)
        n = len(workers)
        if snapshot.topology is not self.topology or n != len(self.workers):
            return self._rebuild(snapshot, workers)
        ident = np.fromiter(map(id, workers), dtype=np.uintp, count=n)
        changed = np.flatnonzero(ident != self._ident).tolist()
        if len(changed) > n // 4:
            return self._rebuild(snapshot, workers)
        for i in changed:
            w = workers[i]
            if w.worker_id != self.ids[i] or w.role != self._roles[i] or w.node != self._reported[i]:
                return self._rebuild(snapshot, workers)
            row = _numbers(w)
            if not all(type(v) is int or type(v) is bool for v in row):
                self.workers = ()
                _reject(w)
            self.numbers[i] = row
        self.workers, self._ident = workers, ident

    def _rebuild(self, snapshot: ClusterSnapshot, workers: tuple[WorkerSnapshot, ...]) -> None:
        """Every row read again; the ids, roles and nodes (and what follows from them) only when
        they differ from the arrays'."""
        self.workers = ()
        numbers = np.array(list(map(_numbers, workers)))
        if numbers.dtype.kind not in "iub" or numbers.shape != (len(workers), len(_NUMBERS)):
            for w in workers:  # a number that is not an int (or not one int64 holds)
                _reject(w)
        ids, roles, reported = (list(map(attrgetter(name), workers)) for name in ("worker_id", "role", "node"))
        if snapshot.topology is not self.topology or ids != self.ids or roles != self._roles \
                or reported != self._reported:
            self.ids, self._roles, self._reported = ids, roles, reported
            self.index = {wid: i for i, wid in enumerate(ids)}
            self.role = np.array([_ROLE[r] for r in roles], dtype=np.int8)
            self.has_mixed = bool((self.role == ROLE_MIXED).any())
            node_of = snapshot.topology.node_of
            names: dict[str, int] = {}
            self.node = np.array([names.setdefault(node_of(wid, node), len(names)) for wid, node in zip(ids, reported)],
                                 dtype=np.intp)
            self.node_names = list(names)
            self.by_id = np.array(sorted(range(len(workers)), key=ids.__getitem__), dtype=np.intp)
            self.topology = snapshot.topology
            self._links = None
        self.numbers = numbers.astype(np.int64)
        self._ident = np.fromiter(map(id, workers), dtype=np.uintp, count=len(workers))
        self.workers = workers

    def links(self) -> NodeLinks:
        if self._links is None:
            self._links = NodeLinks(self.topology, self.node_names)  # type: ignore[arg-type]
        return self._links

    # ---------------------------------------------------------------- derived per placement

    def healthy(self) -> np.ndarray:
        """A new boolean array: WorkerSnapshot.healthy of every row."""
        return self.numbers[:, HEALTHY] != 0

    def load(self) -> np.ndarray:
        """WorkerSnapshot.load of every row."""
        num = self.numbers
        return np.maximum(num[:, WAITING] + num[:, RUNNING], num[:, INFLIGHT])

    def fits(self, num_tokens: int) -> np.ndarray:
        """WorkerSnapshot.fits(num_tokens) of every row."""
        num = self.numbers
        max_len, blocks, size = num[:, MAX_LEN], num[:, BLOCKS], num[:, BLOCK_SIZE]
        ok = ~((max_len != 0) & (num_tokens > max_len))
        sized = (blocks != 0) & (size != 0)
        need = -(-num_tokens // np.where(sized, size, 1))
        return ok & (~sized | (need <= blocks))

    def has_room(self, rows: np.ndarray, num_tokens: int) -> np.ndarray:
        """cost.has_room(worker, num_tokens) of `rows`."""
        num = self.numbers[rows]
        blocks, size = num[:, BLOCKS], num[:, BLOCK_SIZE]
        sized = (blocks != 0) & (size != 0)
        need = -(-num_tokens // np.where(sized, size, 1))
        return ~sized | (need <= num[:, FREE])


def _reject(w: WorkerSnapshot) -> None:
    for name, value in zip(_NUMBERS, _numbers(w)):
        if not (type(value) is bool or (type(value) is int and -2**63 <= value < 2**63)):
            raise ValueError(f"worker {w.worker_id!r}: {name} must be an integer, got {value!r}")


class NodeLinks:
    """The links of a topology between the nodes of the workers, by node index: for each node,
    the nodes it reaches by an explicit link or its own local one (`reach_node`, padded with
    len(node_names)), and `kv(view, num_bytes)`: the transfer time of `num_bytes` over each of
    those links as router.placement.congestion.transfer_seconds prices it with the view's state (the same
    operations, so the same numbers); `remote_kv`: over the idle remote default."""

    def __init__(self, topology: Topology, node_names: list[str]) -> None:
        index = {name: k for k, name in enumerate(node_names)}
        self.remote = Link("", "", topology.remote_gbps, topology.remote_latency_ms)
        reached: list[list[Link]] = []
        for name in node_names:
            reached.append([topology.link(name, name)])
        for link in topology.links:
            if link.src in index and link.dst in index and link.src != link.dst:
                reached[index[link.src]].append(link)
        width = max(map(len, reached), default=1)
        nodes = len(node_names)
        self.reach_node = np.full((nodes, width), nodes, dtype=np.intp)
        self._latency_s = np.zeros((nodes, width))
        self._idle_gbps = np.ones((nodes, width))
        self._position: dict[str, tuple[int, int, Link]] = {}  # link key -> (node, column, link)
        for k, row in enumerate(reached):
            for j, link in enumerate(row):
                self.reach_node[k, j] = index[link.dst]
                self._latency_s[k, j] = link.latency_ms / 1e3
                self._idle_gbps[k, j] = available_gbps(link, IDLE)
                self._position[link.key] = (k, j, link)
        self._gbps = self._idle_gbps.copy()  # the fair share a new flow gets on each, by the view
        self._remote_gbps = topology.remote_gbps
        # by source node: the nodes whose link from it has flows or a measured rate below the remote
        # default's capacity (_Generic's test), over every link of the view
        self.busy: dict[str, set[str]] = {}
        self.arrow = np.array(["->" in name for name in node_names] + [False], dtype=bool)
        self._view: CongestionView | None = None

    def kv(self, view: CongestionView, num_bytes: int) -> np.ndarray:
        self._follow(view)
        if num_bytes <= 0:
            return np.zeros(self._gbps.shape)
        return self._latency_s + num_bytes * 8 / (self._gbps * 1e9)

    def remote_kv(self, num_bytes: int) -> float:
        return transfer_seconds(self.remote, IDLE, num_bytes)

    def _follow(self, view: CongestionView) -> None:
        """The fair shares, and the busy links, as of `view`: from the changes it records since
        the view followed last (LinkMonitor's views: the links changed between two requests),
        else from every link in it."""
        changed = view.changes_since(self._view)
        if changed is None:
            self._gbps = self._idle_gbps.copy()
            self.busy = {}
            changed = tuple(view.links)
        states = view.links
        position, busy, remote_gbps = self._position, self.busy, self._remote_gbps
        for key in changed:
            state = states.get(key, IDLE)
            found = position.get(key)
            if found is not None:
                k, j, link = found
                self._gbps[k, j] = available_gbps(link, state)
            src, _, dst = key.partition("->")
            if state.active_flows == 0 and (state.measured_gbps is None or state.measured_gbps >= remote_gbps):
                if src in busy:
                    busy[src].discard(dst)
            else:
                busy.setdefault(src, set()).add(dst)
        self._view = view  # held: the next view's record of what changed refers to it


class LoadMap(Mapping):
    """worker id -> load of the candidates, read on demand (the policy's `load` dict)."""

    def __init__(self, columns: Columns, load: np.ndarray, rows: np.ndarray) -> None:
        self._columns, self._load = columns, load
        self._member = np.zeros(len(load), dtype=bool)
        self._member[rows] = True

    def _row(self, key: object) -> int | None:
        row = self._columns.index.get(key)  # type: ignore[arg-type]
        return row if row is not None and self._member[row] else None

    def __getitem__(self, key: str) -> int:
        row = self._row(key)
        if row is None:
            raise KeyError(key)
        return int(self._load[row])

    def __contains__(self, key: object) -> bool:
        return self._row(key) is not None

    def __iter__(self):
        return (self._columns.ids[i] for i in np.flatnonzero(self._member).tolist())

    def __len__(self) -> int:
        return int(self._member.sum())
