"""The engine: one step is schedule, run, postprocess.

    engine = LLMEngine(EngineConfig(model="smollm2"))
    engine.add_request("r1", token_ids, SamplingParams(max_tokens=32))
    while engine.has_unfinished_requests():
        for out in engine.step(): ...

Roles (for prefill/decode disaggregation):
1. prefill: a request stops after its first token; its KV stays in its blocks (`held_blocks`)
   until `release`. `layer_hook` sees each layer as soon as its KV is written. A request
   added with `hand_off=False` runs to the end instead (a prefill worker standing in for a
   decode worker that is down).
2. decode: `reserve` gives blocks for a prompt's KV that arrives from elsewhere, `commit`
   joins the request to the decode batch with its first token; `abort` frees either way.

Overlapped decode steps: a decode-only step that replays a CUDA graph, with tokens the sampler
draws on the device (greedy or unseeded sampling, no penalties, no logprobs), leaves its tokens
on the device and starts copying them out. Before waiting for them, `step` schedules the next
step as if they were known (a placeholder token per request: same requests, one position on)
and launches it with the tokens read on the device; then it hands the first step's tokens to
their requests (detokenizing, stop checks) while the GPU runs the second. The next `step` call
starts from that step. A request that ends with a token (EOS, a stop string) or is aborted while
the next step is in flight had one extra position computed, whose token is dropped. Anything
else (a request waiting for admission, one ending by length, a block shortage, a prefill) runs
the usual synchronous step. `EngineConfig.overlap_steps=False` (--no-overlap-steps) turns it off.

Structured outputs (`pdserve.structured`): a request whose params carry a grammar gets a matcher,
advanced over every token appended to it (wherever it was sampled: a decode worker's first
token comes from the prefill worker, a migrated request resumes with `num_generated` tokens at
the end of its prompt). A synchronous step fills the constrained rows' bitmasks once the forward
is launched (on a GPU, while it runs; on the CPU, after it, whose threads the forward uses);
such rows never take the overlapped path. A request ends when its matcher terminates.

The scheduler's sizes not given in the config are the device's defaults
(`pdserve.config.resolve_scheduler`), chosen here where the device is known and logged once.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch

from pdserve.block_manager import BlockManager
from pdserve.config import EngineConfig, ModelConfig, resolve_scheduler
from pdserve.engine_args import kernel_config
from pdserve.kernels import dispatch as kernel_dispatch
from pdserve.loaders import ModelSource, load_model_source
from pdserve.model_runner import ModelRunner, resolve_device, resolve_dtype
from pdserve.parallel.errors import TPRankError
from pdserve.sampler import Sampler, SamplingRow
from pdserve.sampling_params import RequestOutput, SamplingParams
from pdserve.scheduler import ScheduledBatch, Scheduler
from pdserve.sequence import Sequence, SequenceStatus
from pdserve.structured.backend import GrammarBackend
from pdserve.tokenizer import IncrementalDetokenizer, Tokenizer

logger = logging.getLogger(__name__)


PLACEHOLDER_TOKEN = -1  # a sampled token still on the device (only inside one `step` call)


@dataclass
class _InFlight:
    """A launched step whose tokens are not on the host yet."""

    seqs: list[Sequence]  # row i sampled seqs[i]
    tokens: torch.Tensor  # on the device
    handle: tuple  # ModelRunner.sample_async's copy to the host
    placed: bool = False  # the step after it was launched: each seq holds a placeholder token


class NoKVSpaceError(RuntimeError):
    """No free KV blocks for a reservation right now (the caller may retry elsewhere)."""


class LLMEngine:
    def __init__(self, config: EngineConfig, source: ModelSource | None = None) -> None:
        # the kernels' settings are the process's: set here, before the first kernel (none given:
        # the process's environment, as the CLI reads it)
        kernels = config.kernels if config.kernels is not None else kernel_config()
        kernel_dispatch.configure(kernels.backend, kernels.prefill_attention)
        self.device = resolve_device(config.device)
        scheduler_config, chosen = resolve_scheduler(config.scheduler, self.device.type)
        logger.info("engine: %s", chosen)
        config = dataclasses.replace(config, scheduler=scheduler_config, kernels=kernels)
        self.config = config
        source = source if source is not None else load_model_source(config.model, config.tokenizer)
        self.model_config: ModelConfig = source.config
        self.tokenizer: Tokenizer | None = source.tokenizer
        self.dtype = resolve_dtype(config.dtype, self.device)
        if config.seed is not None:
            torch.manual_seed(config.seed)
        self.tp_group = None  # pdserve.parallel.local.LocalTPGroup: ranks 1..N-1 (TP > 1)
        # every rank's KV pools, rank 0's first (TP > 1 in the prefill and decode roles: the KV plane's)
        self.rank_kv_caches: list | None = None
        if config.tensor_parallel_size == 1:
            self.runner = ModelRunner(self.model_config, source.iter_weights(self.device), config.cache,
                                      self.device, self.dtype, config.seed)
        else:
            self.runner = self._start_tensor_parallel(source)
        self.block_manager = BlockManager(self.runner.num_blocks, config.cache.block_size,
                                          config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.block_manager)
        self.role = config.scheduler.role
        # no step is larger than the token budget: no prefill graph beyond it is captured
        self.runner.prefill_graph_max_tokens = min(self.runner.prefill_graph_max_tokens,
                                                   config.scheduler.max_num_batched_tokens)
        capacity = self.runner.num_blocks * config.cache.block_size
        max_len = config.max_model_len or self.model_config.max_position_embeddings
        if max_len > self.model_config.max_position_embeddings:
            raise ValueError(f"max_model_len {max_len} exceeds the model's "
                             f"max_position_embeddings {self.model_config.max_position_embeddings}")
        if max_len > capacity:
            logger.warning("max_model_len %d capped to the KV cache capacity of %d tokens", max_len, capacity)
            max_len = capacity
        self.max_model_len = max_len
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids
                                       or (self.tokenizer.eos_token_ids if self.tokenizer else ()))
        self._limit_vocab()
        self.requests: dict[str, Sequence] = {}
        self.layer_hook: Callable[[int, ScheduledBatch], None] | None = None
        self.num_steps = 0
        # TP > 1: every step is published to the other ranks with host-side inputs, so no step
        # is launched with tokens still on the device
        self.overlap_steps = config.overlap_steps and config.tensor_parallel_size == 1
        self.num_steps_ahead = 0  # steps launched before the previous step's tokens reached the host
        self._in_flight: _InFlight | None = None  # a step launched ahead, its tokens not read yet
        self._grammars: GrammarBackend | None = None  # built on the first constrained request

    @property
    def grammars(self) -> GrammarBackend:
        """The grammar engine for this model's tokenizer (built on first use)."""
        if self._grammars is None:
            if self.tokenizer is None:
                raise ValueError("structured outputs need a tokenizer; this model has none")
            t = time.perf_counter()
            self._grammars = GrammarBackend(self.tokenizer.hf_tokenizer, self.model_config.vocab_size,
                                            sorted(self.eos_token_ids))
            logger.info("engine: grammar engine ready for %d tokens in %.2fs", self.model_config.vocab_size,
                        time.perf_counter() - t)
        return self._grammars

    def _limit_vocab(self) -> None:
        """Samples only ids the tokenizer can decode when it knows fewer than the model's
        vocabulary (pdserve.sampler, `vocab_limit`): every token then reaches the client as text
        at once, as the bare engine's first token is counted."""
        vocab = self.model_config.vocab_size
        if self.tokenizer is None or self.tokenizer.vocab_size >= vocab:
            return
        limit = max([self.tokenizer.vocab_size] + [t + 1 for t in self.eos_token_ids if t < vocab])
        self.runner.sampler.vocab_limit = limit
        logger.info("engine: sampling ids below %d (the tokenizer's) of the model's %d", limit, vocab)

    def _start_tensor_parallel(self, source: ModelSource) -> ModelRunner:
        """Checks the split, starts ranks 1..N-1 and loads rank 0's shard (pdserve.parallel)."""
        from pdserve.parallel.layout import TP_FLAG, check_tensor_parallel
        from pdserve.parallel.local import LocalTPGroup, load_rank_runner, rank_device

        config, size = self.config, self.config.tensor_parallel_size
        num_gpus = torch.cuda.device_count() if self.device.type == "cuda" else None
        check_tensor_parallel(self.model_config, size, expert_parallel=config.expert_parallel,
                              device_type=self.device.type, num_gpus=num_gpus)
        if config.cache.compile_cpu_decode:
            raise ValueError(f"--compile (the CPU torch.compile decode) does not support {TP_FLAG} > 1")
        share_kv = config.scheduler.role != "mixed"  # its KV moves: rank 0's KV plane needs every rank's pools
        self.tp_group = LocalTPGroup.start(config, share_kv=share_kv)
        try:
            self.device = rank_device(config, 0)
            runner = load_rank_runner(config, source, self.device, self.tp_group.comm, self.tp_group.channel)
            if share_kv:
                peers = self.tp_group.peer_kv_caches()
                self.rank_kv_caches = [runner.kv_caches] + [peers[r] for r in sorted(peers)]
            return runner
        except RuntimeError as exc:
            self.tp_group.close()
            if isinstance(exc, TPRankError):
                raise
            raise self.tp_group.failure(exc) from exc
        except BaseException:
            self.tp_group.close()
            raise

    def shutdown(self) -> None:
        """Stops the other tensor-parallel ranks (nothing to do at TP=1). Idempotent."""
        if self.tp_group is not None:
            self.tp_group.close()

    # ---- requests --------------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt is empty")
        n = len(prompt_token_ids)
        if n > self.max_model_len:
            raise ValueError(f"prompt has {n} tokens, over the maximum context length of "
                             f"{self.max_model_len} tokens")
        if n + params.max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({n} tokens) plus max_tokens ({params.max_tokens}) exceeds the "
                             f"maximum context length of {self.max_model_len} tokens")
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad!r} is out of range [0, {vocab})")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model has none")
        bad = next((t for t, _ in params.logit_bias if t >= vocab), None)
        if bad is not None:
            raise ValueError(f"logit_bias token id {bad} is out of range [0, {vocab})")
        bad = next((t for word in params.bad_words_ids for t in word if t >= vocab), None)
        if bad is not None:
            raise ValueError(f"bad_words token id {bad} is out of range [0, {vocab})")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                    hand_off: bool | None = None, num_generated: int = 0) -> None:
        """`hand_off`: stop after the first token and hold the KV (default: in the prefill role).
        `num_generated`: the prompt ends with this many tokens the request generated elsewhere
        (a migration), which its grammar has already seen."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not 0 <= num_generated <= len(prompt_token_ids):
            raise ValueError(f"num_generated must be in [0, {len(prompt_token_ids)}], got {num_generated}")
        generated = prompt_token_ids[len(prompt_token_ids) - num_generated:] if num_generated else []
        seq = self._new_sequence(request_id, prompt_token_ids, params, generated)
        seq.hand_off = self.role == "prefill" if hand_off is None else hand_off
        self.requests[request_id] = seq
        self.scheduler.add(seq)

    def _new_sequence(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                      generated: list[int] | tuple[int, ...] = ()) -> Sequence:
        self.validate(prompt_token_ids, params)
        seq = Sequence(request_id, list(prompt_token_ids), params)
        if params.structured is not None:
            seq.grammar = self.grammars.matcher(params.structured, generated)
        if params.seed is not None and not params.greedy:
            seq.generator = self.runner.sampler.make_generator(params.seed)
        if self.tokenizer is not None:
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids)
        return seq

    def abort_request(self, request_id: str) -> bool:
        """Frees whatever the request holds; True if it existed."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return False
        seq.finish_reason = seq.finish_reason or "abort"
        self.scheduler.finish(seq, "abort")
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work() or self._in_flight is not None

    # ---- disaggregation seams --------------------------------------------------------------
    def held_blocks(self, request_id: str) -> list[int]:
        """Prefill role: the blocks holding a finished prefill's KV."""
        return list(self.scheduler.held[request_id].block_ids)

    def release(self, request_id: str) -> None:
        """Prefill role: the KV has been handed off (or is no longer wanted). A request whose
        prefill has not finished yet (its caller went away) is aborted: left running, it would
        reach `held` after this call and keep its blocks forever."""
        seq = self.scheduler.held.get(request_id)
        if seq is None:
            self.abort_request(request_id)
            return
        self.scheduler.finish(seq, seq.finish_reason or "stop")
        self.requests.pop(request_id, None)

    def reserve(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                on_granted: Callable[[list[int]], None] | None = None) -> list[int] | None:
        """Decode role: block ids where the prompt's KV, computed elsewhere, must land.

        Without `on_granted`, a reservation that does not fit now raises NoKVSpaceError. With
        it, the reservation waits in line for blocks (first come, first served) and
        `on_granted(block_ids)` runs on the engine's thread once they are reserved: at once
        (and this returns the block ids) or at the start of a later step (this returns None).
        `abort_request` takes a waiting reservation out of the line. A prompt that cannot fit
        in the whole cache fails validation (ValueError) either way."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        seq = self._new_sequence(request_id, prompt_token_ids, params)
        if on_granted is None:
            if not self.block_manager.can_append(seq.table, seq.num_prompt_tokens):
                raise NoKVSpaceError(f"not enough free KV blocks to reserve {seq.num_prompt_tokens} tokens")
            self.requests[request_id] = seq
            return self.scheduler.reserve(seq, seq.num_prompt_tokens)
        self.requests[request_id] = seq
        seq.on_granted = on_granted
        if self.scheduler.can_reserve(seq, seq.num_prompt_tokens):
            blocks = self.scheduler.reserve(seq, seq.num_prompt_tokens)
            self._granted(seq)
            return blocks
        self.scheduler.queue_reservation(seq)
        return None

    def grant_reservations(self) -> None:
        """Reserves blocks for waiting reservations that fit now, in arrival order."""
        if self.scheduler.pending_reservations:
            for seq in self.scheduler.grant_reservations():
                self._granted(seq)

    def _granted(self, seq: Sequence) -> None:
        callback, seq.on_granted = seq.on_granted, None
        if callback is None:
            return
        try:
            callback(list(seq.block_ids))
        except Exception:
            logger.exception("reservation callback of %s failed; the reservation is dropped", seq.request_id)
            self.abort_request(seq.request_id)

    def commit(self, request_id: str, first_token_id: int) -> RequestOutput | None:
        """Decode role: the KV landed; continue from the token the prefill worker sampled.

        The first token was already returned by the prefill worker, so its text counts as
        emitted here. Returns an output only when that token also finishes the request.
        """
        seq = self.scheduler.commit(request_id)
        out = self._append_token(seq, first_token_id, None)
        seq.num_emitted_chars = len(seq.output_text)
        return out if out is not None and out.finished else None

    # ---- the step --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Runs one step and returns its outputs. Decode-only CUDA-graph steps overlap the host
        with the GPU: while a step runs, the next one is scheduled and launched with the tokens
        still on the device (module docstring: "Overlapped decode steps"). Under tensor
        parallelism a rank that died raises `TPRankError` (here and at every later step)."""
        if self.tp_group is None:
            return self._step()
        self.tp_group.check_alive()
        try:
            return self._step()
        except TPRankError:
            raise
        except RuntimeError as exc:  # a collective whose peer is gone
            raise self.tp_group.failure(exc) from exc

    def _step(self) -> list[RequestOutput]:
        current, self._in_flight = self._in_flight, None
        self.grant_reservations()
        if current is None:
            batch = self.scheduler.schedule()
            if not batch.seqs:
                return []
            if not self._overlappable(batch):
                return self._step_sync(batch)
            current = self._launch(batch)
        if self._can_launch_ahead(current):
            self._in_flight = self._launch_ahead(current)
        return self._consume(current)

    def _overlappable(self, batch: ScheduledBatch) -> bool:
        """A decode-only graph step whose tokens the sampler draws on the device."""
        return (self.overlap_steps and self.runner.uses_graph(len(batch)) and self.runner.is_decode_only(batch)
                and self._overlappable_seqs(batch.seqs))

    def _launch(self, batch: ScheduledBatch, input_tokens: torch.Tensor | None = None) -> _InFlight:
        logits = self.runner.execute(batch, None, input_tokens)
        seqs = list(batch.seqs)  # decode-only: row i samples seqs[i]
        rows = [SamplingRow(s.params, s.output_token_ids, s.generator, self._suppressed(s)) for s in seqs]
        self.scheduler.postprocess(batch, hash_blocks=input_tokens is None)
        tokens, handle = self.runner.sample_async(logits, rows)
        self.num_steps += 1
        return _InFlight(seqs, tokens, handle)

    def _can_launch_ahead(self, current: _InFlight) -> bool:
        """Whether the next step is `current`'s requests again, each one token on, whatever
        tokens `current` samples: nothing waiting to be admitted, no request ending by length
        with this token, blocks for every next slot without preempting, device-drawn tokens."""
        sched, bm = self.scheduler, self.block_manager
        seqs = current.seqs
        if not self.overlap_steps or sched.waiting or len(sched.running) != len(seqs):
            return False
        missing = 0
        for running, seq in zip(sched.running, seqs):
            if running is not seq or seq.status is not SequenceStatus.RUNNING:
                return False
            if seq.num_output_tokens + 1 >= seq.params.max_tokens or seq.num_tokens + 1 >= self.max_model_len:
                return False
            # the next step writes the KV of position num_tokens (this step's token)
            missing += max(0, bm.blocks_needed(seq.num_tokens + 1) - len(seq.block_ids))
        return missing <= bm.num_free_blocks  # the rows drew on the device at launch and still do

    @staticmethod
    def _overlappable_seqs(seqs: list[Sequence]) -> bool:
        """No hand-off (its layer hook), and tokens the sampler draws on the device."""
        return all(not s.hand_off and Sampler.draws_on_device(s.params, s.generator) for s in seqs)

    def _launch_ahead(self, current: _InFlight) -> _InFlight:
        """Schedules and launches the step after `current` before its tokens reach the host:
        each request gets a placeholder token (replaced in `_consume`), the step reads the real
        ones on the device."""
        for seq in current.seqs:
            seq.output_token_ids.append(PLACEHOLDER_TOKEN)
        current.placed = True
        self.num_steps_ahead += 1
        batch = self.scheduler.schedule()
        if [id(s) for s in batch.seqs] != [id(s) for s in current.seqs] or batch.preempted \
                or any(n != 1 for n in batch.num_new_tokens):  # _can_launch_ahead rules this out
            raise AssertionError("a step launched ahead must decode the same requests")
        return self._launch(batch, current.tokens)

    def _consume(self, current: _InFlight) -> list[RequestOutput]:
        """Waits for `current`'s tokens and hands them to their requests."""
        tokens = self.runner.tokens_of(current.handle)
        outputs = []
        for seq, token in zip(current.seqs, tokens):
            if current.placed:
                seq.output_token_ids.pop()  # the placeholder: the real token goes in its place
            if seq.status is SequenceStatus.FINISHED:  # aborted while its step ran
                continue
            out = self._append_token(seq, token, None)
            if current.placed and seq.status is not SequenceStatus.FINISHED:
                self.scheduler.hash_full_blocks(seq)  # deferred at the launch ahead
            if out is not None:
                outputs.append(out)
        return outputs

    def _step_sync(self, batch: ScheduledBatch) -> list[RequestOutput]:
        hook = None
        # only a batch with a request to hand off needs the layer hook (a mixed worker's decode
        # steps keep the hook-free paths, CUDA graphs included)
        if self.layer_hook is not None and any(s.hand_off for s in batch.seqs):
            user_hook = self.layer_hook
            hook = lambda layer: user_hook(layer, batch)  # noqa: E731
        logits = self.runner.execute(batch, hook)  # on a GPU this returns before the forward ends
        # CPU work that needs no sampled token runs while the GPU computes (the grammars'
        # bitmasks too): the first sync is the sampler's read of the tokens.
        order = self.runner.order(batch)
        sampling = [batch.seqs[i] for i in order if batch.samples(i)]
        rows = [SamplingRow(s.params, s.output_token_ids, s.generator,  # type: ignore[arg-type]
                            self._suppressed(s)) for s in sampling]
        constrained = [j for j, s in enumerate(sampling) if s.grammar is not None]
        if constrained:
            bitmask = self.grammars.fill([sampling[j].grammar for j in constrained],
                                         [rows[j].suppress_token_ids for j in constrained])
            self._set_masks(rows, constrained, bitmask)
        self.scheduler.postprocess(batch)
        tokens, logprobs = self.runner.sample(logits, rows) if rows else ([], [])
        self.num_steps += 1
        outputs = []
        for seq, token, lp in zip(sampling, tokens, logprobs):
            out = self._append_token(seq, token, lp)
            if out is not None:
                outputs.append(out)
        return outputs

    @staticmethod
    def _set_masks(rows: list[SamplingRow], constrained: list[int], bitmask: torch.Tensor) -> None:
        """Constrained rows sample under their bitmask, in which their suppressed ids are folded
        (GrammarBackend.fill: the grammar wins where they would leave no token)."""
        for k, j in enumerate(constrained):
            rows[j].token_bitmask = bitmask[k]
            rows[j].suppress_token_ids = ()

    def _suppressed(self, seq: Sequence) -> tuple[int, ...]:
        p = seq.params
        ids: tuple[int, ...] = tuple(p.banned_token_ids(seq.output_token_ids)) if p.bad_words_ids else ()
        if seq.num_output_tokens < p.min_tokens:
            ids += tuple(self.eos_token_ids) + p.stop_token_ids
        return ids

    def _append_token(self, seq: Sequence, token: int, logprob) -> RequestOutput | None:
        p = seq.params
        seq.output_token_ids.append(token)
        if logprob is not None:
            seq.pending_logprobs.append(logprob)
        finish: str | None = None
        is_stop_token = (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids
        if is_stop_token and seq.num_output_tokens > p.min_tokens - 1:
            finish = "stop"
        if seq.grammar is not None:
            if not seq.grammar.accept_token(token):  # type: ignore[attr-defined]
                # never a sampled token (the mask allowed it): one handed over from elsewhere
                logger.error("request %s: token %d breaks its %s; aborted", seq.request_id, token, p.structured.kind)
                finish = "abort"
            elif seq.grammar.is_terminated():  # type: ignore[attr-defined]
                finish = "stop"  # the grammar's stop token, even under ignore_eos or min_tokens
                is_stop_token = True
        if seq.detokenizer is not None and not is_stop_token:
            seq.output_text += seq.detokenizer.add(token)  # type: ignore[attr-defined]
        if p.stop and finish is None:
            cut = _find_stop(seq.output_text, p.stop, seq.num_emitted_chars)
            if cut is not None:
                seq.output_text = seq.output_text[:cut]
                finish = "stop"
        if finish is None and (seq.num_output_tokens >= p.max_tokens
                               or seq.num_tokens >= self.max_model_len):
            finish = "length"

        if finish is not None:
            seq.finish_reason = finish
            if seq.hand_off:
                self.scheduler.hold(seq)
            else:
                self.scheduler.finish(seq, finish)
                self.requests.pop(seq.request_id, None)
        elif seq.hand_off:
            seq.finish_reason = "prefilled"
            self.scheduler.hold(seq)
            finish = "prefilled"

        # Text that might still become a stop string is held back until it can't.
        end = len(seq.output_text)
        if finish is None and p.stop:
            end = max(seq.num_emitted_chars, end - (max(len(s) for s in p.stop) - 1))
        new_text = seq.output_text[seq.num_emitted_chars:end]
        seq.num_emitted_chars = end
        new_tokens = seq.output_token_ids[seq.num_emitted_tokens:]
        first_token_times = None
        if seq.num_emitted_tokens == 0 and new_tokens and seq.first_scheduled_time is not None:
            first_token_times = (seq.first_scheduled_time, time.monotonic())
        seq.num_emitted_tokens = seq.num_output_tokens
        lps = None
        if p.logprobs is not None:
            lps, seq.pending_logprobs = seq.pending_logprobs, []
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=new_tokens,
            new_text=new_text,
            finished=finish is not None,
            finish_reason=finish,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            logprobs=lps,
            first_token_times=first_token_times,
        )

    # ---- stats -----------------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        bm = self.block_manager
        return {
            "num_waiting": len(self.scheduler.waiting) + len(self.scheduler.pending_reservations),
            "num_running": len(self.scheduler.running),
            "num_held": len(self.scheduler.held),
            "num_awaiting_kv": len(self.scheduler.awaiting_kv),
            "num_blocks": bm.num_blocks,
            "num_free_blocks": bm.num_free_blocks,
            "kv_usage": 1.0 - bm.num_free_blocks / bm.num_blocks,
            "prefix_cache_hits": bm.num_prefix_hits,
            "prefix_cache_queries": bm.num_prefix_queries,
            "num_preemptions": self.scheduler.num_preemptions,
            "time": time.time(),
        }


def _find_stop(text: str, stops: tuple[str, ...], emitted: int) -> int | None:
    """Index where the earliest stop string starts, searching only text not yet emitted."""
    start = max(0, emitted - max(len(s) for s in stops) + 1)
    best = None
    for s in stops:
        i = text.find(s, start)
        if i != -1 and (best is None or i < best):
            best = i
    return best
