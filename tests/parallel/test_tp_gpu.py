"""TP=2 on two GPUs (NCCL): CUDA-graph decode steps with the collectives captured in the
graphs give the greedy tokens of TP=1. Not run on CPU machines."""

from __future__ import annotations

import pytest

from pdserve.llm import LLM
from pdserve.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu(2)


def test_tp2_with_cuda_graphs_matches_tp1():
    prompts = [[1, 2, 3, 4, 5], list(range(20, 90)), [7, 8, 9]]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    engine = dict(device="cuda", dtype="float32", num_blocks=256)
    ref = LLM("random:tiny-llama-tp", **engine)
    expected = [o.token_ids for o in ref.generate(prompts, params)]
    del ref
    with LLM("random:tiny-llama-tp", tensor_parallel_size=2, **engine) as llm:
        tokens = [o.token_ids for o in llm.generate(prompts, params)]
        assert llm.engine.runner.num_graph_replays > 0
    assert tokens == expected
