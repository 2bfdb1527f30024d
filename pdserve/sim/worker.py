"""One simulated engine worker: the scheduler's rules on counters, step times from a profile.

The rules are those of `pdserve/scheduler.py` and `pdserve/block_manager.py` (a test runs
both side by side on random workloads and checks that they schedule the same batches):

1. Each step, running requests first, in admission order: a request in decode costs one token
   of the `max_num_batched_tokens` budget, an unfinished prefill a chunk of what is left.
   A request that needs a new block when none is free preempts the most recently admitted
   running request (by recompute: its blocks are freed, its generated tokens kept, it goes
   to the front of the waiting queue); it may preempt itself, which ends the pass.
2. Then waiting requests in arrival order, while budget is left, fewer than `max_num_seqs`
   run and free blocks hold all their tokens; none is admitted in a step that preempted.
3. A request whose computed tokens reach its tokens samples one token. Roles: `mixed` and
   `decode` run to `max_tokens`; `prefill` stops after the first token and holds the blocks
   until the KV has been handed off (`release`); `decode` also takes requests whose KV comes
   from elsewhere (`reserve` blocks for the prompt, then `commit` once it has landed). A
   `mixed` worker of a hybrid cluster does both per request: it hands off the requests the
   router split with it as their prefill worker, and reserves/commits those it decodes.

Prefix caching, by prompt identity: a request may carry a `prefix_key` (requests with the
same key have the same prompt tokens, e.g. a replayed run's prompts when the runs of one seed
repeat them). A worker that has computed a key's prompt keeps its full blocks cached; a later
request with that key admitted there starts with them computed (all but at least the last
token, as the engine never shares the block it writes), and the KV it hands off still covers
the whole prompt. Cached blocks are evicted least recently used when they exceed the worker's
blocks (the engine reuses them out of its free pool, so they cost no capacity; it may evict
earlier than this when running requests hold most blocks). Requests without a key (the
default; the engine's cache hits nothing on distinct synthetic and trace prompts) are never
cached. Not modelled: partial-prefix hits between different prompts, a prompt cached on a
decode worker by received KV, stop strings and EOS (requests run to `max_tokens`, as with
`ignore_eos`).

Step time (profile `P` = prefill seconds of n tokens on an idle worker, `D(b, c)` = decode
step of b requests at mean context c):

    step = sum over prefill chunks of max(P(s + n) - P(s), D(1, s + n))   (s = tokens already computed)
         + D(decodes, mean context of the decodes)

where a scheduled request with one new token counts as a decode. With a profile that has a mixed
table (`pdserve profile --mixed`), a step with both decodes and prefill chunks costs instead

    step = M(decodes, total prefill tokens of the step, mean context of the decodes)

(`Profile.mixed_step_seconds`: the measured step of a decode batch plus one chunk, which on a GPU
runs eagerly and costs more than chunk + decode; several chunks in one step count as one chunk of
their total tokens, and the chunks' own positions in their prompts are not priced). Steps of only
decodes or only chunks, and every step of a profile without the table, cost as above. When workers share a host
(`host`), the step is `step` core-seconds of work on the host's cores (one core at most per
worker), so a busy host stretches every step on it (the KV a prefill step streams is still
paced by the step's unstretched time: a simplification).

Overlapped decode steps (`overlap_steps`, the engine's default on a GPU): a decode-only step
that starts while nothing waits, of the whole running list, none of it ending by length at this
step (nor handed off) and with blocks free for the next token of each, has the next step (the
same requests, one token on) launched behind it, as `pdserve/engine.py` does; a request that
arrives during the first waits for both, and is admitted in the step after them. The profile's
decode steps are then the period of back-to-back overlapped steps (`pdserve profile`).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Callable

from pdserve.router.placement.profiles import Profile
from pdserve.sim.events import EventLoop
from pdserve.sim.fluid import Flow, FluidResource

WAITING, RUNNING, HELD, AWAITING_KV, FINISHED = range(5)
STATUS_NAMES = ("waiting", "running", "held", "awaiting_kv", "finished")


class SimRequest:
    """One request as the workers and the router of the simulator see it."""

    __slots__ = (
        "index", "request_id", "arrival", "num_prompt_tokens", "max_tokens", "num_output_tokens",
        "num_computed_tokens", "num_blocks", "reserved_blocks", "status", "num_preemptions", "token_times",
        "first_token_time", "last_token_time", "sent", "decision", "kv_flow", "kv_started", "kv_compute_done",
        "kv_sent", "prefill_rpc_start", "kv_bytes", "kv_seconds", "error", "status_code", "retries", "excluded",
        "monitor_flow", "prefill_worker", "decode_worker", "prefilled_time", "group", "prompt_tokens_est",
        "prefix_key",
    )

    def __init__(self, index: int, arrival: float, num_prompt_tokens: int, max_tokens: int,
                 *, record_tokens: bool = True, request_id: str | None = None) -> None:
        if num_prompt_tokens < 1 or max_tokens < 1:
            raise ValueError(f"request {index}: prompt and max_tokens must be >= 1, "
                             f"got {num_prompt_tokens} and {max_tokens}")
        self.index = index
        self.request_id = request_id or f"sim-{index:07d}"
        self.arrival = arrival
        self.num_prompt_tokens = num_prompt_tokens
        self.max_tokens = max_tokens
        self.num_output_tokens = 0
        self.num_computed_tokens = 0
        self.num_blocks = 0  # on the worker computing it
        self.reserved_blocks = 0  # on the decode worker, while its KV comes from the prefill worker
        self.status = WAITING
        self.num_preemptions = 0
        self.token_times: list[float] | None = [] if record_tokens else None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.sent = arrival
        self.decision = None
        self.kv_flow: Flow | None = None
        self.kv_started: float | None = None
        self.kv_compute_done = False
        self.kv_sent = False
        self.prefill_rpc_start = 0.0
        self.kv_bytes = 0
        self.kv_seconds: float | None = None
        self.error: str | None = None
        self.status_code = 200
        self.retries = 0
        self.excluded: frozenset[str] = frozenset()
        self.monitor_flow = None
        self.prefill_worker = None
        self.decode_worker = None
        self.prefilled_time: float | None = None
        self.group: int | None = None
        self.prompt_tokens_est: int | None = None
        self.prefix_key: object = None  # same key, same prompt tokens (prefix caching); None: never cached

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_output_tokens


# Tensor-parallel workers. A profile is measured at TP=1; a worker of N ranks steps in
#     t_N = t_1 * (s + (1 - s) / N)
# (Amdahl): the weights' and KV's reads and the matmuls split N ways, while a fraction s of the
# step does not (the sampler and scheduler on rank 0, norms, the two all-reduces per layer and
# the step's publication to the other ranks). s = TP_SERIAL_FRACTION unless a profile measured at
# TP=N is given instead. Its KV capacity is N times the blocks (each rank holds 1/N of the KV
# heads in the same memory per GPU; a model with fewer KV heads than ranks replicates them and
# gains less, which this model does not see).
TP_SERIAL_FRACTION = 0.1


def tp_step_scale(tp: int, serial_fraction: float = TP_SERIAL_FRACTION) -> float:
    """Step time at `tp` ranks over the step time at one (1.0 at tp 1)."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be a positive integer, got {tp!r}")
    return serial_fraction + (1.0 - serial_fraction) / tp


