"""Ready means warm: run the shapes serving will use before a worker says it is ready.

`warm_up(engine)` does, in order, and times each part:

1. `graphs`: the CUDA graphs of the decode forward for every padded batch size (each size
   runs once eagerly first, which compiles the Triton kernels of decode steps); with
   `--prefill-graphs`, `prefill graphs`: the piecewise graphs of steps with prefill rows
   (pdserve/piecewise_graphs.py);
2. `requests`: a few throw-away requests through the real scheduler, so that the first real
   ones find every kernel compiled: a prompt as long as the step's token budget (the tile
   configuration of large prefills), a short one joining while the first decodes (a mixed
   step, small-prefill tiles), decode steps at batch 2 and 1 (the last ones overlapped on a
   GPU), and the sampler's paths (greedy; temperature with top-k/top-p, penalties and
   logprobs);
3. `buckets`: serving's shapes the two requests above miss: a few requests decoding together
   (up to MAX_WARMUP_DECODES, a wider decode batch), joined one after another by prompts of
   PREFILL_BUCKETS tokens below the token budget (mixed steps with longer prefills and more
   sequences). A bucket that does not fit the KV cache is skipped; the report's prompt lengths
   list those that ran. On the CPU they run only with torch.compile'd decode steps (below
   CPU_BUCKET_CAP): otherwise they compile nothing there and only lengthen the start.

Where fresh prompts take the dense attention kernel (on CUDA), the paged prefill kernel's tile
configurations are compiled directly first (part 2's time): the requests' prompts are all fresh.

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
PREFILL_BUCKETS = (64, 256, 1024, 4096)  # prompt lengths below the token budget (part 3)
CPU_BUCKET_CAP = 512  # on the CPU, buckets below this only
MAX_WARMUP_DECODES = 8  # requests decoding together while the buckets prefill
LONG_DECODE_TOKENS = 10  # the long warm-up request decodes this many tokens after its prompt
SHORT_DECODE_TOKENS = 6


@dataclass(frozen=True)
class WarmupReport:
    seconds: dict[str, float] = field(default_factory=dict)  # part -> seconds
    prompt_tokens: tuple[int, ...] = ()
    graph_batch_sizes: tuple[int, ...] = ()
    device: str = ""
    prefill_graph_tokens: int = 0  # steps with prefill rows up to this many tokens replay graphs

    @property
    def total_s(self) -> float:
        return sum(self.seconds.values())

    def describe(self) -> str:
        parts = ", ".join(f"{k} {v:.1f}s" for k, v in self.seconds.items())
        graphs = f"; CUDA graphs for decode batches {list(self.graph_batch_sizes)}" if self.graph_batch_sizes else ""
        prompts = f"; prompts of {' and '.join(map(str, self.prompt_tokens))} tokens" if self.prompt_tokens else ""
        if self.prefill_graph_tokens:
            graphs += f"; prefill graphs up to {self.prefill_graph_tokens} tokens"
        return f"warm-up on {self.device} in {self.total_s:.1f}s ({parts}){prompts}{graphs}"


def _device_name(engine) -> str:
    dev = engine.device
    if dev.type == "cuda":
        import torch

        return torch.cuda.get_device_name(dev)
    return "cpu"


def warmup_lengths(budget: int, max_model_len: int, on_cuda: bool) -> tuple[int, int]:
    """The long and the short warm-up prompt's lengths: the long one up to the whole token budget
    on CUDA (16 tokens on the CPU), each short enough that its prompt and its decoded tokens fit
    in the context (a budget of 8192 with --max-model-len 4096 once asked for 4088 + 10)."""
    long_len = max(1, min(budget if on_cuda else 16, max_model_len - LONG_DECODE_TOKENS))
    short_len = max(1, min(37 if on_cuda else 8, max_model_len - SHORT_DECODE_TOKENS))
    return long_len, short_len


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
    if runner.prefill_graph_max_tokens:
        seconds["prefill graphs"] = runner.capture_prefill_graphs()
    on_cuda = engine.device.type == "cuda"
    if engine.max_model_len < 16:  # too short a context for the requests below
        report = WarmupReport(seconds, (), tuple(runner.graph_batch_sizes) if runner.use_cuda_graphs else (),
                              _device_name(engine), runner.prefill_graph_max_tokens)
        logger.info("%s", report.describe())
        return report
    long_len, short_len = warmup_lengths(engine.scheduler.config.max_num_batched_tokens, engine.max_model_len,
                                         on_cuda)
    vocab = engine.model_config.vocab_size
    prompts = [[(7919 * seed + 31 * i) % (vocab - 2) + 1 for i in range(n)]
               for seed, n in ((1, long_len), (2, short_len))]
    # the first outlives the second by a few greedy decode steps: the overlapped decode path
    # (device sampling, pinned token buffers, a step launched ahead) runs before serving does
    params = [SamplingParams(max_tokens=LONG_DECODE_TOKENS, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=SHORT_DECODE_TOKENS, temperature=0.7, top_k=20, top_p=0.9, logprobs=2,
                             frequency_penalty=0.1, ignore_eos=True)]
    role, hook = engine.role, engine.layer_hook
    engine.role, engine.layer_hook = "mixed", None
    ids = []
    t = time.perf_counter()
    if on_cuda:
        _warm_paged_prefill(engine)
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
        seconds["requests"] = time.perf_counter() - t
        t = time.perf_counter()
        # on the CPU the buckets compile nothing (first prompts no faster after them: docs/results.md, "Figures
        # behind the code's choices") unless torch.compile'd decode steps need them
        buckets = _run_buckets(engine, ids, short_len, vocab) if on_cuda or runner.compiled_decode else ()
        if on_cuda:
            import torch

            torch.cuda.synchronize(engine.device)
        seconds["buckets"] = time.perf_counter() - t
    finally:
        for rid in ids:
            engine.abort_request(rid)
        engine.role, engine.layer_hook = role, hook
        engine.block_manager.reset_prefix_cache()
    report = WarmupReport(seconds, (long_len, short_len, *buckets),
                          tuple(runner.graph_batch_sizes) if runner.use_cuda_graphs else (), _device_name(engine),
                          runner.prefill_graph_max_tokens)
    logger.info("%s", report.describe())
    return report


def _warm_paged_prefill(engine) -> list:
    """Fresh prompts take the dense attention kernel (kernels.prefill_attention_dense), so the
    requests below may never run the paged one that later chunks and prefix-cache hits take:
    compile its tile configurations directly (this rank's heads). Returns them ([] when the
    dense path is off, as the requests cover the paged kernel then)."""
    from pdserve.kernels.prefill_attention import warm_paged

    runner = engine.runner
    if not runner.dense_prefill:
        return []
    c = runner.model.config
    return warm_paged(c.num_heads, c.num_kv_heads, c.head_dim, runner.block_size, runner.dtype, engine.device)


def _run_buckets(engine, ids: list[str], short_len: int, vocab: int) -> tuple[int, ...]:
    """Part 3 of the module docstring; returns the bucket lengths that ran. `ids` collects the
    request ids (the caller aborts them)."""
    budget = engine.scheduler.config.max_num_batched_tokens
    cap = min(budget, engine.max_model_len - 8)
    if engine.device.type != "cuda":
        cap = min(cap, CPU_BUCKET_CAP)  # no kernels to compile: the start-up stays short
    buckets = [n for n in PREFILL_BUCKETS if n < cap]
    num_decodes = max(1, min(MAX_WARMUP_DECODES, engine.scheduler.config.max_num_seqs - 2))
    decode_tokens = len(buckets) + 2  # they end soon after the last bucket joined
    bm = engine.block_manager
    block = engine.config.cache.block_size
    greedy = SamplingParams(max_tokens=decode_tokens, temperature=0, ignore_eos=True)
    for k in range(num_decodes):
        if bm.num_free_blocks * block < (num_decodes + 1) * (short_len + decode_tokens + block):
            num_decodes = k
            break
        rid = f"__warmup-d{k}"
        engine.add_request(rid, [(7919 * (k + 3) + 31 * i) % (vocab - 2) + 1 for i in range(short_len)], greedy)
        ids.append(rid)
    if num_decodes:
        engine.step()  # their prompts, together: the decode batch
    ran = []
    for j, n in enumerate(buckets):
        if bm.num_free_blocks * block < n + 2 * block:
            continue
        rid = f"__warmup-b{j}"
        engine.add_request(rid, [(7919 * (j + 3 + num_decodes) + 17 * i) % (vocab - 2) + 1 for i in range(n)],
                           SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
        ids.append(rid)
        ran.append(n)
        for _ in range(MAX_WARMUP_STEPS):  # its prefill joins the decodes (in chunks when it must)
            engine.step()
            seq = engine.requests.get(rid)
            if seq is None or seq.num_output_tokens > 0:
                break
    for _ in range(MAX_WARMUP_STEPS):
        if not engine.has_unfinished_requests():
            break
        engine.step()
    return tuple(ran)
