"""benchmarks/bench_fused_moe.py's CPU path (the reference only, tiny shapes), run as the module
command it documents: a typo must not surface first on a rented GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_bench(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "benchmarks.bench_fused_moe", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)


@pytest.mark.timeout(300)
def test_tiny_cpu_run(tmp_path):
    out = tmp_path / "moe.json"
    proc = run_bench("--device", "cpu", "--tiny", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "reference only" in proc.stdout
    result = json.loads(out.read_text())
    assert result["copy_gb_s"] > 0 and result["dtype"] == "torch.float32"
    rows = result["rows"]
    assert [(r["model"], r["tokens"]) for r in rows] == [
        (m, t) for m in ("tiny-8x2", "tiny-16x4") for t in (1, 4, 32)]
    for r in rows:
        assert r["ref_us"] > 0 and "triton_us" not in r
        assert min(r["tokens"] * r["top_k"], r["experts"]) >= r["experts_touched"] >= r["top_k"]
        expert_bytes = 3 * r["hidden"] * r["inter"] * 4
        assert r["active_mb"] == pytest.approx(r["experts_touched"] * expert_bytes / 1e6)
        assert r["roofline_us"] == pytest.approx(r["experts_touched"] * expert_bytes / (result["copy_gb_s"] * 1e3))


def test_full_shapes_need_a_gpu():
    proc = run_bench("--device", "cpu", "--models", "mixtral-8x7b")
    assert proc.returncode != 0 and "--tiny" in proc.stderr
