"""The autoscaling rule: `decide(state, config, memory) -> (Decision, memory)`, pure.

No I/O and no clock: the caller passes the time in the state. What it decides, in order:

1. a change under way (a worker starting or draining), or the cooldown since the last change
   not over: hold;
2. a pool below its minimum: add one there; above its maximum: drain one there;
3. the SLO attainment of the window below `target_attainment` (with at least `min_requests`
   finished since the last change): scale up the pool that is the bound:
   - decode-bound: TPOT misses, or the decode batches full (running near `max_num_seqs`, or the
     KV cache nearly used);
   - prefill-bound: TTFT misses with requests queued at the prefill workers (or none at the
     decode workers: a first token is the prefill's work);
   - otherwise decode (TTFT misses with the queue at the decode workers: reservations wait);
   in colocated and hybrid mode there is one pool, `mixed`;
   with hybrid workers (mixed workers that move KV, `ClusterState.duties`), shift one worker's
   duty a step toward the bound phase instead of starting a process (below);
   the bound pool at its maximum: hold, saying so;
4. a queue that grows before the attainment shows it: a pool with at least `queue_up` requests
   queued per worker, not falling, for `queue_stable` consecutive intervals, while the window
   does not show the SLO met comfortably (attainment under `down_attainment`, or fewer than
   `min_requests` requests since the last change): add one there (the
   requests of a step up miss only once they have waited the TTFT SLO, and the attainment
   counts only those that arrived since the last change, so without this a second addition
   waits for the window to refill);
5. a load that rises before any request misses: a pool with at least `up_load` requests in
   flight per worker (the router's count, averaged over the window since the last change) and
   at least `up_utilisation` of its workers busy, the load not falling, for `up_stable`
   consecutive intervals: add one there (`load_rising`; the pool the most over `up_load` first),
   whatever the attainment (it is meant to fire while the SLO still holds: a worker takes tens
   of seconds to load, and the misses show only once requests have waited out the SLO);
6. with hybrid workers of a specialist duty (prefill or decode), when the pool of the hybrid
   workers (`mixed`) meets the scale-down's conditions (7) for `down_stable` consecutive
   intervals: a worker of that duty (the duty with more workers first, decode on a tie) leaves
   when the pool is above its minimum and the others can still run both phases
   (`idle_specialist`, action remove, `source` the duty), else it moves a step back to mixed
   duty (`relax_to_mixed`, action shift; the pool's minimum apart); no mixed-duty worker is
   removed while a specialist is left (below);
7. attainment at least `down_attainment` and a pool whose utilisation would stay under
   `down_utilisation` with one worker fewer, for `down_stable` consecutive intervals: drain one
   worker of it (the pool with the lowest such utilisation first). A decode or mixed pool's
   utilisation is the load trigger's when it is on (requests in flight per worker over
   `up_load`: under `up_load * down_utilisation` per worker), not the share of its workers that
   are busy: a batching worker is busy with one request in its batch, so the busy share kept
   every decode worker of a GPU step from leaving at a light load (run 13 of docs/planner.md,
   "Live: `pdserve up --autoscale`"). A prefill pool's, and every pool's with the load trigger
   off, is the busy share (and, with it on, the load must stay under `up_load *
   down_utilisation` too): a prefill worker holds a request only while it prefills, so far fewer
   than a decode batch at its capacity.

Why the load trigger needs both figures: "busy" (a worker with anything in flight) saturates for
a batching decode worker (one request keeps it busy), so alone it cannot tell a light load from
a heavy one; requests in flight per worker (Little's law: arrival rate x time in the system) grow
with the load and with the latency (both as measured in the CPU step, run 5 of docs/planner.md,
"Live: `pdserve up --autoscale`"). How many a worker holds within the SLO depends on the model
and the device (a GPU batches hundreds), so `up_load` is off (0) unless the cluster file sets it.

Role shifts (hybrid workers): the router counts each hybrid worker as a prefill, decode or
mixed worker (its duty, router.cluster.directory). Duties form a ladder prefill - mixed - decode;
when the bound phase is decode (TPOT misses, full decode batches) a worker moves one step toward
decode: a prefill-duty worker back to mixed, else a mixed one to decode duty; the same toward
prefill on TTFT misses. A shift that would leave no worker able to run the other phase (no
prefill-capable or no decode-capable hybrid worker) is not made: then a process is added as
before. Nor is a shift that undoes the last change: when the last change was a shift toward the
other phase, the workers are too few for both phases and a process is added (without this a
load that neither split of the workers serves swaps a duty back and forth every cooldown). A
shift is a change: the cooldown follows it.

Duties go back to mixed when the load falls (6): on the scale-down's own conditions and counts
(attainment at least `down_attainment`, the pool's utilisation under `down_utilisation` even
with one worker fewer, for `down_stable` intervals), one step per decision, each a change with
its cooldown. Where the pool may lose a worker (above its minimum), the specialist itself is
removed instead of relaxed, so a step down from a peak takes one change per worker, not a relax
and then a removal; only when the pool is at its minimum (or removing the specialist would leave
a phase without a worker) does it relax.
Either way no mixed-duty worker leaves while a specialist is left: this step is tried first,
and its conditions include the removal's. It does not oscillate: a shift needs
attainment under `target_attainment`, a relax at least the higher `down_attainment` and the
pool lightly used with a worker fewer (a load that caused a shift, TPOT misses or full busy
batches, keeps its duties), and a relaxed worker does not shift back within the cooldown nor
before the attainment falls below the target again.

Hysteresis: a scale-up needs attainment under `target_attainment` (or a load at or over
`up_load` per worker with `up_utilisation` busy), a scale-down attainment over the higher
`down_attainment` *and* low utilisation for several intervals *and* a utilisation that stays
low after the removal (with the load trigger on, a load under `up_load * down_utilisation` per
worker, half the trigger's at the default; else a busy share under `down_utilisation` <
`up_utilisation`); and a cooldown follows every change. A steady load therefore settles: it adds
what it needs and does not take it back, and what a removal leaves does not add again.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

POOLS = ("prefill", "decode", "mixed")
Action = Literal["add", "remove", "shift", "hold"]
DUTIES = ("prefill", "mixed", "decode")  # the ladder a hybrid worker's duty moves along


AUTO = "auto"
UP_LOAD_SHARE = 0.75  # `up_load: auto`: this share of the requests a worker holds within its bounds


def auto_up_load(max_num_seqs: int, slo_tpot: float | None = None,
                 decode_step_s: Callable[[int], float] | None = None) -> tuple[float, str]:
    """`up_load: auto`: the requests in flight per worker at which a pool counts as loaded, and why.
    A decode worker holds at most `max_num_seqs` requests in its batch, and with a profile
    (`decode_step_s`: batch -> seconds a decode step takes) and a TPOT SLO, at most the largest
    batch whose step stays within the SLO; the threshold is UP_LOAD_SHARE of the smaller, at
    least 1 (what run 14 of docs/planner.md set by hand for its slots). A removal then needs the
    load under `down_utilisation` of it (the rule's hysteresis)."""
    if isinstance(max_num_seqs, bool) or not isinstance(max_num_seqs, int) or max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be an integer >= 1, got {max_num_seqs!r}")
    held, why = max_num_seqs, f"max_num_seqs {max_num_seqs}"
    if decode_step_s is not None and slo_tpot is not None and slo_tpot > 0:
        lo, hi = 0, max_num_seqs  # the largest batch within the SLO (step time grows with the batch)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if decode_step_s(mid) <= slo_tpot:
                lo = mid
            else:
                hi = mid - 1
        if lo < held:
            held, why = max(lo, 1), (f"the profile's decode step is within the TPOT SLO {slo_tpot:g}s up to "
                                     f"batch {lo} (max_num_seqs {max_num_seqs})")
        else:
            why += f"; the profile's decode step stays within the TPOT SLO {slo_tpot:g}s there"
    value = max(1.0, round(UP_LOAD_SHARE * held, 2))
    return value, f"up_load auto = {value:g}: {UP_LOAD_SHARE:g} of the {held} requests a worker holds ({why})"


@dataclass(frozen=True)
class AutoscaleConfig:
    """Bounds and thresholds of the rule and the loop (the `autoscale:` mapping of a cluster file)."""

    min_workers: Mapping[str, int] = field(default_factory=lambda: {"prefill": 1, "decode": 1, "mixed": 1})
    max_workers: Mapping[str, int] = field(default_factory=lambda: {"prefill": 3, "decode": 3, "mixed": 4})
    interval_s: float = 5.0  # how often the loop decides
    cooldown_s: float = 20.0  # no change within this long after the last one ended
    window_s: float = 30.0  # the sliding window of finished requests (and of utilisation samples)
    target_attainment: float = 0.9  # scale up below this
    down_attainment: float = 0.97  # scale down only at or above this ...
    down_utilisation: float = 0.5  # ... and when the pool would stay below this utilisation with one worker fewer
    # (up_load on: requests in flight per worker over up_load; off: the share of workers busy)
    down_stable: int = 3  # ... for this many consecutive intervals
    min_requests: int = 5  # finished requests in the window before attainment counts
    full_batch: float = 0.9  # decode batch (running / max_num_seqs) or KV usage counted as full
    prefill_queue: float = 1.0  # requests queued per prefill worker that make prefill the bound
    queue_up: float = 3.0  # requests queued per worker that, not falling, add a worker (0: off) ...
    queue_stable: int = 2  # ... after this many consecutive intervals
    # requests in flight per worker (window mean) that, not falling, add one (0: off; "auto": from
    # the workers' batch cap and profile, `auto_up_load`, resolved when the loop starts) ...
    up_load: float | str = 0.0
    up_utilisation: float = 0.8  # ... with at least this fraction of the pool's workers busy (> down_utilisation) ...
    up_stable: int = 2  # ... for this many consecutive intervals
    drain_timeout_s: float = 600.0  # a drain that has not emptied the worker by then is abandoned (it stays)
    # warm spares per pool: workers started and warmed but not serving, which an addition takes
    # at once (launcher.autoscale.loop); a drained worker becomes one while the pool has fewer
    spares: Mapping[str, int] = field(default_factory=dict)
    # a `pdserve profile` JSON for `up_load: auto` (default: the cluster's --profile, if any)
    profile: str | None = None

    def __post_init__(self) -> None:
        def fail(key: str, message: str) -> None:
            raise ValueError(f"autoscale.{key}: {message}")

        if isinstance(self.spares, int) and not isinstance(self.spares, bool):  # one number: every pool
            object.__setattr__(self, "spares", dict.fromkeys(POOLS, self.spares))
        for key in ("min_workers", "max_workers", "spares"):
            value = getattr(self, key)
            if not isinstance(value, Mapping):
                fail(key, f"must be a mapping of pool ({', '.join(POOLS)}) to a number of workers, got {value!r}")
            for pool, n in value.items():
                if pool not in POOLS:
                    fail(key, f"unknown pool {pool!r}; pools are {', '.join(POOLS)}")
                if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                    fail(key, f"{pool} must be an integer >= 0, got {n!r}")
        defaults = AutoscaleConfig.__dataclass_fields__
        object.__setattr__(self, "min_workers", {**defaults["min_workers"].default_factory(), **self.min_workers})
        object.__setattr__(self, "max_workers", {**defaults["max_workers"].default_factory(), **self.max_workers})
        for pool in POOLS:
            if self.max_workers[pool] < self.min_workers[pool]:
                fail("max_workers", f"{pool} {self.max_workers[pool]} is below autoscale.min_workers "
                                    f"{self.min_workers[pool]}")
        for key in ("interval_s", "window_s", "drain_timeout_s"):
            value = getattr(self, key)
            if not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
                fail(key, f"must be a number > 0, got {value!r}")
        if not (isinstance(self.cooldown_s, (int, float)) and self.cooldown_s >= 0 and math.isfinite(self.cooldown_s)):
            fail("cooldown_s", f"must be a number >= 0, got {self.cooldown_s!r}")
        for key in ("target_attainment", "down_attainment", "down_utilisation", "up_utilisation", "full_batch"):
            value = getattr(self, key)
            if not (isinstance(value, (int, float)) and 0 < value <= 1):
                fail(key, f"must be in (0, 1], got {value!r}")
        if self.down_attainment < self.target_attainment:
            fail("down_attainment", f"must be >= autoscale.target_attainment ({self.target_attainment}), "
                                    f"got {self.down_attainment} (the gap is the hysteresis)")
        if self.up_utilisation <= self.down_utilisation:
            fail("up_utilisation", f"must be > autoscale.down_utilisation ({self.down_utilisation}), got "
                                   f"{self.up_utilisation} (a removal must not leave the pool busy enough to add)")
        for key in ("down_stable", "min_requests", "queue_stable", "up_stable"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                fail(key, f"must be an integer >= 1, got {value!r}")
        if self.profile is not None and (not isinstance(self.profile, str) or not self.profile.strip()):
            fail("profile", f"must be the path of a `pdserve profile` JSON, got {self.profile!r}")
        if isinstance(self.up_load, str) and self.up_load.strip().lower() == AUTO:
            object.__setattr__(self, "up_load", AUTO)
        elif isinstance(self.up_load, str):
            fail("up_load", f"must be a number >= 0 or {AUTO!r}, got {self.up_load!r}")
        for key in ("prefill_queue", "queue_up", "up_load"):
            value = getattr(self, key)
            if value == AUTO:
                continue
            if not (isinstance(value, (int, float)) and value >= 0 and math.isfinite(value)):
                fail(key, f"must be a number >= 0, got {value!r}")

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any] | bool | None) -> AutoscaleConfig:
        """From the cluster file's `autoscale:` (true, or a mapping with `min`/`max` per pool and
        the fields above, `-` or `_` in the keys); ValueError naming the key."""
        if data is None or data is True:
            return cls()
        if not isinstance(data, Mapping):
            raise ValueError(f"autoscale: must be true or a mapping of settings, got {data!r}")
        names = {f for f in cls.__dataclass_fields__}
        aliases = {"min": "min_workers", "max": "max_workers", "cooldown": "cooldown_s", "interval": "interval_s",
                   "window": "window_s", "target": "target_attainment", "spare": "spares"}
        values: dict[str, Any] = {}
        for raw, value in data.items():
            key = str(raw).replace("-", "_")
            key = aliases.get(key, key)
            if key not in names:
                raise ValueError(f"autoscale: unknown key {raw!r}; keys are min, max, "
                                 + ", ".join(sorted(names - {'min_workers', 'max_workers'})))
            values[key] = value
        return cls(**values)


