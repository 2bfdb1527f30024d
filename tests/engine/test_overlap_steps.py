"""Overlapped decode steps (pdserve/engine.py): the step after a decode-only graph step is
launched before that step's tokens reach the host. Run on the CPU through the graph path's
static buffers (eager "replay"): the same tokens, finish reasons, prefix-cache hits and block
accounting as the synchronous engine, under requests that end by length, by a stop token, by
abort while the next step is in flight, and with sampled rows."""

from __future__ import annotations

import random

import pytest

from pdserve.llm import LLM
from pdserve.sampling_params import SamplingParams

LENGTHS = [5, 40, 77, 18, 33]
MAX_TOKENS = [3, 17, 9, 12, 25]


def make_llm(overlap: bool, monkeypatch, **kw) -> LLM:
    args = dict(device="cpu", dtype="float32", num_blocks=96, block_size=16, max_num_batched_tokens=64,
                max_num_seqs=8, overlap_steps=overlap)
    args.update(kw)
    llm = LLM("random:tiny-llama", **args)
    llm.engine.runner.use_cuda_graphs = True  # off CUDA: static buffers, eager "replay"
    assert llm.engine.overlap_steps is overlap
    return llm


def prompts(seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 500) for _ in range(n)] for n in LENGTHS]


def count_launches_ahead(llm: LLM) -> list[int]:
    calls = [0]
    original = llm.engine._launch_ahead

    def counting(current):
        calls[0] += 1
        return original(current)

    llm.engine._launch_ahead = counting
    return calls


def assert_idle(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_unfinished_requests() and engine._in_flight is None
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_same_tokens_with_length_and_stop_token_finishes(monkeypatch):
    base = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in MAX_TOKENS]
    sync = make_llm(False, monkeypatch)
    reference = [o.token_ids for o in sync.generate(prompts(), base)]
    # stop tokens that end three requests early, at different steps
    params = list(base)
    for i in (1, 3, 4):
        params[i] = SamplingParams(max_tokens=MAX_TOKENS[i], temperature=0, ignore_eos=True,
                                   stop_token_ids=[reference[i][len(reference[i]) // 2]])
    expected = sync.generate(prompts(), params)

    llm = make_llm(True, monkeypatch)
    launched = count_launches_ahead(llm)
    got = llm.generate(prompts(), params)
    assert launched[0] >= 3  # the overlapped path ran
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in expected]
    assert {o.finish_reason for o in got} == {"length", "stop"}
    assert [o.text for o in got] == [o.text for o in expected]
    assert_idle(llm)


def test_prefix_cache_after_overlapped_steps(monkeypatch):
    """Blocks filled while a step ran ahead are hashed once their tokens are known: a prompt
    that repeats a finished request's prompt and output hits them, with the same tokens."""
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    results = {}
    for overlap in (False, True):
        llm = make_llm(overlap, monkeypatch)
        first = llm.generate(prompts()[:2], params)
        follow = [p + o.token_ids for p, o in zip(prompts()[:2], first)]
        second = llm.generate(follow, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        results[overlap] = ([o.token_ids for o in first], [o.token_ids for o in second],
                            [o.num_cached_tokens for o in second])
        assert_idle(llm)
    assert results[True] == results[False]
    assert results[True][2] == [32, 64]  # every full block of each finished sequence came from the cache


def test_abort_while_next_step_in_flight(monkeypatch):
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    sync = make_llm(False, monkeypatch)
    reference = [o.token_ids for o in sync.generate(prompts(), params)]

    llm = make_llm(True, monkeypatch)
    engine = llm.engine
    for i, p in enumerate(prompts()):
        engine.add_request(f"r{i}", p, params)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(LENGTHS))}
    aborted = False
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
        if not aborted and engine._in_flight is not None and len(tokens["r2"]) >= 5:
            assert engine.abort_request("r2")  # its next token is being computed
            aborted = True
    assert aborted
    assert_idle(llm)
    for i in (0, 1, 3, 4):
        assert tokens[f"r{i}"] == reference[i]
    assert tokens["r2"] == reference[2][:len(tokens["r2"])] and len(tokens["r2"]) < 30


def test_sampled_rows_overlap_and_seeded_rows_do_not(monkeypatch):
    llm = make_llm(True, monkeypatch)
    launched = count_launches_ahead(llm)
    out = llm.generate(prompts()[:3], SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, ignore_eos=True))
    assert [len(o.token_ids) for o in out] == [12] * 3 and launched[0] > 0
    before = launched[0]
    seeded = [SamplingParams(max_tokens=12, temperature=0.8, seed=7, ignore_eos=True)] * 3
    a = llm.generate(prompts()[:3], seeded)
    assert launched[0] == before  # a seeded row draws from its own generator on the host path
    sync = make_llm(False, monkeypatch)
    assert [o.token_ids for o in a] == [o.token_ids for o in sync.generate(prompts()[:3], seeded)]
    assert_idle(llm)


