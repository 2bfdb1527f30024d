"""`pdserve profile` on a tiny random model (CPU): a real measurement that router.placement.profiles loads."""

from __future__ import annotations

import json

import pytest

from pdserve.launcher.cli import main
from pdserve.router.placement.profiles import load_profile


def test_profile_cli_writes_a_profile_that_loads(tmp_path, capsys):
    out = tmp_path / "profile.json"
    rc = main(["profile", "--model", "random:tiny-llama", "--device", "cpu", "--kv-cache-gib", "0.01",
               "--out", str(out), "--prefill-tokens", "16,64,128,100000", "--decode-batches", "1,2",
               "--decode-contexts", "16,64", "--repeats", "1", "--decode-steps", "2", "--quiet"])
    assert rc == 0
    assert f"{out}: random:tiny-llama on " in capsys.readouterr().out
    profile = load_profile(str(out))
    assert (profile.model, profile.device, profile.dtype) == ("random:tiny-llama", "cpu", "float32")
    assert profile.hardware.endswith("threads)")
    # K and V x 2 layers x 2 kv heads x 16 dims x 4 bytes (fp32)
    assert (profile.num_layers, profile.kv_bytes_per_token) == (2, 2 * 2 * 2 * 16 * 4)
    assert profile.prefill_tokens == (16, 64, 128)  # 100000 is over the model's context: left out
    assert (profile.decode_batch_sizes, profile.decode_contexts) == ((1, 2), (16, 64))
    assert all(t > 0 for t in profile.prefill_times) and all(t > 0 for row in profile.decode_times for t in row)
    assert profile.prefill_seconds(100) > 0 and profile.decode_step_seconds(2, 40) > 0
    assert json.loads(out.read_text())["version"] == 1


def test_profile_cli_rejects_bad_grids(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["profile", "--model", "random:tiny-llama", "--out", str(tmp_path / "p.json"), "--decode-batches", "0,1"])
    assert exc.value.code == 2
    assert "--decode-batches: values must be >= 1" in capsys.readouterr().err