@dataclass(frozen=True)
class PoolState:
    """One pool as the router sees it now (draining workers apart)."""

    workers: int  # serving (not draining) workers
    draining: int = 0
    waiting: float = 0.0  # requests queued at its workers now (the workers' queues + awaiting KV)
    running: float = 0.0  # requests in its workers' batches now
    busy: float = 0.0  # mean fraction of its workers busy over the window (0..1)
    load: float = 0.0  # mean requests in flight per worker over the window (queued, running, reserved)
    batch_full: float = 0.0  # the fullest worker's max(running / max_num_seqs, KV usage), 0..1


@dataclass(frozen=True)
class ClusterState:
    """What the loop reads each interval; times are the caller's clock (seconds)."""

    now: float
    pools: Mapping[str, PoolState]
    finished: int = 0  # requests finished (or failed) since max(now - window, the last change)
    attainment: float = 1.0  # fraction of them that met both SLOs (failures miss)
    ttft_attainment: float = 1.0
    tpot_attainment: float = 1.0
    arrival_rate: float = 0.0  # requests per second over the window
    changing: bool = False  # a worker is starting or draining
    duties: Mapping[str, int] = field(default_factory=dict)  # hybrid workers (serving) per duty; {}: none


@dataclass(frozen=True)
class Decision:
    action: Action
    pool: str | None  # None for hold
    code: str  # short label (the metric's `reason`): e.g. ttft_miss_prefill_queue, idle, cooldown
    reason: str  # the sentence, with the figures
    source: str | None = None  # shift: the duty a worker leaves (`pool` is the one it takes)