def test_logprobs_and_penalties_take_the_synchronous_step(monkeypatch):
    llm = make_llm(True, monkeypatch)
    launched = count_launches_ahead(llm)
    out = llm.generate(prompts()[:2], [SamplingParams(max_tokens=6, temperature=0, logprobs=2, ignore_eos=True),
                                       SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)])
    assert launched[0] == 0 and all(len(o.logprobs) == 6 for o in out[:1])
    llm.generate(prompts()[:2], SamplingParams(max_tokens=6, temperature=0, presence_penalty=0.5, ignore_eos=True))
    assert launched[0] == 0
    assert_idle(llm)


def test_switch_from_flag_or_env_at_the_edge(monkeypatch):
    """--[no-]overlap-steps, else PDSERVE_OVERLAP_STEPS (read by the CLI layer only), else on;
    the engine itself reads no environment."""
    import argparse

    from pdserve.engine_args import add_engine_args, engine_config, engine_kwargs

    def parse(*flags):
        parser = argparse.ArgumentParser()
        add_engine_args(parser)
        return parser.parse_args(list(flags))

    monkeypatch.delenv("PDSERVE_OVERLAP_STEPS", raising=False)
    assert engine_config(parse()).overlap_steps is True
    assert engine_config(parse("--no-overlap-steps")).overlap_steps is False
    monkeypatch.setenv("PDSERVE_OVERLAP_STEPS", "0")
    assert engine_config(parse()).overlap_steps is False
    assert engine_kwargs(parse())["overlap_steps"] is False
    assert engine_config(parse("--overlap-steps")).overlap_steps is True
    assert make_llm(True, monkeypatch).engine.overlap_steps is True  # the config, not the variable
    monkeypatch.setenv("PDSERVE_OVERLAP_STEPS", "sometimes")
    with pytest.raises(ValueError, match="PDSERVE_OVERLAP_STEPS"):
        engine_config(parse())


@pytest.mark.gpu
def test_overlap_on_a_gpu_gives_the_synchronous_tokens(monkeypatch):
    """On CUDA (real graphs, tokens copied out asynchronously, the next step's input ids read on
    the device), fp32 so greedy tokens must agree exactly; with stop tokens ending requests
    while the next step is in flight."""
    rng = random.Random(5)
    batch = [[rng.randrange(10, 40000) for _ in range(n)] for n in (5, 40, 77, 130, 300, 17)]
    base = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (3, 17, 9, 33, 20, 40)]

    def run(overlap: bool, params):
        llm = LLM("random:smollm2-135m", device="cuda", dtype="float32", num_blocks=256,
                  max_num_batched_tokens=64, max_num_seqs=8, overlap_steps=overlap)
        launched = count_launches_ahead(llm)
        outs = llm.generate(batch, params)
        assert_idle(llm)
        return [(o.token_ids, o.finish_reason) for o in outs], launched[0]

    reference, _ = run(False, base)
    params = list(base)
    for i in (1, 3, 5):
        params[i] = SamplingParams(max_tokens=base[i].max_tokens, temperature=0, ignore_eos=True,
                                   stop_token_ids=[reference[i][0][len(reference[i][0]) // 2]])
    expected, none = run(False, params)
    got, launched = run(True, params)
    assert none == 0 and launched > 10
    assert got == expected
