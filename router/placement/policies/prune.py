"""Network-aware's search over options: every option priced (small clusters), or a pruned search
that makes the same choice without pricing every (P, D) pair (large ones). Pure.

Both answer the same questions for `NetworkAware.decide`: the best pair and the best local run
(optionally among the feasible ones) in the policy's order, (TTFT, load P, load D, id P, id D),
and how many pairs satisfy a predicate (for the decision's reason).

Why the pruned search finds the exhaustive one's choice. The cost model (router.placement.policies.cost)
prices a pair as

    TTFT(P, D) = a(P, kv) + admit(D),   a(P, kv) = queue(P) + prefill(P) + kv - (L-1)/L x min(kv, prefill(P))

where queue and prefill depend on P alone, admit, TPOT and the free-block check on D alone
(so feasibility is a property of D), and kv on the link from P's node to D's node and what is
on it. `a` grows with kv (by 1 or 1/L of it), so with kv_floor, the prompt's KV time over the
fastest link class of the topology when idle (flows and measurements only make a link
slower), every pair of P with a decode worker of admit >= m has TTFT >= a(P, kv_floor) + m.
The search:

1. decode workers (the feasible ones, or all) are grouped by node, each node's list ordered by
   (admit, load, id), the nodes by (smallest admit, smallest load, smallest id);
2. prefill workers are visited in order of their bound a(P, kv_floor) + smallest admit;
3. for one P, the nodes are visited in order; on a node kv is one number, so TTFT grows
   along its list and the walk stops at the first decode worker past the best found. Nodes
   that P's node reaches over the remote default link with nothing on it (no explicit link,
   no flow, no measured rate below the default) share one kv: they are priced together, by a
   walk of all decode workers in (admit, load, id) order that skips the other nodes' (when
   such nodes are fewer than half, and node names hold no "->");
4. a prefill worker, or a node, is skipped when its bound key (bound, load P, smallest load
   of D, id P, smallest id of D) already exceeds the best option's key, and the visit ends
   when the bound alone exceeds the best TTFT (every later bound is at least as large).

A local run's TTFT grows with D's step time when D has no cached prefix: those are walked in
(admit, load, id) order until past the best, the others priced one by one (`best_local`).

Identical workers on equal links tie exactly; step 4's keys settle those ties as the
exhaustive order does without visiting them all. The bounds rely on the TTFT formula growing
with kv in floating point, which holds unless two link times differ by less than a rounding
unit of the TTFT (about 1e-17 s): distinct links, loads and prompt sizes never do. The chosen
pair is priced again by the policy's own estimate and checked against the search's numbers;
on any disagreement (the cost model changed shape) the search falls back to pricing every
pair. tests/router/test_prune.py compares the two on randomised clusters.

Kept outside `NetworkAware` so that the policy's rules (feasibility, the local-vs-pair
competition, the SLOs) stay in one place: the search takes the policy's own estimate functions
and answers only "which option is best".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from router.placement.congestion import IDLE, transfer_seconds
from router.placement.base import ClusterSnapshot, RequestInfo, WorkerSnapshot
from router.placement.policies.cost import Estimate, decode_context, has_room, queued_tokens
from router.placement.profiles import Profile
from router.placement.topology import Link, Topology

PairFn = Callable[[WorkerSnapshot, WorkerSnapshot], Estimate]
LocalFn = Callable[[WorkerSnapshot], Estimate]
Feasible = Callable[[Estimate], bool]

EXHAUSTIVE_MAX_PAIRS = 1024  # at most this many (P, D) pairs: price them all, as before pruning


def order(e: Estimate, load: dict[str, int]) -> tuple[float, int, int, str, str]:
    """The policy's order of options: lowest TTFT, then the less loaded P, D, then worker ids."""
    return (e.ttft_s, load.get(e.prefill or "", 0), load[e.decode], e.prefill or "", e.decode)


class Exhaustive:
    """Every option priced: the policy's search before pruning."""

    def __init__(self, prefills: Sequence[WorkerSnapshot], decodes: Sequence[WorkerSnapshot], load: dict[str, int],
                 pair: PairFn, local: LocalFn) -> None:
        self.load = load
        self.pairs = [pair(p, d) for d in decodes for p in prefills if p.worker_id != d.worker_id]
        self.locals = [local(d) for d in decodes]

    @property
    def num_pairs(self) -> int:
        return len(self.pairs)

    def best_pair(self, feasible: Feasible | None = None) -> Estimate | None:
        return self._best(self.pairs, feasible)

    def best_local(self, feasible: Feasible | None = None) -> Estimate | None:
        return self._best(self.locals, feasible)

    def count_pairs(self, predicate: Feasible) -> int:
        return sum(1 for e in self.pairs if predicate(e))

    def _best(self, options: list[Estimate], feasible: Feasible | None) -> Estimate | None:
        if feasible is not None:
            options = [e for e in options if feasible(e)]
        return min(options, key=lambda e: order(e, self.load), default=None)


