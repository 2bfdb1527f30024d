"""Ready means warm (pdserve/warmup.py): the throw-away requests run the serving paths and
leave nothing behind."""

from __future__ import annotations

import pytest

from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine import LLMEngine
from pdserve.sampling_params import SamplingParams
from pdserve.warmup import LONG_DECODE_TOKENS, SHORT_DECODE_TOKENS, warm_up, warmup_lengths


def make_engine(role="mixed", prefix=True):
    return LLMEngine(EngineConfig(model="random:tiny-llama", device="cpu",
                                  cache=CacheConfig(num_blocks=32, enable_prefix_caching=prefix),
                                  scheduler=SchedulerConfig(role=role, max_num_batched_tokens=64)))


@pytest.mark.parametrize("role", ["mixed", "prefill", "decode"])
def test_warm_up_runs_mixed_and_decode_steps_and_leaves_nothing(role):
    engine = make_engine(role)
    hook_calls = []
    engine.layer_hook = lambda layer, batch: hook_calls.append(layer)
    engine.runner.use_cuda_graphs = True  # off CUDA: the graph path's static buffers, eager
    report = warm_up(engine)
    assert engine.num_steps >= 6  # the long prompt, a mixed step, decodes at batch 2 then 1
    assert engine.runner.num_graph_replays > 0 and engine.runner.num_decode_only_steps > 0
    assert hook_calls == []  # a prefill worker's hook (its KV push) never sees warm-up requests
    assert engine.role == role and engine.layer_hook is not None
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not engine.requests and not engine.scheduler.held
    assert bm._cached == {}  # the prefix cache forgot the warm-up prompts
    assert set(report.seconds) >= {"requests"} and report.prompt_tokens == (16, 8)
    assert "warm-up on cpu" in report.describe()
    # the engine serves normally afterwards, in its own role
    engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=2, temperature=0))
    outs = [o for _ in range(4) for o in engine.step()]
    assert outs and outs[-1].finish_reason == ("prefilled" if role == "prefill" else "length")


def test_warm_up_refuses_an_engine_with_requests_and_the_switch(monkeypatch):
    engine = make_engine()
    engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="before the engine takes requests"):
        warm_up(engine)
    import argparse

    from pdserve.engine_args import add_engine_args, engine_config

    def warmup(*flags):
        parser = argparse.ArgumentParser()
        add_engine_args(parser)
        return engine_config(parser.parse_args(list(flags))).warmup

    monkeypatch.delenv("PDSERVE_WARMUP", raising=False)
    assert warmup() is True and warmup("--no-warmup") is False
    monkeypatch.setenv("PDSERVE_WARMUP", "0")  # read at the CLI edge, into EngineConfig.warmup
    assert warmup() is False and warmup("--warmup") is True
    monkeypatch.setenv("PDSERVE_WARMUP", "sometimes")
    with pytest.raises(ValueError, match="PDSERVE_WARMUP"):
        warmup()


def test_layer_hook_runs_only_for_batches_with_a_hand_off():
    """A mixed worker that also prefills for others (hybrid) keeps its hook-free decode paths:
    the KV push hook sees only the steps that compute a request to hand off."""
    engine = make_engine("mixed")
    seen = []
    engine.layer_hook = lambda layer, batch: seen.append(tuple(s.request_id for s in batch.seqs))
    greedy = SamplingParams(max_tokens=3, temperature=0)
    engine.add_request("local", [5, 6, 7, 8], greedy)
    while engine.has_unfinished_requests():
        engine.step()
    assert seen == []
    engine.add_request("local2", [9, 10, 11], greedy)
    engine.step()  # local2 prefilled, now decoding
    engine.add_request("handoff", [1, 2, 3, 4, 5], greedy, hand_off=True)
    outs = engine.step()
    assert seen and all("handoff" in ids for ids in seen)
    assert any(o.request_id == "handoff" and o.finish_reason == "prefilled" for o in outs)
    count = len(seen)
    while engine.has_unfinished_requests():
        engine.step()  # local2 decodes alone: no hook
    assert len(seen) == count
    engine.release("handoff")
    assert not engine.requests