@dataclass(frozen=True)
class RuleMemory:
    """What the rule carries from one interval to the next."""

    last_change_at: float = -math.inf
    calm: Mapping[str, int] = field(default_factory=dict)  # pool -> consecutive intervals it could shrink
    pressure: Mapping[str, int] = field(default_factory=dict)  # pool -> consecutive intervals its queue grew
    queue: Mapping[str, float] = field(default_factory=dict)  # pool -> requests queued per worker, last interval
    loaded: Mapping[str, int] = field(default_factory=dict)  # pool -> consecutive intervals over up_load
    quiet: int = 0  # consecutive intervals the hybrid workers' pool could relax a duty (calm, its minimum apart)
    shifted_to: str | None = None  # the phase the last change shifted a duty toward; None: another change
    load: Mapping[str, float] = field(default_factory=dict)  # pool -> requests in flight per worker, last interval


def _hold(code: str, reason: str) -> Decision:
    return Decision("hold", None, code, reason)


def _bound_pool(state: ClusterState, config: AutoscaleConfig) -> tuple[str, str, str]:
    """(pool, code, reason) of the pool that bounds the SLO attainment."""
    pools = state.pools
    head = (f"attainment {state.attainment:.2f} < {config.target_attainment:.2f} "
            f"(TTFT {state.ttft_attainment:.2f}, TPOT {state.tpot_attainment:.2f}, {state.finished} requests)")
    if "mixed" in pools and "decode" not in pools:
        return "mixed", "slo_miss", head
    decode = pools.get("decode", PoolState(0))
    prefill = pools.get("prefill", PoolState(0))
    if state.tpot_attainment < config.target_attainment:
        return "decode", "tpot_miss", f"{head}: TPOT misses, decode-bound"
    if decode.batch_full >= config.full_batch:
        return "decode", "decode_full", f"{head}: decode batches full ({decode.batch_full:.2f}), decode-bound"
    queue_p = prefill.waiting / max(prefill.workers, 1)
    queue_d = decode.waiting / max(decode.workers, 1)
    if queue_p >= config.prefill_queue or queue_p >= queue_d:
        return ("prefill", "ttft_miss_prefill_queue",
                f"{head}: TTFT misses, {queue_p:.1f} queued per prefill worker, prefill-bound")
    return ("decode", "ttft_miss_decode_queue",
            f"{head}: TTFT misses, {queue_d:.1f} queued per decode worker (prefill {queue_p:.1f}), decode-bound")


