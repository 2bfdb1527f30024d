"""Qwen3 and the mixture-of-experts families split over ranks (local processes, gloo): tensor
parallelism (each expert's width split) and expert parallelism (the experts divided among the
ranks), against transformers' greedy generate and against TP 1's logits."""

from __future__ import annotations

import multiprocessing

import pytest
import torch

from pdserve.llm import LLM
from pdserve.loaders import load_model_source
from pdserve.loaders.random_weights import RANDOM_SHAPES
from pdserve.parallel.layout import NOTHING, TPLayout, check_tensor_parallel
from pdserve.sampling_params import SamplingParams
from tests.engine.test_model_families import hf_generate
from tests.engine.test_model_vs_transformers import prompts

from .test_tp_engine import ENGINE, GREEDY, PROMPTS, run_recording

MOE_TP = RANDOM_SHAPES["tiny-qwen3-moe-tp"]  # 4 experts of width 48, layer 1 dense
OLMOE_TP = RANDOM_SHAPES["tiny-olmoe-tp"]  # q/k norms over the projection, 2 KV heads


def test_expert_weights_split_by_width_under_tp():
    source = load_model_source("random:tiny-qwen3-moe-tp")
    whole = dict(source.iter_weights())
    shards = [dict(source.iter_weights(shard=TPLayout(MOE_TP, r, 2).shard_index)) for r in range(2)]
    for name in ("model.layers.0.mlp.experts.3.gate_proj.weight", "model.layers.2.mlp.experts.0.up_proj.weight"):
        assert shards[0][name].shape == (24, 96)
        assert torch.equal(torch.cat([s[name] for s in shards]), whole[name])
    name = "model.layers.2.mlp.experts.1.down_proj.weight"
    assert torch.equal(torch.cat([s[name] for s in shards], dim=1), whole[name])
    for name in ("model.layers.0.mlp.gate.weight", "model.layers.0.self_attn.q_norm.weight"):  # replicated
        assert all(torch.equal(s[name], whole[name]) for s in shards)
    name = "model.layers.1.mlp.gate_proj.weight"  # the dense layer: the dense width, 192 / 2
    assert shards[1][name].shape == (96, 96)
    local = TPLayout(MOE_TP, 1, 2).local_config()
    assert (local.moe.intermediate_size, local.moe.num_experts, local.intermediate_size) == (24, 4, 96)


def test_experts_divided_among_ranks_under_ep():
    layouts = [TPLayout(MOE_TP, r, 2, expert_parallel=True) for r in range(2)]
    assert [layout.expert_range for layout in layouts] == [range(0, 2), range(2, 4)]
    assert layouts[1].local_config().moe.intermediate_size == 48  # whole experts
    assert layouts[0].shard_index("model.layers.0.mlp.experts.1.down_proj.weight") is None
    assert layouts[0].shard_index("model.layers.0.mlp.experts.2.down_proj.weight") == NOTHING
    assert layouts[1].shard_index("model.layers.2.mlp.experts.3.gate_proj.weight") is None
    # attention and the dense layer are still split by tensor parallelism
    assert layouts[1].shard_index("model.layers.1.mlp.gate_proj.weight") == (slice(96, 192),)
    source = load_model_source("random:tiny-qwen3-moe-tp")
    held = dict(source.iter_weights(shard=layouts[1].shard_index))
    assert held["model.layers.0.mlp.experts.0.up_proj.weight"].numel() == 0  # not read
    assert held["model.layers.0.mlp.experts.2.up_proj.weight"].shape == (48, 96)


def test_projection_norms_split_with_their_heads():
    layout = TPLayout(OLMOE_TP, 1, 2)  # 3 query heads and 1 KV head of 16 a rank
    assert layout.shard_index("model.layers.0.self_attn.q_norm.weight") == (slice(48, 96),)
    assert layout.shard_index("model.layers.0.self_attn.k_norm.weight") == (slice(16, 32),)
    qwen3 = TPLayout(MOE_TP, 1, 2)  # per-head norms: replicated
    assert qwen3.shard_index("model.layers.0.self_attn.k_norm.weight") is None


@pytest.mark.parametrize("config, size, ep, message", [
    (RANDOM_SHAPES["tiny-llama-tp"], 2, True, "--expert-parallel: random:tiny-llama-tp has no experts"),
    (RANDOM_SHAPES["tiny-olmoe"], 4, True, "--expert-parallel at --tensor-parallel-size 4: the 6 experts of "
                                           "random:tiny-olmoe do not divide by 4"),
])
def test_bad_splits_name_the_flags(config, size, ep, message):
    with pytest.raises(ValueError, match=message):
        check_tensor_parallel(config, size, expert_parallel=ep)


