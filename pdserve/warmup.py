"""Ready means warm: run the shapes serving will use before a worker says it is ready.

`warm_up(engine)` does, in order, and times each part:

1. `graphs`: the CUDA graphs of the decode forward for every padded batch size (each size
   runs once eagerly first, which compiles the Triton kernels of decode steps);
2. `requests`: a few throw-away requests through the real scheduler, so that the first real
   ones find every kernel compiled: a prompt as long as the step's token budget (the tile
   configuration of large prefills), a short one joining while the first decodes (a mixed
   step, small-prefill tiles), decode steps at batch 2 and 1 (the last ones overlapped on a
   GPU), and the sampler's paths (greedy; temperature with top-k/top-p, penalties and
   logprobs).

The requests run as role "mixed" with no layer hook (a prefill worker's hook would push their
KV), then are aborted; the prefix cache forgets their blocks. On the CPU the prompts are short
(no kernels to compile; with `--compile` the decode steps trigger its two compilations).
A worker skips all of it when `EngineConfig.warmup` is False (--no-warmup).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from pdserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

MAX_WARMUP_STEPS = 64  # the requests below finish in about 12 steps; a bound, not a target


@dataclass(frozen=True)
class WarmupReport:
    seconds: dict[str, float] = field(default_factory=dict)  # part -> seconds
    prompt_tokens: tuple[int, ...] = ()
    graph_batch_sizes: tuple[int, ...] = ()
    device: str = ""

    @property
    def total_s(self) -> float:
        return sum(self.seconds.values())

    def describe(self) -> str:
        parts = ", ".join(f"{k} {v:.1f}s" for k, v in self.seconds.items())
        graphs = f"; CUDA graphs for decode batches {list(self.graph_batch_sizes)}" if self.graph_batch_sizes else ""
        prompts = f"; prompts of {' and '.join(map(str, self.prompt_tokens))} tokens" if self.prompt_tokens else ""
        return f"warm-up on {self.device} in {self.total_s:.1f}s ({parts}){prompts}{graphs}"


def _device_name(engine) -> str:
    dev = engine.device
    if dev.type == "cuda":
        import torch

        return torch.cuda.get_device_name(dev)
    return "cpu"


def warm_up(engine) -> WarmupReport:
    """Warms `engine` (pdserve.engine.LLMEngine) up; it must have no requests of its own yet."""
    if engine.requests:
        raise RuntimeError("warm_up runs before the engine takes requests")
    runner = engine.runner
    seconds: dict[str, float] = {}
    t = time.perf_counter()
    if runner.use_cuda_graphs:
        runner.capture_cuda_graphs()
        seconds["graphs"] = time.perf_counter() - t
    on_cuda = engine.device.type == "cuda"
    if engine.max_model_len < 16:  # too short a context for the requests below
        report = WarmupReport(seconds, (), tuple(runner.graph_batch_sizes) if runner.use_cuda_graphs else (),
                              _device_name(engine))
        logger.info("%s", report.describe())
        return report
    budget = engine.scheduler.config.max_num_batched_tokens
    long_len = max(1, min(budget if on_cuda else 16, engine.max_model_len - 8))
    short_len = max(1, min(37 if on_cuda else 8, engine.max_model_len - 8))
    vocab = engine.model_config.vocab_size
    prompts = [[(7919 * seed + 31 * i) % (vocab - 2) + 1 for i in range(n)]
               for seed, n in ((1, long_len), (2, short_len))]
    # the first outlives the second by a few greedy decode steps: the overlapped decode path
    # (device sampling, pinned token buffers, a step launched ahead) runs before serving does
    params = [SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=0.7, top_k=20, top_p=0.9, logprobs=2,
                             frequency_penalty=0.1, ignore_eos=True)]
    role, hook = engine.role, engine.layer_hook
    engine.role, engine.layer_hook = "mixed", None
    ids = []
    t = time.perf_counter()
    try:
        engine.add_request("__warmup-0", prompts[0], params[0])
        ids.append("__warmup-0")
        engine.step()  # the long prompt alone (up to the whole token budget)
        engine.add_request("__warmup-1", prompts[1], params[1])  # joins while the first decodes
        ids.append("__warmup-1")
        for _ in range(MAX_WARMUP_STEPS):
            if not engine.has_unfinished_requests():
                break
            engine.step()
        if on_cuda:
            import torch

            torch.cuda.synchronize(engine.device)
    finally:
        for rid in ids:
            engine.abort_request(rid)
        engine.role, engine.layer_hook = role, hook
        engine.block_manager.reset_prefix_cache()
    seconds["requests"] = time.perf_counter() - t
    report = WarmupReport(seconds, (long_len, short_len),
                          tuple(runner.graph_batch_sizes) if runner.use_cuda_graphs else (), _device_name(engine))
    logger.info("%s", report.describe())
    return report
