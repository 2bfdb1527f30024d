"""`pdserve profile`: measure prefill and decode step times of a model on this hardware.

    pdserve profile --model random:llama-3.1-8b --device cuda --out profile.json

1. Prefill: for each prompt length, the time from `add_request` to the first token on an idle
   engine (chunked as the engine flags say), the median of `repeats` runs after one warm-up.
2. Decode: for each (batch, context), `batch` requests of `context` prompt tokens are
   prefilled, then `decode_steps` pure decode steps run back to back; the median time between
   the returns of consecutive steps (with overlapped decode steps, the period of the overlap).
3. Mixed (`mixed=True`, `pdserve profile --mixed`): for each (batch B, chunk T), B requests of
   `mixed_context` prompt tokens are prefilled until all decode (one decode-only step follows,
   which on a GPU replays a CUDA graph, captured at the first one), then a fresh prompt of
   T x (decode_steps + 1) tokens is added with the step's token budget set to B + T, so that
   each of the next decode_steps + 1 steps carries the B decodes plus a T-token chunk of that
   prompt (its prefix grows by T a step, as when a long prompt is chunked while others decode;
   the last chunk samples its first token). The first of them warms up; the median of the
   others is the point. The engine's own scheduler and runner run every step (a step that is
   not B decodes + T chunk tokens is an error), with the engine's flags otherwise as given, so
   on a GPU with `pdserve up`'s defaults (budget 512, CUDA graphs on) the mixed steps run
   eagerly, as they do while serving, and prefix caching is as the flags say (on by default,
   as on a serving worker: the per-step block hashing is part of the step). Chunks run from 2
   tokens to max_num_batched_tokens; B at most max_num_seqs - 1 (the prompt needs a slot; larger
   B are measured at max_num_seqs - 1, the largest batch a step with a chunk can have).
4. The result is a router.placement.profiles.Profile (the schema lives there), with the hardware named
   and the engine's step version (pdserve/step_version.py) stamped.

Prefix caching is off while measuring prefill and decode, and every prompt is fresh random
tokens, so no run reuses another's KV. Grid points that do not fit the model's context or the
KV cache are left out (logged); the decode and mixed grids stay rectangular.
"""

from __future__ import annotations

import dataclasses
import logging
import platform
import random
import statistics
import time
from collections.abc import Sequence
from datetime import datetime, timezone

import torch
from tqdm import tqdm

from pdserve.config import EngineConfig
from pdserve.engine import LLMEngine
from pdserve import __version__ as PDSERVE_RELEASE
from pdserve.sampling_params import SamplingParams
from pdserve.step_version import engine_step_version
from pdserve.router.placement.profiles import Profile

logger = logging.getLogger(__name__)

DEFAULT_PREFILL_TOKENS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
DEFAULT_DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64)
DEFAULT_DECODE_CONTEXTS = (128, 512, 2048)
DEFAULT_MIXED_BATCHES = (1, 4, 16, 32, 64)
DEFAULT_MIXED_CHUNKS = (64, 128, 256, 512)
DEFAULT_MIXED_CONTEXT = 1024


def hardware_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        pass
    return f"{name} ({torch.get_num_threads()} threads)"