class StepCosts:
    """Memoized profile queries (the profile interpolates on every call), scaled to a worker of
    `tp` ranks (`tp_step_scale`)."""

    __slots__ = ("profile", "has_mixed", "_prefill", "_decode", "_chunk", "_mixed", "scale")

    def __init__(self, profile: Profile, tp: int = 1) -> None:
        self.profile = profile
        self.scale = tp_step_scale(tp)
        self.has_mixed = profile.has_mixed
        self._prefill: dict[int, float] = {}
        self._decode: dict[tuple[int, int], float] = {}
        self._chunk: dict[tuple[int, int], float] = {}
        self._mixed: dict[tuple[int, int, int], float] = {}

    def prefill(self, num_tokens: int) -> float:
        t = self._prefill.get(num_tokens)
        if t is None:
            t = self._prefill[num_tokens] = self.profile.prefill_seconds(num_tokens) * self.scale
        return t

    def decode(self, batch: int, context: int) -> float:
        key = (batch, context)
        t = self._decode.get(key)
        if t is None:
            if len(self._decode) > 500_000:
                self._decode.clear()
            t = self._decode[key] = self.profile.decode_step_seconds(batch, context) * self.scale
        return t

    def chunk(self, start: int, num_new: int) -> float:
        key = (start, num_new)
        t = self._chunk.get(key)
        if t is None:
            if len(self._chunk) > 500_000:
                self._chunk.clear()
            end = start + num_new
            t = max(self.prefill(end) - (self.prefill(start) if start else 0.0), self.decode(1, end))
            self._chunk[key] = t
        return t

    def mixed(self, batch: int, chunk_tokens: int, context: int) -> float:
        """A step of `batch` decodes plus `chunk_tokens` prefill tokens (the profile's mixed table)."""
        key = (batch, chunk_tokens, context)
        t = self._mixed.get(key)
        if t is None:
            if len(self._mixed) > 500_000:
                self._mixed.clear()
            t = self._mixed[key] = self.profile.mixed_step_seconds(batch, chunk_tokens, context) * self.scale
        return t


