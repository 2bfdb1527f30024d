"""Network-aware's search: the best pair and the best local run without pricing every option,
from arrays of the workers kept across placements. Pure; the same answers, bit for bit, as
pricing every option (router.placement.policies.oracle, the reference the tests compare with).

The cost model (router.placement.policies.cost) prices a pair as

    TTFT(P, D) = a(P, kv) + admit(D),   a(P, kv) = queue(P) + prefill(P) + kv - (L-1)/L x min(kv, prefill(P))

where queue and prefill depend on P alone, admit, TPOT and the free-block check on D alone (so
feasibility is a property of D), and kv on the link from P's node to D's node. `a` grows with
kv, and flows and measured rates only make a link slower, so a pair costs at least a(P, idle
link) + admit(D). The search:

1. decode workers (the feasible ones, or all) are grouped by node, each node's list ordered by
   (admit, load, id), the nodes by (smallest admit, smallest load, smallest id);
2. prefill workers are visited in order of a lower bound of their pairs: to each node their
   node reaches by an explicit link (or its own), that link's time as the view has it plus
   the node's smallest admit; to every other node the idle remote default plus the smallest
   admit of all (`NodeLinks` follows the view's link states change by change);
3. for one P, the nodes are visited in order; on a node kv is one number, so TTFT grows along
   its list and the walk stops at the first decode worker past the best found. Nodes that P's
   node reaches over the idle remote default (no explicit link, no flow, no measured rate
   below it) share one kv and are walked together, in (admit, load, id) order (`_Generic`);
4. a prefill worker, or a node, is skipped when its bound key already exceeds the best
   option's key, and the visit ends when the bound alone exceeds the best TTFT. A prefill
   worker with the node, queue, prefill and load of one visited before it is skipped (it
   loses every tie on its id) unless it is a mixed worker (the other may pair with it).

A mixed worker is on both sides and never pairs with itself. A local run's TTFT grows with D's
step time when D has no cached prefix: those are walked in (admit, load, id) order until past
the best, the others priced one by one (`best_local`). Only the options walked are priced, by
the policy's own estimate functions; the chosen pair is priced again and checked against the
search's numbers (on a disagreement, a cost model of another shape, every pair is priced).

The per-worker work is on arrays (router.placement.policies.columns): candidates, loads and
capacity checks are masks over `Columns`, and orders are numpy's lexsort on the same keys,
worker ids compared by their rank in id order."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from pdserve.router.placement.congestion import IDLE, transfer_seconds
from pdserve.router.placement.base import ClusterSnapshot, RequestInfo, WorkerSnapshot
from pdserve.router.placement.policies.columns import (
    INFLIGHT,
    RUNNING,
    TOKENS,
    WAITING,
    Columns,
    LoadMap,
    cached_link,
    decode_steps,
    prefill_times,
    topology_cache,
)
from pdserve.router.placement.policies.cost import Estimate
from pdserve.router.placement.profiles import Profile

Feasible = Callable[[Estimate], bool]


def order(e: Estimate, load: Mapping[str, int]) -> tuple[float, int, int, str, str]:
    """The policy's order of options: lowest TTFT, then the less loaded P, D, then worker ids."""
    return (e.ttft_s, load.get(e.prefill or "", 0), load[e.decode], e.prefill or "", e.decode)


# ---------------------------------------------------------------- the search