class Profiler:
    def __init__(self, config: EngineConfig, *, repeats: int = 3, decode_steps: int = 8, seed: int = 0,
                 progress: bool = True) -> None:
        if repeats < 1 or decode_steps < 1:
            raise ValueError(f"repeats and decode_steps must be >= 1, got {repeats} and {decode_steps}")
        self.serving_prefix_caching = config.cache.enable_prefix_caching  # for the mixed steps
        config = dataclasses.replace(
            config, cache=dataclasses.replace(config.cache, enable_prefix_caching=False),
            scheduler=dataclasses.replace(config.scheduler, role="mixed"))
        self.engine = LLMEngine(config)
        self.config = self.engine.config  # the scheduler sizes resolved for the device
        self.repeats = repeats
        self.decode_steps = decode_steps
        self.progress = progress
        self._rng = random.Random(seed)
        self._ids = 0
        self.capacity = self.engine.runner.num_blocks * config.cache.block_size

    # ---------------------------------------------------------------- the grid

    def prefill_grid(self, tokens: Sequence[int]) -> list[int]:
        limit = min(self.engine.max_model_len - 1, self.capacity - self.config.cache.block_size)
        kept = sorted({n for n in tokens if 1 <= n <= limit})
        if len(kept) < len(set(tokens)):
            logger.info("prefill: lengths over %d tokens left out (model context / KV cache)", limit)
        if not kept:
            raise ValueError(f"no prefill length fits this engine (at most {limit} tokens)")
        return kept

    def decode_grid(self, batches: Sequence[int], contexts: Sequence[int]) -> tuple[list[int], list[int]]:
        ctxs = sorted({c for c in contexts if c >= 1})
        bats = sorted({b for b in batches if 1 <= b <= self.config.scheduler.max_num_seqs})
        while ctxs:
            fit = [b for b in bats if self._fits(b, ctxs[-1])]  # a smaller context fits where a larger one does
            if fit:
                if len(fit) < len(bats):
                    logger.info("decode: batches over %d left out (model context / KV cache)", fit[-1])
                return fit, ctxs
            logger.info("decode: context %d left out (model context / KV cache)", ctxs.pop())
        raise ValueError("no decode (batch, context) point fits this engine")

    def mixed_grid(self, batches: Sequence[int], chunks: Sequence[int], context: int
                   ) -> tuple[list[int], list[int]]:
        """(batch sizes, chunk tokens) of the mixed table that fit this engine (module docstring)."""
        if context < 1:
            raise ValueError(f"mixed context must be >= 1, got {context}")
        budget = self.config.scheduler.max_num_batched_tokens
        ts = sorted({t for t in chunks if 2 <= t <= budget})
        if len(ts) < len(set(chunks)):
            logger.info("mixed: chunks outside 2..%d tokens (the step's token budget) left out", budget)
        top = self.config.scheduler.max_num_seqs - 1
        if top < 1:
            raise ValueError("mixed steps need max_num_seqs >= 2 (the decodes plus the prompt)")
        bats = sorted({min(b, top) for b in batches if b >= 1})
        if any(b > top for b in batches):
            logger.info("mixed: batches over %d measured at %d (max_num_seqs - 1: the prompt takes a slot)",
                        top, top)
        while ts and bats:
            fit = [b for b in bats if self._mixed_fits(b, ts[-1], context)]  # smaller chunks fit where it does
            if fit:
                if len(fit) < len(bats):
                    logger.info("mixed: batches over %d left out (model context / KV cache)", fit[-1])
                return fit, ts
            logger.info("mixed: chunk %d left out (model context / KV cache)", ts.pop())
        raise ValueError("no mixed (batch, chunk) point fits this engine")

    def _mixed_prompt(self, chunk: int) -> int:
        return chunk * (self.decode_steps + 1)

    def _mixed_max_tokens(self, batch: int, context: int) -> int:
        return self._max_tokens(batch, context) + self.decode_steps + 3

    def _mixed_fits(self, batch: int, chunk: int, context: int) -> bool:
        bs = self.config.cache.block_size
        n = context + self._mixed_max_tokens(batch, context)
        prompt = self._mixed_prompt(chunk)
        blocks = batch * -(-n // bs) + -(-(prompt + 1) // bs)
        return n <= self.engine.max_model_len and prompt < self.engine.max_model_len and blocks * bs <= self.capacity

    def _max_tokens(self, batch: int, context: int) -> int:
        """Enough tokens that no request of the batch finishes before the timed steps: the
        first ones decode while the last ones still prefill."""
        # the requests already decoding take one token each of every step's budget, so the
        # prefill chunks get what is left (at least one token), plus a step per chunk boundary
        budget = self.config.scheduler.max_num_batched_tokens
        prefill_steps = -(-batch * context // max(1, budget - batch)) + batch
        return self.decode_steps + 2 + prefill_steps

    def _fits(self, batch: int, context: int) -> bool:
        bs = self.config.cache.block_size
        n = context + self._max_tokens(batch, context)
        return n <= self.engine.max_model_len and batch * -(-n // bs) * bs <= self.capacity

    # ---------------------------------------------------------------- measuring

    def run(self, prefill_tokens: Sequence[int] = DEFAULT_PREFILL_TOKENS,
            decode_batches: Sequence[int] = DEFAULT_DECODE_BATCHES,
            decode_contexts: Sequence[int] = DEFAULT_DECODE_CONTEXTS, *, mixed: bool = False,
            mixed_batches: Sequence[int] = DEFAULT_MIXED_BATCHES,
            mixed_chunks: Sequence[int] = DEFAULT_MIXED_CHUNKS,
            mixed_context: int = DEFAULT_MIXED_CONTEXT) -> Profile:
        tokens = self.prefill_grid(prefill_tokens)
        batches, contexts = self.decode_grid(decode_batches, decode_contexts)
        m_batches, m_chunks = self.mixed_grid(mixed_batches, mixed_chunks, mixed_context) if mixed else ([], [])
        bar = tqdm(total=len(tokens) + len(batches) * len(contexts) + len(m_batches) * len(m_chunks),
                   desc="profile", disable=not self.progress)
        prefill_times = []
        for n in tokens:
            prefill_times.append(self.prefill_seconds(n))
            bar.update(1)
        decode_times = []
        for b in batches:
            row = []
            for c in contexts:
                row.append(self.decode_step_seconds(b, c))
                bar.update(1)
            decode_times.append(tuple(row))
        mixed_times = []
        for b in m_batches:
            row = []
            for t in m_chunks:
                row.append(self.mixed_step_seconds(b, t, mixed_context))
                bar.update(1)
            mixed_times.append(tuple(row))
        bar.close()
        e = self.engine
        return Profile(
            hardware=hardware_name(e.device), device=e.device.type, model=self.config.model,
            dtype=str(e.dtype).removeprefix("torch."), num_layers=e.model_config.num_layers,
            kv_bytes_per_token=round(e.runner.kv_bytes_per_token),  # the pools' dtype (FP8: with scales)
            block_size=self.config.cache.block_size,
            max_num_batched_tokens=self.config.scheduler.max_num_batched_tokens,
            prefill_tokens=tuple(tokens), prefill_times=tuple(prefill_times),
            decode_batch_sizes=tuple(batches), decode_contexts=tuple(contexts), decode_times=tuple(decode_times),
            created=datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            engine_step_version=engine_step_version(e.device.type), engine_release=PDSERVE_RELEASE,
            **({} if not mixed else dict(mixed_context=mixed_context, mixed_batch_sizes=tuple(m_batches),
                                         mixed_chunk_tokens=tuple(m_chunks), mixed_times=tuple(mixed_times))),
        )

    def prefill_seconds(self, num_tokens: int) -> float:
        times = []
        for i in range(self.repeats + 1):  # the first run warms up (kernel compilation, caches)
            rid = self._add(num_tokens, max_tokens=1)
            self._sync()
            t0 = time.perf_counter()
            while not any(o.request_id == rid and o.finished for o in self.engine.step()):
                pass
            self._sync()
            if i:
                times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def decode_step_seconds(self, batch: int, context: int) -> float:
        e = self.engine
        rids = [self._add(context, max_tokens=self._max_tokens(batch, context)) for _ in range(batch)]
        try:
            while any(e.requests[r].num_output_tokens == 0 for r in rids if r in e.requests):
                e.step()
            if not all(r in e.requests for r in rids):
                raise RuntimeError(f"decode batch {batch} x {context} tokens: a request finished before the "
                                   "batch was formed (raise --max-num-batched-tokens or lower the batch)")
            e.step()  # warm-up: the first step of the pure decode batch
            # the time between the returns of consecutive steps, with no sync between them: where
            # the engine overlaps decode steps (a CUDA-graph step launched before the previous
            # one's tokens are read), that is the period a serving worker steps at, where a sync
            # around each step would add the host work the overlap hides
            times = []
            self._sync()
            last = time.perf_counter()
            for _ in range(self.decode_steps):
                e.step()
                now = time.perf_counter()
                times.append(now - last)
                last = now
            self._sync()
        finally:
            for r in rids:
                e.abort_request(r)
        return statistics.median(times)

    def mixed_step_seconds(self, batch: int, chunk: int, context: int) -> float:
        """The median step of `batch` decodes at `context` plus a `chunk`-token prefill chunk
        (module docstring, item 3)."""
        e = self.engine
        sched, runner = e.scheduler, e.runner
        bm = sched.block_manager
        bm.enable_prefix_caching = self.serving_prefix_caching  # as on a serving worker (module docstring)
        rids = [self._add(context, max_tokens=self._mixed_max_tokens(batch, context)) for _ in range(batch)]
        fresh = None
        config = sched.config
        try:
            while any(e.requests[r].num_output_tokens == 0 for r in rids if r in e.requests):
                e.step()
            if not all(r in e.requests for r in rids):
                raise RuntimeError(f"mixed batch {batch} x {context} tokens: a request finished before the "
                                   "batch was formed")
            decoders = [e.requests[r] for r in rids]
            # a decode-only step, as between arrivals while serving (CUDA graphs: captured at the
            # first), launching nothing ahead: with overlapped steps (engine.overlap_steps) a step
            # launched with nothing waiting would carry the decodes on, and the first mixed step
            # would only collect it
            overlap, e.overlap_steps = e.overlap_steps, False
            try:
                e.step()
            finally:
                e.overlap_steps = overlap
            sched.config = dataclasses.replace(config, max_num_batched_tokens=batch + chunk)
            fresh = self._add(self._mixed_prompt(chunk), max_tokens=1)
            prompt = e.requests[fresh]
            times = []
            for i in range(self.decode_steps + 1):  # the first one warms up
                computed, outputs = prompt.num_computed_tokens, [s.num_output_tokens for s in decoders]
                graph_steps = runner.num_decode_only_steps
                self._sync()
                t0 = time.perf_counter()
                e.step()
                self._sync()
                seconds = time.perf_counter() - t0
                if (prompt.num_computed_tokens - computed != chunk or runner.num_decode_only_steps != graph_steps
                        or [s.num_output_tokens for s in decoders] != [n + 1 for n in outputs]):
                    raise RuntimeError(f"mixed batch {batch} + chunk {chunk}: step {i} was not {batch} decodes "
                                       f"plus a {chunk}-token chunk (the prompt advanced "
                                       f"{prompt.num_computed_tokens - computed} tokens)")
                if i:
                    times.append(seconds)
        finally:
            sched.config = config
            for r in rids + ([fresh] if fresh else []):
                e.abort_request(r)
            bm.reset_prefix_cache()
            bm.enable_prefix_caching = False
        return statistics.median(times)

    def _add(self, num_tokens: int, max_tokens: int) -> str:
        self._ids += 1
        rid = f"profile-{self._ids}"
        vocab = self.engine.model_config.vocab_size
        prompt = [self._rng.randrange(vocab) for _ in range(num_tokens)]
        self.engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        return rid

    def _sync(self) -> None:
        if self.engine.device.type == "cuda":
            torch.cuda.synchronize(self.engine.device)


def profile_engine(config: EngineConfig, *, prefill_tokens: Sequence[int] = DEFAULT_PREFILL_TOKENS,
                   decode_batches: Sequence[int] = DEFAULT_DECODE_BATCHES,
                   decode_contexts: Sequence[int] = DEFAULT_DECODE_CONTEXTS, repeats: int = 3,
                   decode_steps: int = 8, progress: bool = True, mixed: bool = False,
                   mixed_batches: Sequence[int] = DEFAULT_MIXED_BATCHES,
                   mixed_chunks: Sequence[int] = DEFAULT_MIXED_CHUNKS,
                   mixed_context: int = DEFAULT_MIXED_CONTEXT) -> Profile:
    """Measures `config`'s engine on this machine (module docstring)."""
    profiler = Profiler(config, repeats=repeats, decode_steps=decode_steps, seed=config.seed, progress=progress)
    return profiler.run(prefill_tokens, decode_batches, decode_contexts, mixed=mixed, mixed_batches=mixed_batches,
                        mixed_chunks=mixed_chunks, mixed_context=mixed_context)
