"""`pdserve profile` and the KV plane's view of Qwen3 and the mixture-of-experts families: the
per-token KV bytes and the transfer layout come from the model's head_dim and KV heads."""

from __future__ import annotations

import pytest

from pdserve.kvtransfer.layout import KVLayout
from pdserve.launcher.cli import main
from pdserve.llm import LLM
from pdserve.loaders.random_weights import RANDOM_SHAPES
from pdserve.router.placement.profiles import load_profile


@pytest.mark.parametrize("model", ["random:tiny-qwen3", "random:tiny-qwen3-moe", "random:tiny-olmoe"])
def test_profile_cli_on_the_new_families(tmp_path, capsys, model):
    out = tmp_path / "profile.json"
    rc = main(["profile", "--model", model, "--device", "cpu", "--kv-cache-gib", "0.01", "--out", str(out),
               "--prefill-tokens", "16,64", "--decode-batches", "1,4", "--decode-contexts", "16,64",
               "--repeats", "1", "--decode-steps", "2", "--quiet"])
    assert rc == 0
    assert f"{out}: {model} on " in capsys.readouterr().out
    profile = load_profile(str(out))
    c = RANDOM_SHAPES[model.removeprefix("random:")]
    assert profile.model == model and profile.num_layers == c.num_layers
    assert profile.kv_bytes_per_token == 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4  # fp32
    assert all(t > 0 for t in profile.prefill_times) and all(t > 0 for row in profile.decode_times for t in row)


def test_kv_layout_of_qwen3_is_its_head_dim(hf_models):
    """head_dim 32 on a hidden size of 64 and 4 heads (16 = hidden / heads would be wrong)."""
    _, path = hf_models["qwen3"]
    runner = LLM(path, dtype="float32", device="cpu", num_blocks=4, block_size=16).engine.runner
    layout = KVLayout.from_caches(runner.kv_caches)
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim) == (3, 2, 32)
    assert layout.block_bytes == 16 * 2 * 32 * 4
    wrong = KVLayout(3, 16, 2, 16, "float32")
    assert layout.fingerprint != wrong.fingerprint
    assert runner.kv_bytes_per_token == 2 * 3 * layout.block_bytes / 16