def test_warm_up_runs_the_overlapped_decode_path():
    """With the decode-graph path on (forced here off CUDA), the warm-up's last decode steps
    take the overlapped path, launch ahead included, and leave nothing in flight."""
    from pdserve.llm import LLM
    from pdserve.warmup import warm_up

    llm = LLM("random:tiny-llama", device="cpu", dtype="float32", num_blocks=64, block_size=16)
    engine = llm.engine
    engine.runner.use_cuda_graphs = True
    warm_up(engine)
    assert engine.num_steps_ahead >= 1 and engine._in_flight is None
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_release_before_the_prefill_finished_frees_every_block():
    """A prefill worker's caller that goes away mid-prefill (its Prefill call cancelled) releases
    the request before it reached `held`: it is aborted, not left to finish and hold its blocks."""
    engine = make_engine("prefill", prefix=False)
    free = engine.block_manager.num_free_blocks
    engine.add_request("cut", list(range(1, 150)), SamplingParams(max_tokens=3, temperature=0), hand_off=True)
    engine.step()  # the first 64-token chunk of 149
    assert engine.block_manager.num_free_blocks < free
    engine.release("cut")
    while engine.has_unfinished_requests():
        engine.step()
    assert not engine.requests and not engine.scheduler.held
    assert engine.block_manager.num_free_blocks == free


@pytest.mark.parametrize("budget,max_model_len", [(8192, 4096), (8192, 8192), (512, 512), (8192, 20), (512, 16384)])
@pytest.mark.parametrize("on_cuda", [True, False])
def test_warm_up_prompts_and_their_decodes_fit_the_context(budget, max_model_len, on_cuda):
    """`pdserve up --max-model-len 4096` on a GPU (budget 8192) once failed to start: the long
    warm-up prompt took 4088 tokens and then asked for 10 more."""
    long_len, short_len = warmup_lengths(budget, max_model_len, on_cuda)
    assert long_len + LONG_DECODE_TOKENS <= max_model_len
    assert short_len + SHORT_DECODE_TOKENS <= max_model_len
    assert long_len == min(budget if on_cuda else 16, max_model_len - LONG_DECODE_TOKENS)


def test_warm_up_with_the_context_below_the_budget():
    """The same on the CPU engine end to end: a context of 40 tokens under a budget of 64."""
    engine = LLMEngine(EngineConfig(model="random:tiny-llama", device="cpu", max_model_len=40,
                                    cache=CacheConfig(num_blocks=32),
                                    scheduler=SchedulerConfig(max_num_batched_tokens=64)))
    report = warm_up(engine)
    assert report.prompt_tokens[0] + LONG_DECODE_TOKENS <= 40
    assert not engine.has_unfinished_requests()


def test_cpu_warm_up_runs_no_buckets():
    """On the CPU the prefill buckets compile nothing (unless decode steps are torch.compile'd):
    the warm-up runs its two requests only, whatever the token budget."""
    engine = LLMEngine(EngineConfig(model="random:tiny-llama", device="cpu", cache=CacheConfig(num_blocks=128),
                                    scheduler=SchedulerConfig(max_num_batched_tokens=512)))
    report = warm_up(engine)
    assert report.prompt_tokens == (16, 8) and "buckets" in report.seconds
    assert not engine.has_unfinished_requests()


def test_warm_up_with_the_prefill_graphs_runs_their_segments_and_says_so():
    """Forced on off CUDA: nothing to capture (0 s), the warm-up's prefill steps run the segments,
    and the report names the graphs' bound."""
    engine = make_engine("prefill")
    engine.runner.use_cuda_graphs = True
    engine.runner.prefill_graph_max_tokens = 32
    report = warm_up(engine)
    assert report.seconds["prefill graphs"] == 0.0
    assert engine.runner._piecewise.num_runs > 0
    assert report.describe().endswith("; prefill graphs up to 32 tokens")
    assert "prefill graphs" not in warm_up(make_engine("mixed")).describe()