class Pruned:
    """The same answers as `Exhaustive` without pricing every pair (module docstring)."""

    def __init__(self, profile: Profile, request: RequestInfo, prefills: Sequence[WorkerSnapshot],
                 decodes: Sequence[WorkerSnapshot], snapshot: ClusterSnapshot, load: dict[str, int],
                 pair: PairFn, local: LocalFn, cached_tokens: Callable[[str], int]) -> None:
        self.profile, self.request, self.snapshot, self.load = profile, request, snapshot, load
        self.prefills, self.decodes = list(prefills), list(decodes)
        self._pair, self._local = pair, local
        self._cached = cached_tokens
        n = request.num_prompt_tokens
        self.num_bytes = n * (snapshot.kv_bytes_per_token or profile.kv_bytes_per_token)
        self._c = (profile.num_layers - 1) / profile.num_layers
        self._prefill_memo: dict[int, float] = {}
        self._kv_memo: dict[tuple[str, str], float] = {}
        self._links = topology_cache(snapshot.topology)[1]
        self._prefill_ids = {p.worker_id for p in self.prefills}
        # decode side: (admit, TPOT, room) of a pair, and a pair-shaped probe for feasibility
        probe_prefill = self.prefills[0].worker_id if self.prefills else ""
        self._d: list[tuple[WorkerSnapshot, str, float, Estimate]] = []
        self._context: dict[str, tuple[int, int]] = {}
        for d in self.decodes:
            batch, context = self._context[d.worker_id] = decode_context(d, request)
            admit = self._step(batch, context)
            probe = Estimate(prefill=probe_prefill, decode=d.worker_id, queue_s=0.0, prefill_s=0.0, kv_s=0.0,
                             hidden_s=0.0, admit_s=admit, tpot_s=self._step(batch + 1, context), room=has_room(d, n))
            self._d.append((d, snapshot.node_of(d), admit, probe))
        self.fallbacks = 0  # searches that disagreed with the cost model and priced every pair instead

    @property
    def num_pairs(self) -> int:
        both = sum(1 for d in self.decodes if d.worker_id in self._prefill_ids)
        return len(self.prefills) * len(self.decodes) - both

    def count_pairs(self, predicate: Feasible) -> int:
        total = len(self.prefills)
        return sum(total - (d.worker_id in self._prefill_ids) for d, _, _, probe in self._d if predicate(probe))

    def best_local(self, feasible: Feasible | None = None) -> Estimate | None:
        """A local run on D prices D's prefill inside D's steps: with no cached prefix its TTFT is
        (chunks + 1) steps + the prefill, growing with D's step time (the pair's admit). So the
        workers without a cached prefix are walked in (admit, load, id) order until the TTFT
        passes the best feasible one; those with a cached prefix are priced one by one. A walked
        worker with the batch, context and free-block answer of one already priced has the same
        estimate and sorts after it: it is passed over unpriced."""
        best: Estimate | None = None
        best_key = None

        def consider(e: Estimate) -> None:
            nonlocal best, best_key
            if feasible is not None and not feasible(e):
                return
            k = order(e, self.load)
            if best_key is None or k < best_key:
                best, best_key = e, k

        plain = []
        for d, _, admit, probe in self._d:
            if self._cached(d.worker_id):
                consider(self._local(d))
            else:
                plain.append((admit, self.load[d.worker_id], d.worker_id, d, probe.room))
        plain.sort(key=lambda t: t[:3])
        seen: set[tuple[int, int, bool]] = set()
        for _, _, _, d, room in plain:
            same = (*self._context[d.worker_id], room)
            if same in seen:
                continue
            seen.add(same)
            e = self._local(d)
            if best_key is not None and e.ttft_s > best_key[0]:
                break
            consider(e)
        return best

    def best_pair(self, feasible: Feasible | None = None) -> Estimate | None:
        if not self.prefills:
            return None
        chosen = self._search([entry for entry in self._d if feasible is None or feasible(entry[3])])
        if chosen is None:
            return None  # no pair among these decode workers (one mixed worker can pair only with others)
        (p, d), key = chosen
        e = self._pair(p, d)
        if e.ttft_s != key[0] or (feasible is not None and not feasible(e)):
            return self._exhaustive(feasible)
        return e

    # ---------------------------------------------------------------- the search

    def _search(self, entries: list[tuple[WorkerSnapshot, str, float, Estimate]]):
        if not entries:
            return None
        by_node: dict[str, list[tuple[float, int, str, WorkerSnapshot]]] = {}
        for d, node, admit, _ in entries:
            by_node.setdefault(node, []).append((admit, self.load[d.worker_id], d.worker_id, d))
        nodes = []
        for name, options in by_node.items():
            options.sort(key=lambda t: t[:3])
            nodes.append((options[0][0], min(t[1] for t in options), min(t[2] for t in options), name, options))
        nodes.sort(key=lambda t: t[:4])
        admit_min = nodes[0][0]
        d_load_min = min(t[1] for t in nodes)
        d_id_min = min(t[2] for t in nodes)
        floor = self._kv_floor()
        generic = _Generic(self, entries, nodes)

        visits = []
        for p in self.prefills:
            q = self._prefill(queued_tokens(p, self.request))
            s = self._prefill(max(1, self.request.num_prompt_tokens - self._cached(p.worker_id)))
            a_floor = self._a(q, s, floor)
            visits.append((a_floor + admit_min, self.load[p.worker_id], p.worker_id, p, q, s, a_floor))
        visits.sort(key=lambda t: t[:3])

        best_key: tuple[float, int, int, str, str] | None = None
        best = None
        for bound, p_load, p_id, p, q, s, a_floor in visits:
            if best_key is not None:
                if bound > best_key[0]:
                    break
                if bound == best_key[0] and (p_load, d_load_min, p_id, d_id_min) > best_key[1:]:
                    continue
            p_node = self.snapshot.node_of(p)
            special = generic.special(p_node)
            for node_admit, node_load, node_id, name, options in nodes:
                if special is not None and name not in special:
                    continue  # a node the remote default link reaches, idle: priced below, all at once
                if best_key is not None:
                    node_bound = a_floor + node_admit
                    if node_bound > best_key[0]:
                        break
                    if node_bound == best_key[0] and (p_load, node_load, p_id, node_id) > best_key[1:]:
                        continue
                a = self._a(q, s, self._kv(p_node, name))
                for admit, d_load, d_id, d in options:
                    if d_id == p_id:
                        continue
                    ttft = a + admit
                    if best_key is not None and ttft > best_key[0]:
                        break
                    key = (ttft, p_load, d_load, p_id, d_id)
                    if best_key is None or key < best_key:
                        best_key, best = key, (p, d)
            if special is None:
                continue
            # every other node: one link time (the remote default, idle), so TTFT grows with admit
            # along the decode workers' (admit, load, id) order; a worker no better than the best
            # found makes every later one of the same admit no better either
            a = self._a(q, s, generic.kv)
            order, next_admit = generic.order, generic.next_admit
            k = 0
            while k < len(order):
                admit, d_load, d_id, d, node = order[k]
                if node in special or d_id == p_id:
                    k += 1
                    continue
                ttft = a + admit
                if best_key is not None and ttft > best_key[0]:
                    break
                key = (ttft, p_load, d_load, p_id, d_id)
                if best_key is None or key < best_key:
                    best_key, best = key, (p, d)
                    k += 1
                else:
                    k = next_admit[k]
        return None if best is None else (best, best_key)

    def _a(self, queue_s: float, prefill_s: float, kv_s: float) -> float:
        """queue + prefill + kv - hidden, in the order Estimate.ttft_s adds them."""
        return queue_s + prefill_s + kv_s - self._c * min(kv_s, prefill_s)

    def _kv(self, src: str, dst: str) -> float:
        found = self._kv_memo.get((src, dst))
        if found is None:
            link, key = self._links.get((src, dst)) or cached_link(self.snapshot.topology, self._links, src, dst)
            found = self._kv_memo[(src, dst)] = transfer_seconds(link, self.snapshot.links.state(key),
                                                                 self.num_bytes)
        return found

    def _kv_floor(self) -> float:
        return min(transfer_seconds(Link("", "", gbps, latency_ms), IDLE, self.num_bytes)
                   for gbps, latency_ms in link_classes(self.snapshot.topology))

    def _prefill(self, tokens: int) -> float:
        found = self._prefill_memo.get(tokens)
        if found is None:
            found = self._prefill_memo[tokens] = self.profile.prefill_seconds(tokens)
        return found

    def _step(self, batch: int, context: int) -> float:
        return self.profile.decode_step_seconds(batch, context)  # the profile remembers recent ones

    def _exhaustive(self, feasible: Feasible | None) -> Estimate | None:
        self.fallbacks += 1
        pairs = [self._pair(p, d) for d in self.decodes for p in self.prefills if p.worker_id != d.worker_id]
        if feasible is not None:
            pairs = [e for e in pairs if feasible(e)]
        return min(pairs, key=lambda e: order(e, self.load), default=None)