def _bound_phase(state: ClusterState, config: AutoscaleConfig) -> str:
    """decode on TPOT misses or full decode batches (of any pool), else prefill (TTFT misses)."""
    if state.tpot_attainment < config.target_attainment:
        return "decode"
    if any(p.batch_full >= config.full_batch for p in state.pools.values()):
        return "decode"
    return "prefill"


def _shift(state: ClusterState, config: AutoscaleConfig, head: str, memory: RuleMemory) -> Decision | None:
    """The role shift toward the bound phase (module docstring), or None when none can be made."""
    duties = {d: state.duties.get(d, 0) for d in DUTIES}
    if sum(duties.values()) < 2:
        return None
    phase = _bound_phase(state, config)
    other = "prefill" if phase == "decode" else "decode"
    if memory.shifted_to == other:  # it would undo the last change: too few workers for both phases
        return None
    step = 1 if phase == "decode" else -1
    for source in (other, "mixed"):  # the far end first: a specialist of the other phase back to mixed
        if duties[source] == 0:
            continue
        target = DUTIES[DUTIES.index(source) + step]
        after = dict(duties)
        after[source] -= 1
        after[target] += 1
        if after[other] + after["mixed"] < 1:  # nobody left for the other phase
            continue
        why = "TPOT misses" if phase == "decode" and state.tpot_attainment < config.target_attainment else (
            "decode batches full" if phase == "decode" else "TTFT misses")
        counts = ", ".join(f"{d} {duties[d]}" for d in DUTIES)
        return Decision("shift", target, f"shift_to_{phase}",
                        f"{head}: {why}, {phase}-bound; a hybrid worker shifts from {source} to {target} duty "
                        f"(duties: {counts})", source=source)
    return None


