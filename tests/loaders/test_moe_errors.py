"""Bad mixture-of-experts and Qwen3 inputs: one-line ValueErrors naming the tensor (or key) and,
for a shape, both the tensor's and the config's."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.loaders import load_model_source
from tests.engine.conftest import build_hf_model

from .test_errors import _raises


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    """Tiny Qwen3-MoE checkpoints: per expert (save_pretrained's default) and stacked."""
    model = build_hf_model("qwen3_moe")
    per_expert, stacked = tmp_path_factory.mktemp("per-expert"), tmp_path_factory.mktemp("stacked")
    model.save_pretrained(per_expert)
    model.save_pretrained(stacked, save_original_format=False)
    mixtral = tmp_path_factory.mktemp("mixtral")
    build_hf_model("mixtral").save_pretrained(mixtral)
    return {"per_expert": per_expert, "stacked": stacked, "mixtral": mixtral}


def _rewrite(src, dst, edit):
    """A copy of checkpoint `src` at `dst` whose tensors `edit` changed (a dict, edited in place)."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_unsupported_architecture_names_the_supported_ones(moe_dirs, tmp_path):
    model = _rewrite(moe_dirs["per_expert"], tmp_path / "m", lambda t: None)
    raw = json.loads((model / "config.json").read_text())
    raw["architectures"] = ["DeepseekV3ForCausalLM"]
    (model / "config.json").write_text(json.dumps(raw))
    _raises(str(model), "unsupported architecture DeepseekV3ForCausalLM", "Qwen3ForCausalLM", "MixtralForCausalLM",
            "Qwen3MoeForCausalLM", "OlmoeForCausalLM", "LlamaForCausalLM")


def test_per_expert_tensor_of_the_wrong_shape(moe_dirs, tmp_path):
    name = "model.layers.2.mlp.experts.5.up_proj.weight"

    def narrow(t):
        t[name] = t[name][:16].clone()
    _raises(str(_rewrite(moe_dirs["per_expert"], tmp_path / "m", narrow)), name, "(16, 64)", "(32, 64)")


def test_stacked_expert_tensor_of_the_wrong_shape(moe_dirs, tmp_path):
    name = "model.layers.0.mlp.experts.gate_up_proj"

    def drop_expert(t):
        t[name] = t[name][:7].clone()
    _raises(str(_rewrite(moe_dirs["stacked"], tmp_path / "m", drop_expert)), name, "(7, 64, 64)", "(8, 64, 64)")


def test_an_expert_beyond_the_config(moe_dirs, tmp_path):
    def extra(t):
        t["model.layers.0.mlp.experts.8.down_proj.weight"] = torch.zeros(64, 32)
    _raises(str(_rewrite(moe_dirs["per_expert"], tmp_path / "m", extra)),
            "model.layers.0.mlp.experts.8.down_proj.weight", "expert 8", "8 experts")


def test_a_missing_mixtral_expert_is_named_as_the_file_names_it(moe_dirs, tmp_path):
    def drop(t):
        del t["model.layers.1.block_sparse_moe.experts.3.w3.weight"]
    _raises(str(_rewrite(moe_dirs["mixtral"], tmp_path / "m", drop)),
            "missing tensor model.layers.1.block_sparse_moe.experts.3.w3.weight")


def test_experts_in_a_dense_layer(moe_dirs, tmp_path):
    def sparse_layer_1(t):  # layer 1 is dense in the config (mlp_only_layers=[1])
        t["model.layers.1.mlp.experts.down_proj"] = t["model.layers.0.mlp.experts.down_proj"].clone()
    _raises(str(_rewrite(moe_dirs["stacked"], tmp_path / "m", sparse_layer_1)),
            "unexpected tensor model.layers.1.mlp.experts.down_proj", "dense")


def test_both_layouts_at_once(moe_dirs, tmp_path):
    stacked = load_file(str(moe_dirs["stacked"] / "model.safetensors"))

    def both(t):
        t["model.layers.0.mlp.experts.down_proj"] = stacked["model.layers.0.mlp.experts.down_proj"]
    _raises(str(_rewrite(moe_dirs["per_expert"], tmp_path / "m", both)), "model.layers.0.mlp.experts.",
            "more than once")


@pytest.mark.parametrize("key, value, fragment", [
    ("num_experts_per_tok", 9, "top_k (9) exceeds num_experts (8)"),
    ("moe_intermediate_size", 0, "moe_intermediate_size must be a positive integer"),
    ("norm_topk_prob", "yes", "norm_topk_prob must be true or false"),
    ("mlp_only_layers", "1", "mlp_only_layers must be a list"),
])
def test_bad_moe_config_values(moe_dirs, tmp_path, key, value, fragment):
    model = _rewrite(moe_dirs["per_expert"], tmp_path / "m", lambda t: None)
    raw = json.loads((model / "config.json").read_text())
    raw[key] = value
    (model / "config.json").write_text(json.dumps(raw))
    _raises(str(model), "config.json", fragment)


def test_loaded_layouts_agree(moe_dirs):
    """The two layouts give the same weights under the same names."""
    a = dict(load_model_source(str(moe_dirs["per_expert"])).iter_weights())
    b = dict(load_model_source(str(moe_dirs["stacked"])).iter_weights())
    assert set(a) == set(b) and "model.layers.2.mlp.experts.7.gate_proj.weight" in a
    for name in a:
        assert torch.equal(a[name], b[name]), name