class SimWorker:
    """The engine of one worker (module docstring). The cluster sets the hooks:

    - `on_token(worker, request, now)`: a token was sampled (decode and mixed roles, and the
      first token on a prefill worker);
    - `on_finished(worker, request, now)`: the request reached max_tokens here (its blocks are freed);
    - `on_prefilled(worker, request, now)`: a request this worker prefills for another (prefill
      role, or mixed and split by the router): the first token is sampled and the KV held;
    - `on_chunk(worker, request, num_new, seconds)`: for such a request, a step computing
      `num_new` of its prompt tokens starts and lasts about `seconds`.
    """

    __slots__ = (
        "loop", "worker_id", "role", "node", "num_blocks", "block_size", "max_num_batched_tokens",
        "max_num_seqs", "costs", "host", "waiting", "running", "num_free_blocks", "busy",
        "on_token", "on_finished", "on_prefilled", "on_chunk", "num_preemptions", "num_steps",
        "busy_seconds", "_batch", "_step_started", "num_held", "num_awaiting", "healthy", "_kick_pending",
        "prefix_cache", "num_cached_blocks", "num_prefix_hit_tokens", "overlap_steps", "_ahead",
    )

    def __init__(
        self, loop: EventLoop, worker_id: str, role: str, *, num_blocks: int, block_size: int,
        max_num_batched_tokens: int, max_num_seqs: int, costs: StepCosts, node: str = "",
        host: FluidResource | None = None, overlap_steps: bool = False,
    ) -> None:
        if role not in ("prefill", "decode", "mixed"):
            raise ValueError(f"worker {worker_id!r}: role must be prefill, decode or mixed, got {role!r}")
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size),
                            ("max_num_batched_tokens", max_num_batched_tokens), ("max_num_seqs", max_num_seqs)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"worker {worker_id!r}: {name} must be a positive integer, got {value!r}")
        self.loop = loop
        self.worker_id = worker_id
        self.role = role
        self.node = node
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.costs = costs
        self.host = host
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.num_free_blocks = num_blocks
        self.busy = False
        self.healthy = True
        self.on_token: Callable | None = None
        self.on_finished: Callable | None = None
        self.on_prefilled: Callable | None = None
        self.on_chunk: Callable | None = None
        self.num_preemptions = 0
        self.num_steps = 0
        self.busy_seconds = 0.0
        self._batch: list[tuple[SimRequest, int]] = []
        self._step_started = 0.0
        self.num_held = 0
        self.num_awaiting = 0
        self._kick_pending = False
        self.prefix_cache: OrderedDict[object, int] = OrderedDict()  # key -> cached tokens, LRU first
        self.num_cached_blocks = 0
        self.num_prefix_hit_tokens = 0
        self.overlap_steps = overlap_steps
        self._ahead = 0  # overlap: the next step is the decode-only step of the first _ahead running

    # ---------------------------------------------------------------- queue management

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def add(self, request: SimRequest) -> None:
        """A request to run here from its prompt (mixed, prefill, or a local run on decode)."""
        request.status = WAITING
        self.waiting.append(request)
        self.kick()

    def can_reserve(self, num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) <= self.num_free_blocks

    def reserve(self, request: SimRequest) -> bool:
        """Decode role: blocks for the prompt's KV that another worker computes; False when
        they are not free (the engine's NoKVSpaceError)."""
        need = self.blocks_needed(request.num_prompt_tokens)
        if need > self.num_free_blocks:
            return False
        self.num_free_blocks -= need
        request.reserved_blocks = need
        request.status = AWAITING_KV
        self.num_awaiting += 1
        return True

    def commit(self, request: SimRequest) -> None:
        """Decode role: the KV landed; the request joins the batch with the prefill's first token."""
        self.num_awaiting -= 1
        request.num_blocks, request.reserved_blocks = request.reserved_blocks, 0
        request.num_computed_tokens = request.num_prompt_tokens
        request.num_output_tokens = max(request.num_output_tokens, 1)
        request.status = RUNNING
        self.running.append(request)
        self.kick()

    def release(self, request: SimRequest) -> None:
        """Prefill role: the held KV has been handed off; its blocks are freed."""
        if request.status == HELD:
            self.num_held -= 1
        self._free(request)
        request.status = FINISHED

    def abort(self, request: SimRequest) -> None:
        """Ends `request` wherever it is here and frees its blocks."""
        if request.status == RUNNING and request in self.running:
            self.running.remove(request)
        elif request.status == WAITING and request in self.waiting:
            self.waiting.remove(request)
        elif request.status == HELD:
            self.num_held -= 1
        self._free(request)
        request.status = FINISHED

    def cancel_reservation(self, request: SimRequest) -> None:
        """Decode role: frees the blocks `reserve` took (the request ended at its first token).
        (A request's status belongs to the worker computing it, so reservations are counted apart.)"""
        self.num_awaiting -= 1
        self.num_free_blocks += request.reserved_blocks
        request.reserved_blocks = 0

    def _free(self, request: SimRequest) -> None:
        self.num_free_blocks += request.num_blocks
        request.num_blocks = 0

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # ---------------------------------------------------------------- the step

    def kick(self) -> None:
        """Starts a step, once every event of this instant has run, if the worker is idle and
        has work (requests that arrive together are scheduled together, as the engine loop
        picks up everything queued since its last step)."""
        if not self.busy and not self._kick_pending:
            self._kick_pending = True
            self.loop.at(self.loop.now, self._kicked, late=True)

    def _kicked(self, _arg=None) -> None:
        self._kick_pending = False
        if not self.busy and (self.running or self.waiting):
            self._start_step()

    def schedule(self, ahead: int = 0) -> tuple[list[tuple[SimRequest, int]], list[SimRequest]]:
        """One step's batch [(request, new tokens)] and the requests it preempted (the rules above);
        `ahead` > 0: the step launched ahead of the last one (overlap), of the first `ahead`
        running requests only, no admission."""
        batch: list[tuple[SimRequest, int]] = []
        preempted: list[SimRequest] = []
        budget = self.max_num_batched_tokens
        running = self.running
        bs = self.block_size
        index = 0
        limit = min(ahead, len(running)) if ahead else None
        while index < (len(running) if limit is None else limit) and budget > 0:
            seq = running[index]
            left = seq.num_prompt_tokens + seq.num_output_tokens - seq.num_computed_tokens
            num_new = left if left < budget else budget
            need = -(-(seq.num_computed_tokens + num_new) // bs) - seq.num_blocks
            while need > self.num_free_blocks:
                victim = running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status != RUNNING:
                break
            if need > 0:
                self.num_free_blocks -= need
                seq.num_blocks += need
            batch.append((seq, num_new))
            budget -= num_new
            index += 1

        waiting = self.waiting
        while limit is None and waiting and budget > 0 and len(running) < self.max_num_seqs and not preempted:
            seq = waiting[0]
            total = seq.num_prompt_tokens + seq.num_output_tokens
            need = -(-total // bs)
            if need > self.num_free_blocks:
                break
            waiting.popleft()
            self.num_free_blocks -= need
            seq.num_blocks = need
            seq.num_computed_tokens = self._cached_tokens(seq, total)
            seq.status = RUNNING
            running.append(seq)
            left = total - seq.num_computed_tokens
            num_new = left if left < budget else budget
            batch.append((seq, num_new))
            budget -= num_new
        return batch, preempted

    def _cached_tokens(self, seq: SimRequest, total: int) -> int:
        """Tokens of `seq` whose KV this worker's prefix cache holds (0 without a key or a hit);
        at least one token is left to compute."""
        if seq.prefix_key is None:
            return 0
        cached = self.prefix_cache.get(seq.prefix_key)
        if not cached:
            return 0
        self.prefix_cache.move_to_end(seq.prefix_key)
        if cached >= total:
            cached = (total - 1) // self.block_size * self.block_size
        self.num_prefix_hit_tokens += cached
        return cached

    def _cache_prompt(self, seq: SimRequest) -> None:
        """The full blocks of `seq`'s prompt, now computed here, join the prefix cache."""
        tokens = seq.num_prompt_tokens // self.block_size * self.block_size
        cache = self.prefix_cache
        old = cache.pop(seq.prefix_key, 0)
        cache[seq.prefix_key] = max(old, tokens)
        self.num_cached_blocks += (max(old, tokens) - old) // self.block_size
        while self.num_cached_blocks > self.num_blocks and cache:
            _, evicted = cache.popitem(last=False)
            self.num_cached_blocks -= evicted // self.block_size

    def _preempt(self, seq: SimRequest) -> None:
        self.running.remove(seq)
        self._free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def step_seconds(self, batch: list[tuple[SimRequest, int]]) -> float:
        costs = self.costs
        seconds = 0.0
        decodes = 0
        context = 0
        chunk_tokens = 0
        for seq, num_new in batch:
            if num_new == 1:
                decodes += 1
                context += seq.num_computed_tokens + 1
            else:
                seconds += costs.chunk(seq.num_computed_tokens, num_new)
                chunk_tokens += num_new
        if decodes:
            if chunk_tokens and costs.has_mixed:
                return costs.mixed(decodes, chunk_tokens, int(context / decodes + 0.5))
            seconds += costs.decode(decodes, int(context / decodes + 0.5))
        return seconds

    def _start_step(self) -> None:
        ahead, self._ahead = self._ahead, 0
        batch, _ = self.schedule(ahead)
        if not batch:
            return
        if self.overlap_steps and not self.waiting and self._launches_ahead(batch):
            self._ahead = len(batch)
        seconds = self.step_seconds(batch)
        self.busy = True
        self._batch = batch
        self._step_started = self.loop.now
        if self.on_chunk is not None and self.role != "decode":
            for seq, num_new in batch:
                if seq.num_computed_tokens < seq.num_prompt_tokens and self._hands_off(seq):
                    self.on_chunk(self, seq, num_new, seconds)
        if self.host is None:
            self.loop.after(seconds, self._end_step)
        else:
            self.host.add(Flow(seconds, self._end_step, cap=1.0, owner=self))

    def _launches_ahead(self, batch: list[tuple[SimRequest, int]]) -> bool:
        """The engine's rule for launching the next step behind this one (pdserve/engine.py,
        `_can_launch_ahead`): a decode-only step of the whole running list on a worker that keeps
        what it decodes, none of it ending by length at this step, free blocks for every next token."""
        if self.role == "prefill" or len(batch) != len(self.running):
            return False
        bs = self.block_size
        missing = 0
        for seq, num_new in batch:
            if num_new != 1 or seq.num_output_tokens + 1 >= seq.max_tokens or self._hands_off(seq):
                return False
            # the next step writes the KV of the token this one samples
            missing += max(0, -(-(seq.num_prompt_tokens + seq.num_output_tokens + 1) // bs) - seq.num_blocks)
        return missing <= self.num_free_blocks

    def _end_step(self, _arg=None) -> None:
        now = self.loop.now
        self.num_steps += 1
        self.busy_seconds += now - self._step_started
        batch, self._batch = self._batch, []
        for seq, num_new in batch:
            if seq.status != RUNNING:
                continue  # aborted during the step
            before = seq.num_computed_tokens
            seq.num_computed_tokens += num_new
            if seq.prefix_key is not None and before < seq.num_prompt_tokens <= seq.num_computed_tokens:
                self._cache_prompt(seq)
            if seq.num_computed_tokens == seq.num_prompt_tokens + seq.num_output_tokens:
                self._sample(seq, now)
        self.busy = False
        if self.running or self.waiting:
            self._start_step()

    def _hands_off(self, seq: SimRequest) -> bool:
        """A prefill worker hands a request's KV to a decode worker, unless the router placed
        the whole request on it (degraded: no decode-capable worker is up); a mixed worker (a
        hybrid cluster's, which also moves KV) hands off the requests the router split with
        it as their prefill worker, and runs the others to the end."""
        if self.role == "prefill":
            return not getattr(seq.decision, "degraded", False)
        return self.role == "mixed" and getattr(seq.decision, "prefill", None) == self.worker_id

    def _sample(self, seq: SimRequest, now: float) -> None:
        seq.num_output_tokens += 1
        if self._hands_off(seq):
            self.running.remove(seq)
            seq.status = HELD
            self.num_held += 1
            if self.on_prefilled is not None:
                self.on_prefilled(self, seq, now)
            return
        if self.on_token is not None:
            self.on_token(self, seq, now)
        if seq.num_output_tokens >= seq.max_tokens:
            self.running.remove(seq)
            self._free(seq)
            seq.status = FINISHED
            if self.on_finished is not None:
                self.on_finished(self, seq, now)