class _Generic:
    """Nodes that a prefill worker's node reaches over the remote default link, with nothing on
    it that the router's view reports (no flow, no measurement below the default capacity):
    every such node has the same link time, so the search prices them together.

    `special(node)`: the decode nodes that are not like that for a prefill worker on `node` (its
    own node, explicit topology links from it, links with flows or measured rates), or None when
    they are most of them (or node names contain "->", which would make link keys ambiguous):
    then every node is priced one by one."""

    def __init__(self, search: Pruned, entries, nodes) -> None:
        snapshot = search.snapshot
        topology = snapshot.topology
        self.kv = transfer_seconds(Link("", "", topology.remote_gbps, topology.remote_latency_ms), IDLE,
                                   search.num_bytes)
        self.d_nodes = {t[3] for t in nodes}
        self.order = sorted(((admit, search.load[d.worker_id], d.worker_id, d, node) for d, node, admit, _ in entries),
                            key=lambda t: t[:3])
        self.next_admit = [0] * len(self.order)
        following = len(self.order)
        for k in range(len(self.order) - 1, -1, -1):
            if k + 1 < len(self.order) and self.order[k + 1][0] != self.order[k][0]:
                following = k + 1
            self.next_admit[k] = following
        self._out = topology_cache(topology)[2]
        self._busy: dict[str, set[str]] = {}
        self.ambiguous = any("->" in n for n in self.d_nodes) or any(
            "->" in snapshot.node_of(p) for p in search.prefills)
        if not self.ambiguous:
            for key, state in snapshot.links.links.items():
                if state.active_flows == 0 and (state.measured_gbps is None
                                                 or state.measured_gbps >= topology.remote_gbps):
                    continue  # the same time as the idle default link
                src, _, dst = key.partition("->")
                self._busy.setdefault(src, set()).add(dst)
        self._memo: dict[str, set[str] | None] = {}

    def special(self, node: str) -> set[str] | None:
        if self.ambiguous:
            return None
        if node in self._memo:
            return self._memo[node]
        special = ({node} | self._out.get(node, set()) | self._busy.get(node, set())) & self.d_nodes
        found = self._memo[node] = None if 2 * len(special) > len(self.d_nodes) else special
        return found