def decide(state: ClusterState, config: AutoscaleConfig,
           memory: RuleMemory | None = None) -> tuple[Decision, RuleMemory]:
    """The decision for `state` (module docstring) and the memory for the next call."""
    memory = memory or RuleMemory()
    pools = state.pools
    # how long each pool could have lost a worker (counted every interval, whatever else happens)
    calm: dict[str, int] = {}
    shrinkable: dict[str, float] = {}
    for name, pool in pools.items():
        after = _light_after_removal(name, pool, state, config)
        if after is not None and pool.workers > config.min_workers[name]:
            calm[name] = memory.calm.get(name, 0) + 1
            shrinkable[name] = after
    # how long the hybrid workers could have relaxed a duty (the same conditions, at any size)
    specialists = {d: n for d, n in state.duties.items() if d != "mixed" and n > 0}
    quiet = 0
    if specialists and _light_after_removal("mixed", pools.get("mixed", PoolState(0)), state, config) is not None:
        quiet = memory.quiet + 1
    # how long each pool's queue has been long and not falling (counted every interval too)
    pressure: dict[str, int] = {}
    queue: dict[str, float] = {}
    for name, pool in pools.items():
        queue[name] = pool.waiting / max(pool.workers, 1)
        if config.queue_up > 0 and queue[name] >= config.queue_up and queue[name] >= memory.queue.get(name, 0.0):
            pressure[name] = memory.pressure.get(name, 0) + 1
    # how long each pool's load has been at or over up_load per worker, busy and not falling
    loaded: dict[str, int] = {}
    load: dict[str, float] = {}
    for name, pool in pools.items():
        load[name] = pool.load
        if (config.up_load > 0 and pool.workers > 0 and pool.load >= config.up_load
                and pool.busy >= config.up_utilisation and pool.load >= memory.load.get(name, 0.0)):
            loaded[name] = memory.loaded.get(name, 0) + 1
    memory = replace(memory, calm=calm, pressure=pressure, queue=queue, loaded=loaded, load=load, quiet=quiet)

    if state.changing:
        return _hold("changing", "a worker is starting or draining"), memory
    since = state.now - memory.last_change_at
    if since < config.cooldown_s:
        return _hold("cooldown", f"cooldown: {since:.0f}s of {config.cooldown_s:.0f}s since the last change"), memory
    for name, pool in sorted(pools.items()):
        if pool.workers < config.min_workers[name]:
            return Decision("add", name, "below_min", f"{name}: {pool.workers} workers < min "
                                                      f"{config.min_workers[name]}"), _changed(memory, state)
        if pool.workers > config.max_workers[name] and pool.draining == 0:
            return Decision("remove", name, "above_max", f"{name}: {pool.workers} workers > max "
                                                         f"{config.max_workers[name]}"), _changed(memory, state)
    if state.finished >= config.min_requests and state.attainment < config.target_attainment:
        if state.duties:
            head = (f"attainment {state.attainment:.2f} < {config.target_attainment:.2f} "
                    f"(TTFT {state.ttft_attainment:.2f}, TPOT {state.tpot_attainment:.2f}, {state.finished} requests)")
            shift = _shift(state, config, head, memory)
            if shift is not None:
                return shift, replace(_changed(memory, state), shifted_to=shift.code.removeprefix("shift_to_"))
        name, code, reason = _bound_pool(state, config)
        pool = pools.get(name, PoolState(0))
        if pool.workers + pool.draining >= config.max_workers[name]:
            return _hold("at_max", f"{reason}; {name} is at its max {config.max_workers[name]}"), memory
        return Decision("add", name, code, reason), _changed(memory, state)
    growing = [name for name, n in pressure.items() if n >= config.queue_stable
               and pools[name].workers + pools[name].draining < config.max_workers[name]]
    # not when the window shows the SLO met comfortably (a long queue that still meets it)
    if growing and (state.attainment < config.down_attainment or state.finished < config.min_requests):
        name = max(growing, key=lambda n: (queue[n], n))
        return Decision("add", name, "queue_growing",
                        f"{name}: {queue[name]:.1f} requests queued per worker (>= {config.queue_up:g}) and not "
                        f"falling for {pressure[name]} intervals, attainment {state.attainment:.2f} over "
                        f"{state.finished} requests"), _changed(memory, state)
    rising = [name for name, n in loaded.items() if n >= config.up_stable
              and pools[name].workers + pools[name].draining < config.max_workers[name]]
    if rising:
        name = max(rising, key=lambda n: (load[n] / config.up_load, n))
        pool = pools[name]
        return Decision("add", name, "load_rising",
                        f"{name}: {pool.load:.1f} requests in flight per worker (>= {config.up_load:g}), "
                        f"{pool.busy:.2f} busy (>= {config.up_utilisation:.2f}), not falling for {loaded[name]} "
                        f"intervals, {state.arrival_rate:.2f} req/s, attainment {state.attainment:.2f} over "
                        f"{state.finished} requests"), _changed(memory, state)
    if quiet >= config.down_stable:  # no mixed worker leaves while a specialist is left
        source = max(specialists, key=lambda d: (specialists[d], d == "decode"))
        pool = pools["mixed"]
        counts = ", ".join(f"{d} {state.duties.get(d, 0)}" for d in DUTIES)
        head = f"attainment {state.attainment:.2f} >= {config.down_attainment:.2f} and"
        if calm.get("mixed", 0) >= config.down_stable and _both_phases_without(state.duties, source):
            # the pool can lose a worker: the specialist itself leaves (one change, not a relax then a removal)
            return Decision("remove", "mixed", "idle_specialist",
                            f"{head} {_lightness('mixed', pool, shrinkable['mixed'], config)} "
                            f"for {calm['mixed']} intervals; a hybrid worker of {source} duty leaves "
                            f"(duties: {counts})",
                            source=source), _changed(memory, state)
        after = _light_after_removal("mixed", pool, state, config) or 0.0
        return Decision("shift", "mixed", "relax_to_mixed",
                        f"{head} {_lightness('mixed', pool, after, config)} for {quiet} intervals; a hybrid worker "
                        f"shifts from {source} back to mixed duty (duties: {counts})",
                        source=source), _changed(memory, state)
    ready = {name: after for name, after in shrinkable.items() if calm[name] >= config.down_stable}
    if ready:
        name = min(ready, key=lambda n: (ready[n], n))
        pool = pools[name]
        why = (f"attainment {state.attainment:.2f} >= {config.down_attainment:.2f} and "
               f"{_lightness(name, pool, ready[name], config)} for {calm[name]} intervals")
        return Decision("remove", name, "idle", why), _changed(memory, state)
    return _hold("steady", f"attainment {state.attainment:.2f} over {state.finished} requests, "
                           f"{state.arrival_rate:.2f} req/s"), memory


