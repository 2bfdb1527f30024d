"""Offline Python API.

    from pdserve import LLM, SamplingParams
    llm = LLM("smollm2")
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=32))
    print(out[0].text)
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Sequence

from tqdm import tqdm

from pdserve.config import CacheConfig, EngineConfig, KernelConfig, SchedulerConfig
from pdserve.engine import LLMEngine
from pdserve.sampling_params import SamplingParams, TokenLogprob


@dataclass
class CompletionOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)


class LLM:
    def __init__(self, model: str = "smollm2", *, tokenizer: str | None = None, dtype: str | None = None,
                 device: str | None = None,
                 seed: int = 0, max_model_len: int | None = None, block_size: int = 16,
                 kv_cache_gib: float = 0.5, num_blocks: int | None = None,
                 gpu_memory_fraction: float = 0.85, max_num_batched_tokens: int | None = None,
                 max_num_seqs: int | None = None, enable_prefix_caching: bool = True, compile: bool = False,
                 packed_weights: bool = True, kv_cache_dtype: str = "auto", overlap_steps: bool = True,
                 enforce_eager: bool = False, experimental_fp8_kv: bool = False,
                 prefill_graphs: bool = True, tensor_parallel_size: int = 1, expert_parallel: bool = False,
                 kernels: KernelConfig | None = None) -> None:
        """`tensor_parallel_size` N > 1: the model is split over N ranks, this process being
        rank 0 and N - 1 local processes the others (pdserve.parallel); `close()` stops them.
        `expert_parallel`: a mixture-of-experts model's experts are divided among those ranks.
        `kernels`: the kernels' settings, this process's (None: from its environment,
        PDSERVE_KERNEL_BACKEND and PDSERVE_PREFILL_ATTENTION, when the engine starts)."""
        # max_num_batched_tokens / max_num_seqs None: the device's defaults (pdserve.config.SCHEDULER_DEFAULTS)
        config = EngineConfig(
            model=model, tokenizer=tokenizer, dtype=dtype, device=device, seed=seed, max_model_len=max_model_len,
            overlap_steps=overlap_steps,
            cache=CacheConfig(block_size=block_size, cpu_kv_gib=kv_cache_gib, num_blocks=num_blocks,
                              gpu_memory_fraction=gpu_memory_fraction,
                              enable_prefix_caching=enable_prefix_caching,
                              compile_cpu_decode=compile, cpu_packed_weights=packed_weights,
                              kv_cache_dtype=kv_cache_dtype, enforce_eager=enforce_eager,
                              experimental_fp8_kv=experimental_fp8_kv, prefill_graphs=prefill_graphs),
            scheduler=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens,
                                      max_num_seqs=max_num_seqs),
            tensor_parallel_size=tensor_parallel_size,
            expert_parallel=expert_parallel, kernels=kernels,
        )
        self.engine = LLMEngine(config)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def close(self) -> None:
        """Stops the engine's other tensor-parallel ranks, if any (also at exit)."""
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[CompletionOutput]:
        """Raw completion of each prompt (text, or token ids); no chat template."""
        if isinstance(prompts, str):
            prompts = [prompts]
        token_lists = []
        for prompt in prompts:
            if isinstance(prompt, str):
                if self.tokenizer is None:
                    raise ValueError("this model has no tokenizer; pass token ids")
                token_lists.append(self.tokenizer.encode(prompt))
            else:
                token_lists.append([int(t) for t in prompt])
        return self._run(token_lists, params, use_tqdm)

    def chat(self, conversations: list[dict[str, Any]] | list[list[dict[str, Any]]],
             params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = False) -> list[CompletionOutput]:
        """Applies the model's chat template to each conversation, then generates."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer and no chat template")
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # type: ignore[list-item]
        token_lists = [self.tokenizer.encode(self.tokenizer.apply_chat_template(c), add_special_tokens=False)
                       for c in conversations]  # type: ignore[arg-type]
        return self._run(token_lists, params, use_tqdm)

    def _run(self, token_lists: list[list[int]], params, use_tqdm: bool) -> list[CompletionOutput]:
        if params is None:
            params = SamplingParams()
        param_list = list(params) if isinstance(params, (list, tuple)) else [params] * len(token_lists)
        if len(param_list) != len(token_lists):
            raise ValueError("one SamplingParams per prompt, or a single one for all")
        engine = self.engine
        for tokens, p in zip(token_lists, param_list):  # validate all before admitting any
            engine.validate(tokens, p)
        outputs: dict[str, CompletionOutput] = {}
        order = []
        try:
            for tokens, p in zip(token_lists, param_list):
                rid = f"offline-{next(self._ids)}"
                engine.add_request(rid, tokens, p)
                outputs[rid] = CompletionOutput(rid, tokens)
                order.append(rid)
            bar = tqdm(total=len(order), disable=not use_tqdm, desc="generate")
            while engine.has_unfinished_requests():
                for out in engine.step():
                    co = outputs[out.request_id]
                    co.token_ids.extend(out.new_token_ids)
                    co.text += out.new_text
                    co.num_cached_tokens = out.num_cached_tokens
                    if out.logprobs:
                        co.logprobs.extend(out.logprobs)
                    if out.finished:
                        co.finish_reason = out.finish_reason
                        bar.update(1)
            bar.close()
        finally:
            for rid in order:
                engine.abort_request(rid)
        return [outputs[rid] for rid in order]