class Search:
    """The options of one request (module docstring). `prefill_rows` and `decode_rows`: rows of
    `columns`, each in worker-id order (a mixed worker may be in both). `feasible` given to
    `best_pair`/`best_local` must be the policy's feasibility, whose vector form is
    `room and tpot x tpot_factor <= tpot_limit` (no limit: room alone); the chosen pair is
    checked with the callable itself."""

    def __init__(self, profile: Profile, request: RequestInfo, columns: Columns, prefill_rows: np.ndarray,
                 decode_rows: np.ndarray, snapshot: ClusterSnapshot, load: np.ndarray,
                 pair: Callable[[WorkerSnapshot, WorkerSnapshot], Estimate],
                 local: Callable[[WorkerSnapshot], Estimate], cached_blocks: Mapping[str, int], block_size: int,
                 *, tpot_limit: float | None, tpot_factor: float, prefill_factor: float = 1.0) -> None:
        self.profile, self.request, self.snapshot, self.columns = profile, request, snapshot, columns
        # `profile`'s prefill times carry the calibration's prefill factor; a transfer hides behind
        # the unscaled forward (cost.estimate_pair)
        self._inv_f = 1.0 / prefill_factor
        self._pair, self._local = pair, local
        self._workers = columns.workers
        self._p_rows, self._d_rows = prefill_rows.tolist(), decode_rows.tolist()
        # a mixed worker is on both sides: its place among the decode workers (-1: none), as it
        # never pairs with itself
        where_d = {row: i for i, row in enumerate(self._d_rows)}
        self._twin = [where_d.get(row, -1) for row in self._p_rows] if columns.has_mixed else [-1] * len(self._p_rows)
        self._both = (np.isin(decode_rows, prefill_rows) if columns.has_mixed
                      else np.zeros(len(decode_rows), dtype=bool))  # decode workers that also prefill
        n = request.num_prompt_tokens
        self.num_bytes = n * (snapshot.kv_bytes_per_token or profile.kv_bytes_per_token)
        self._c = (profile.num_layers - 1) / profile.num_layers
        self._kv_memo: dict[tuple[str, str], float] = {}
        self._links = topology_cache(snapshot.topology)[1]
        self.fallbacks = 0
        self.load_map = LoadMap(columns, load, np.concatenate((prefill_rows, decode_rows)))
        num = columns.numbers

        # decode side: cost.decode_context, the admit and TPOT steps, the free-block check
        d = decode_rows
        batch = load[d]
        inflight, tokens = num[d, INFLIGHT], num[d, TOKENS]
        known = np.where(inflight != 0, tokens / np.where(inflight != 0, inflight, 1), float(n))
        context = np.maximum(np.rint((known * batch + request.num_tokens) / (batch + 1)).astype(np.int64), 1)
        self._admit, self._tpot = decode_steps(profile, batch, context, batch + 1)
        self._room = columns.has_room(d, n)
        ok = self._room if tpot_limit is None else self._room & (self._tpot * tpot_factor <= tpot_limit)
        self._feasible = ok
        self._d_load = batch
        self._d_node = columns.node[d]
        self._d_batch, self._d_context = batch, context
        # (admit, load, id) order of all decode workers (their rank in id order is their index)
        self._order = np.lexsort((np.arange(len(d)), batch, self._admit))

        # prefill side: the queue and the prefill of the uncached prompt at each, by the pair profile
        p = prefill_rows
        self._p_load = load[p]
        unknown = np.maximum(0, num[p, WAITING] + num[p, RUNNING] - num[p, INFLIGHT])
        self._queue = prefill_times(profile, num[p, TOKENS] + unknown * n)
        self._prefill = np.full(len(p), profile.prefill_seconds(max(1, n)))
        self._cached_d: list[int] = []
        if cached_blocks:
            where_p = {row: i for i, row in enumerate(self._p_rows)}
            for wid, blocks in cached_blocks.items():
                row = columns.index.get(wid)
                if row is None or not blocks:
                    continue
                if row in where_p:
                    self._prefill[where_p[row]] = profile.prefill_seconds(max(1, n - blocks * block_size))
                if row in where_d:
                    self._cached_d.append(where_d[row])
            self._cached_d.sort()

    # ---------------------------------------------------------------- the questions

    def _count(self, decodes: np.ndarray) -> int:
        """The pairs whose decode worker is one of `decodes` (a mask)."""
        return len(self._p_rows) * int(np.count_nonzero(decodes)) - int(np.count_nonzero(decodes & self._both))

    @property
    def num_pairs(self) -> int:
        return self._count(np.ones(len(self._d_rows), dtype=bool))

    def count_over_tpot(self, limit: float, factor: float) -> int:
        """Pairs whose TPOT x `factor` exceeds `limit` (TPOT is D's alone)."""
        return self._count(self._tpot * factor > limit)

    def count_without_room(self) -> int:
        return self._count(~self._room)

    def _decode(self, i: int) -> WorkerSnapshot:
        return self._workers[self._d_rows[i]]

    def _prefill_worker(self, i: int) -> WorkerSnapshot:
        return self._workers[self._p_rows[i]]

    def best_local(self, feasible: Callable[[Estimate], bool] | None = None) -> Estimate | None:
        """The best local run: the workers with a cached prefix priced one by one, the others
        walked in (admit, load, id) order until past the best, one per (batch, context, room)."""
        best: Estimate | None = None
        best_key = None
        load = self.load_map

        def consider(e: Estimate) -> None:
            nonlocal best, best_key
            if feasible is not None and not feasible(e):
                return
            k = order(e, load)
            if best_key is None or k < best_key:
                best, best_key = e, k

        for i in self._cached_d:
            consider(self._local(self._decode(i)))
        cached = set(self._cached_d)
        batch, context, room = self._d_batch.tolist(), self._d_context.tolist(), self._room.tolist()
        seen: set[tuple[int, int, bool]] = set()
        for i in self._order.tolist():
            if i in cached:
                continue
            same = (batch[i], context[i], room[i])
            if same in seen:
                continue
            seen.add(same)
            e = self._local(self._decode(i))
            if best_key is not None and e.ttft_s > best_key[0]:
                break
            consider(e)
        return best

    def best_pair(self, feasible: Callable[[Estimate], bool] | None = None) -> Estimate | None:
        if not self._p_rows:
            return None
        entries = self._order if feasible is None else self._order[self._feasible[self._order]]
        chosen = self._search(entries)
        if chosen is None:
            return None
        (p, d), ttft = chosen
        e = self._pair(self._prefill_worker(p), self._decode(d))
        if e.ttft_s != ttft or (feasible is not None and not feasible(e)):
            return self._exhaustive(feasible)
        return e

    # ---------------------------------------------------------------- the search

    def _search(self, entries: np.ndarray):
        if len(entries) == 0:
            return None
        admit_of, load_of = self._admit.tolist(), self._d_load.tolist()
        node_of = self._d_node.tolist()
        names = self.columns.node_names
        # by node, each node's workers in (admit, load, id) order; nodes by (smallest admit, load, id, name)
        nodes_sorted = entries[np.argsort(self._d_node[entries], kind="stable")]
        node_col = self._d_node[nodes_sorted]
        starts = np.flatnonzero(np.r_[True, node_col[1:] != node_col[:-1]])
        load_min = np.minimum.reduceat(self._d_load[nodes_sorted], starts)
        id_min = np.minimum.reduceat(nodes_sorted, starts)
        admit_min = self._admit[nodes_sorted[starts]]
        # (a node's smallest id is its own: no two nodes tie on the first three, so names never decide)
        node_order = np.lexsort((id_min, load_min, admit_min)).tolist()
        ends = np.r_[starts[1:], len(nodes_sorted)].tolist()
        members = nodes_sorted.tolist()
        admit_l, load_min_l, id_min_l = admit_min.tolist(), load_min.tolist(), id_min.tolist()
        node_l, starts_l = node_col[starts].tolist(), starts.tolist()
        nodes = [(admit_l[k], load_min_l[k], id_min_l[k], names[node_l[k]], starts_l[k], ends[k]) for k in node_order]
        overall_admit = nodes[0][0]
        d_load_min = int(load_min.min())
        d_id_min = int(id_min.min())
        floor = self._kv_floor()
        generic = _Generic(self, entries, {t[3] for t in nodes}, node_col[starts])

        # prefill workers by a lower bound of their pairs' TTFT: over the nodes their node reaches
        # by an explicit link (its own node included), that link's idle time + the node's smallest
        # admit; over every other node, the idle remote default + the smallest admit of all.
        # Flows and measured rates only slow a link, so each term bounds what it stands for.
        q, s = self._queue, self._prefill
        c = self._c
        w = s * self._inv_f  # the forward that hides the transfer
        a_floor = q + s + floor - c * np.minimum(floor, w)
        links = self.columns.links()
        node_min = np.full(len(names) + 1, np.inf)  # by node index; the last: no node (padding)
        node_min[node_col[starts]] = admit_min
        p_node_idx = self.columns.node[self._p_rows]
        remote = links.remote_kv(self.num_bytes)
        bound = q + s + remote - c * np.minimum(remote, w) + overall_admit
        kv = links.kv(self.snapshot.links, self.num_bytes)[p_node_idx]  # [P, reached nodes]
        reach = (q[:, None] + s[:, None] + kv - c * np.minimum(kv, w[:, None])
                 + node_min[links.reach_node[p_node_idx]])
        bound = np.minimum(bound, reach.min(axis=1))
        visit = np.lexsort((np.arange(len(q)), self._p_load, bound)).tolist()
        bound_l, p_load_l = bound.tolist(), self._p_load.tolist()
        q_l, s_l, af_l = q.tolist(), s.tolist(), a_floor.tolist()
        p_nodes = p_node_idx.tolist()
        position = {t[3]: k for k, t in enumerate(nodes)}

        best_key: tuple[float, int, int, int, int] | None = None
        best = None
        # a prefill worker with the node, queue, prefill and load of one visited before it (a lower
        # id, as visits go) prices every pair the same and loses each tie on its id: skipped
        seen: set[tuple[int, float, float, int]] = set()
        reached: dict[str, tuple[set[str] | None, list]] = {}  # by node: its special nodes, in visit order
        for p_id in visit:
            p_load = p_load_l[p_id]
            if best_key is not None:
                b = bound_l[p_id]
                if b > best_key[0]:
                    break
                if b == best_key[0] and (p_load, d_load_min, p_id, d_id_min) > best_key[1:]:
                    continue
            qp, sp, afp = q_l[p_id], s_l[p_id], af_l[p_id]
            twin = self._twin[p_id]
            same = (p_nodes[p_id], qp, sp, p_load)
            if twin < 0:  # (a mixed worker is not like another: the other may pair with it)
                if same in seen:
                    continue
                seen.add(same)
            p_node = names[p_nodes[p_id]]
            found = reached.get(p_node)
            if found is None:
                special = generic.special(p_node)
                found = reached[p_node] = (special, nodes if special is None else
                                           [nodes[k] for k in sorted(position[name] for name in special)])
            special, own = found
            for node_admit, node_load, node_id, name, start, end in own:
                if best_key is not None:
                    node_bound = afp + node_admit
                    if node_bound > best_key[0]:
                        break
                    if node_bound == best_key[0] and (p_load, node_load, p_id, node_id) > best_key[1:]:
                        continue
                a = self._a(qp, sp, self._kv(p_node, name))
                for k in range(start, end):
                    d = members[k]
                    if d == twin:
                        continue
                    ttft = a + admit_of[d]
                    if best_key is not None and ttft > best_key[0]:
                        break
                    key = (ttft, p_load, load_of[d], p_id, d)
                    if best_key is None or key < best_key:
                        best_key, best = key, (p_id, d)
            if special is None:
                continue
            a = self._a(qp, sp, generic.kv)
            walk, next_admit = generic.walk, generic.next_admit
            k = 0
            while k < len(walk):
                d = walk[k]
                if names[node_of[d]] in special or d == twin:
                    k += 1
                    continue
                ttft = a + admit_of[d]
                if best_key is not None and ttft > best_key[0]:
                    break
                key = (ttft, p_load, load_of[d], p_id, d)
                if best_key is None or key < best_key:
                    best_key, best = key, (p_id, d)
                    k += 1
                else:
                    k = next_admit(k)
        return None if best is None else (best, best_key[0])

    def _a(self, queue_s: float, prefill_s: float, kv_s: float) -> float:
        return queue_s + prefill_s + kv_s - self._c * min(kv_s, prefill_s * self._inv_f)

    def _kv(self, src: str, dst: str) -> float:
        found = self._kv_memo.get((src, dst))
        if found is None:
            link, key = self._links.get((src, dst)) or cached_link(self.snapshot.topology, self._links, src, dst)
            found = self._kv_memo[(src, dst)] = transfer_seconds(link, self.snapshot.links.state(key),
                                                                 self.num_bytes)
        return found

    def _kv_floor(self) -> float:
        """The prompt's KV time over the fastest link class of the topology, idle (flows and
        measurements only make a link slower)."""
        return min(transfer_seconds(link, IDLE, self.num_bytes) for link in topology_cache(self.snapshot.topology)[0])

    def _exhaustive(self, feasible: Callable[[Estimate], bool] | None) -> Estimate | None:
        self.fallbacks += 1
        load = self.load_map
        pairs = [self._pair(self._prefill_worker(p), self._decode(d))
                 for d in range(len(self._d_rows)) for p in range(len(self._p_rows)) if d != self._twin[p]]
        if feasible is not None:
            pairs = [e for e in pairs if feasible(e)]
        return min(pairs, key=lambda e: order(e, load), default=None)