# Per topology (immutable; kept by identity, a few at a time): its link classes, and the links
# between node pairs it has been asked for with their keys (Topology.link builds a default
# link anew on every call).
_TOPOLOGIES: dict[int, tuple] = {}
_MAX_LINKS = 1 << 20


def topology_cache(topology: Topology):
    """(link classes, the links asked for by node pair, the nodes each node has explicit links to)
    of `topology`, kept by identity; shared by the pruned search and its vector form."""
    found = _TOPOLOGIES.get(id(topology))
    if found is None or found[0] is not topology:
        classes = tuple(sorted({(topology.local_gbps, topology.local_latency_ms),
                                (topology.remote_gbps, topology.remote_latency_ms),
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


def link_classes(topology: Topology) -> tuple[tuple[float, float], ...]:
    """The distinct (capacity Gbit/s, latency ms) of a topology's links and its two defaults."""
    return topology_cache(topology)[0]


def options(profile: Profile, request: RequestInfo, prefills: Sequence[WorkerSnapshot],
            decodes: Sequence[WorkerSnapshot], snapshot: ClusterSnapshot, load: dict[str, int], pair: PairFn,
            local: LocalFn, cached_tokens: Callable[[str], int], *,
            exhaustive_max_pairs: int = EXHAUSTIVE_MAX_PAIRS) -> Exhaustive | Pruned:
    """Every option priced when there are at most `exhaustive_max_pairs` pairs, else the pruned search."""
    if len(prefills) * len(decodes) <= exhaustive_max_pairs:
        return Exhaustive(prefills, decodes, load, pair, local)
    return Pruned(profile, request, prefills, decodes, snapshot, load, pair, local, cached_tokens)