def _both_phases_without(duties: Mapping[str, int], duty: str) -> bool:
    """Whether hybrid workers of `duties` less one of `duty` can still run both phases."""
    left = {**duties, duty: duties.get(duty, 0) - 1}
    return (left.get("prefill", 0) + left.get("mixed", 0) > 0) and (left.get("decode", 0) + left.get("mixed", 0) > 0)


def _light_after_removal(name: str, pool: PoolState, state: ClusterState, config: AutoscaleConfig) -> float | None:
    """The pool's busy fraction with one worker fewer when that, its load per worker with one
    fewer and the attainment all allow a scale-down (module docstring, 7); else None."""
    if pool.workers < 2 or pool.draining > 0 or state.attainment < config.down_attainment:
        return None
    fewer = pool.workers / (pool.workers - 1)
    if _by_load(name, config):
        # the load trigger's scale: requests in flight per worker as a share of up_load. Not the
        # busy share: a batching worker with one request in its batch is busy, so at a light
        # load every decode worker of a pool is busy and none could ever leave (module docstring)
        after = pool.load * fewer / config.up_load
        return after if after < config.down_utilisation else None
    after = pool.busy * fewer
    # nor a load per worker that the load trigger would read as rising (hysteresis)
    light = config.up_load <= 0 or pool.load * fewer < config.up_load * config.down_utilisation
    return after if after < config.down_utilisation and light else None


def _by_load(name: str, config: AutoscaleConfig) -> bool:
    """Whether pool `name`'s utilisation is its load (module docstring, 7): with the load trigger
    on, for the pools that batch decodes. A prefill worker holds a request only while it
    prefills, so its busy share is its utilisation, and up_load (sized on decode batches) is
    not its scale: at its capacity it holds far fewer requests."""
    return config.up_load > 0 and name != "prefill"


def _lightness(name: str, pool: PoolState, after: float, config: AutoscaleConfig) -> str:
    """The figures of a scale-down's utilisation test, for its reason."""
    if _by_load(name, config):
        return (f"{name} {pool.load:.2f} in flight per worker over {pool.workers} workers "
                f"({after * config.up_load:.2f} with one fewer, < {config.up_load * config.down_utilisation:.2f} "
                f"= up_load x down_utilisation)")
    return (f"{name} {pool.busy:.2f} busy over {pool.workers} workers ({after:.2f} with one fewer, "
            f"< {config.down_utilisation:.2f})")


def _changed(memory: RuleMemory, state: ClusterState) -> RuleMemory:
    return replace(memory, last_change_at=state.now, calm={}, pressure={}, loaded={}, quiet=0, shifted_to=None)