def test_expert_width_that_does_not_divide_suggests_expert_parallel():
    import dataclasses

    config = dataclasses.replace(MOE_TP, moe=dataclasses.replace(MOE_TP.moe, intermediate_size=49))
    with pytest.raises(ValueError, match="size 2 does not divide the expert width 49 .* --expert-parallel"):
        check_tensor_parallel(config, 2)
    check_tensor_parallel(config, 2, expert_parallel=True)  # 4 experts: 2 a rank


@pytest.fixture(scope="module")
def reference():
    cache = {}

    def get(model):
        if model not in cache:
            cache[model] = run_recording(LLM(model, **ENGINE), PROMPTS, GREEDY)
        return cache[model]
    return get


@pytest.mark.parametrize("model, ep", [("random:tiny-qwen3-moe-tp", False), ("random:tiny-qwen3-moe-tp", True),
                                       ("random:tiny-olmoe-tp", False), ("random:tiny-olmoe-tp", True)])
def test_logits_and_greedy_tokens_equal_tp1(reference, model, ep):
    ref_tokens, ref_logits = reference(model)
    with LLM(model, tensor_parallel_size=2, expert_parallel=ep, **ENGINE) as llm:
        moe = llm.engine.runner.model.layers[0].moe
        assert len(moe.experts) == (2 if ep else 4) and moe.w13.shape[1] == (96 if ep else 48)
        tokens, logits = run_recording(llm, PROMPTS, GREEDY)
        assert len(logits) == len(ref_logits) >= 6
        for ours, ref in zip(logits, ref_logits):
            torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
    assert tokens == ref_tokens
    assert not multiprocessing.active_children()


def test_graph_path_steps_with_experts_divided(reference):
    """Decode-only steps through the CUDA-graph path's static buffers (off CUDA: run eagerly) of a
    MoE model under expert parallelism: padding rows route to experts too, and are dropped."""
    model = "random:tiny-qwen3-moe-tp"
    ref_tokens, _ = reference(model)
    with LLM(model, tensor_parallel_size=2, expert_parallel=True, **ENGINE) as llm:
        llm.engine.runner.use_cuda_graphs = True
        tokens, _ = run_recording(llm, PROMPTS, GREEDY)
        assert llm.engine.runner.num_graph_replays > 0
    assert tokens == ref_tokens


@pytest.mark.parametrize("family, ep", [("qwen3", False), ("mixtral", False), ("qwen3_moe", False), ("olmoe", False),
                                        ("qwen3_moe", True), ("olmoe", True)])
def test_hf_models_at_tp2_equal_transformers_generate(hf_models, family, ep):
    model, path = hf_models[family]
    batch = prompts(2, seed=9)
    with LLM(path, dtype="float32", tensor_parallel_size=2, expert_parallel=ep, **ENGINE) as llm:
        outs = llm.generate(batch, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    for prompt, out in zip(batch, outs):
        assert out.token_ids == hf_generate(model, prompt, 10)


@pytest.mark.parametrize("ep", [False, True])
def test_stacked_experts_at_tp2(hf_models, tmp_path, ep):
    """The stacked layout read one expert's slice at a time (per rank: its width or its experts)."""
    model, _ = hf_models["mixtral"]
    model.save_pretrained(tmp_path, save_original_format=False)
    batch = prompts(2, seed=10)
    with LLM(str(tmp_path), dtype="float32", tensor_parallel_size=2, expert_parallel=ep, **ENGINE) as llm:
        outs = llm.generate(batch, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    for prompt, out in zip(batch, outs):
        assert out.token_ids == hf_generate(model, prompt, 10)


def test_expert_parallel_flag_reaches_every_engine(tmp_path):
    from pdserve.engine_args import engine_config, engine_kwargs
    from pdserve.launcher.cli import build_parser
    from pdserve.launcher.cluster.config import load_up_config
    from pdserve.launcher.cluster.up import check_tensor_parallel_pools, pool_specs

    args = build_parser().parse_args(["generate", "--model", "random:tiny-qwen3-moe-tp", "-tp", "2",
                                      "--expert-parallel", "--prompt", "hi"])
    assert engine_kwargs(args)["expert_parallel"] and engine_config(args).expert_parallel
    assert not engine_config(build_parser().parse_args(["generate", "--prompt", "hi"])).expert_parallel
    args = build_parser().parse_args(["up", "--model", "random:tiny-qwen3-moe-tp", "-tp", "2", "--expert-parallel"])
    flags = {k: v for k, v in vars(args).items() if k not in ("command", "func", "log_level", "config")}
    specs = pool_specs(load_up_config(flags), gpus_in_cluster=0.0)
    assert all(s.engine.expert_parallel and s.engine.tensor_parallel_size == 2 for s in specs)
    path = tmp_path / "c.yaml"
    path.write_text("model: random:tiny-olmoe\ntensor-parallel-size: 4\nexpert-parallel: true\n")
    with pytest.raises(ValueError, match="--expert-parallel at --tensor-parallel-size 4: the 6 experts"):
        check_tensor_parallel_pools(load_up_config({}, str(path)))
