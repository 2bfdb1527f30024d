"""The decode path that CUDA graphs replay (static padded input buffers), run eagerly on CPU:
the same greedy tokens as the ordinary path for a batch that mixes prefills and decodes and
shrinks as requests finish."""

from __future__ import annotations

import random

from pdserve.llm import LLM
from pdserve.sampling_params import SamplingParams

LENGTHS = [5, 40, 77, 18]
MAX_TOKENS = [3, 17, 9, 12]


def _run(static: bool):
    llm = LLM("random:tiny-llama", device="cpu", dtype="float32", num_blocks=64, block_size=16,
              max_num_batched_tokens=32, max_num_seqs=8)
    runner = llm.engine.runner
    runner.use_cuda_graphs = static  # off CUDA: static buffers, eager "replay"
    rng = random.Random(3)
    prompts = [[rng.randrange(2, 500) for _ in range(n)] for n in LENGTHS]
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in MAX_TOKENS]
    outs = llm.generate(prompts, params)
    return [o.token_ids for o in outs], runner, llm


def test_static_decode_inputs_match_eager_tokens():
    eager, eager_runner, _ = _run(False)
    static, runner, llm = _run(True)
    assert eager_runner.num_graph_replays == 0
    assert runner.num_graph_replays > 0
    assert [len(t) for t in static] == MAX_TOKENS
    assert static == eager
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_graph_sizes_are_capped_by_config_and_blocks():
    from pdserve.config import CacheConfig, EngineConfig
    from pdserve.engine import LLMEngine

    engine = LLMEngine(EngineConfig(model="random:tiny-llama", device="cpu", dtype="float32",
                                    cache=CacheConfig(num_blocks=40, cuda_graph_max_batch=24)))
    assert engine.runner.graph_batch_sizes == [1, 2, 4, 8, 16, 24]
    assert engine.runner.use_cuda_graphs is False  # CPU


def test_cuda_graphs_switch_reaches_the_cache_config(monkeypatch):
    """--no-cuda-graphs (or PDSERVE_CUDA_GRAPHS=0, read at the CLI edge) is enforce_eager in the
    config the runner gets; the runner reads no environment."""
    import pytest

    import argparse

    from pdserve.engine_args import add_engine_args, engine_config

    def cache(*flags):
        parser = argparse.ArgumentParser()
        add_engine_args(parser)
        return engine_config(parser.parse_args(list(flags))).cache

    monkeypatch.delenv("PDSERVE_CUDA_GRAPHS", raising=False)
    assert cache().enforce_eager is False
    assert cache("--no-cuda-graphs").enforce_eager is True
    monkeypatch.setenv("PDSERVE_CUDA_GRAPHS", "0")
    assert cache().enforce_eager is True
    assert cache("--cuda-graphs").enforce_eager is False  # the flag wins over the variable
    monkeypatch.setenv("PDSERVE_CUDA_GRAPHS", "maybe")
    with pytest.raises(ValueError, match="PDSERVE_CUDA_GRAPHS"):
        cache()


def test_incremental_block_tables_match_every_step_under_preemption():
    """The host mirror of the graph's block tables is updated incrementally (a row that kept
    its request only gets new blocks). Rows shift as requests finish, and a KV cache this small
    preempts: after every decode-only step each row must equal its request's block table, and
    the tokens must equal the eager path's."""
    import numpy as np

    def run(static: bool):
        llm = LLM("random:tiny-llama", device="cpu", dtype="float32", num_blocks=14, block_size=4,
                  max_num_batched_tokens=64, max_num_seqs=6, enable_prefix_caching=False)
        runner = llm.engine.runner
        runner.use_cuda_graphs = static
        checked = []
        graphs = runner.decode_graphs
        update = graphs._update_table_mirror if static else None

        def checking(seqs):
            width = update(seqs)
            for i, seq in enumerate(seqs):
                assert np.array_equal(graphs._table_mirror[i, :len(seq.block_ids)], seq.block_ids)
            assert width == max(len(s.block_ids) for s in seqs)
            checked.append(len(seqs))
            return width

        if static:
            graphs._update_table_mirror = checking
        rng = random.Random(5)
        prompts = [[rng.randrange(2, 500) for _ in range(rng.randrange(3, 12))] for _ in range(6)]
        params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (9, 4, 13, 6, 11, 8)]
        outs = llm.generate(prompts, params)
        return [o.token_ids for o in outs], llm.engine.scheduler.num_preemptions, checked

    eager, _, _ = run(False)
    static, preemptions, checked = run(True)
    assert static == eager
    assert preemptions > 0 and len(checked) > 5 and len(set(checked)) > 1