class _Generic:
    """The nodes a prefill worker's node reaches over the idle remote default link: one link time,
    so the search walks them together (the links with something on them are followed by
    NodeLinks, change by change). `special(node)`: the decode nodes that are not like that (its
    own, explicit links from it, links with flows or measured rates), or None when they are most
    of them, or node names contain "->" (ambiguous link keys): then every node is priced alone."""

    def __init__(self, search: Search, entries: np.ndarray, d_nodes: set[str], d_node_idx: np.ndarray) -> None:
        columns = search.columns
        links = columns.links()
        self.kv = links.remote_kv(search.num_bytes)
        self.d_nodes = d_nodes
        self.walk = entries.tolist()  # already in (admit, load, id) order
        self._admit = search._admit.tolist()
        self._out = topology_cache(search.snapshot.topology)[2]
        links.kv(search.snapshot.links, 0)  # follows the view
        self._busy = links.busy
        arrow = links.arrow
        self.ambiguous = bool(arrow[d_node_idx].any() or arrow[columns.node[search._p_rows]].any())
        self._memo: dict[str, set[str] | None] = {}

    def next_admit(self, k: int) -> int:
        """The first place in the walk after `k` with another admit (the end when none)."""
        walk, admit = self.walk, self._admit
        here, k = admit[walk[k]], k + 1
        while k < len(walk) and admit[walk[k]] == here:
            k += 1
        return k

    def special(self, node: str) -> set[str] | None:
        if self.ambiguous:
            return None
        if node in self._memo:
            return self._memo[node]
        special = ({node} | self._out.get(node, set()) | self._busy.get(node, set())) & self.d_nodes
        found = self._memo[node] = None if 2 * len(special) > len(self.d_nodes) else special
        return found
