"""The GPU benchmark scripts' code paths, run on the CPU with a tiny model (smoke tests: the
figures mean nothing here; a typo must not surface first on a rented GPU)."""

from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
SMALL = ["--device", "cpu", "--requests", "4", "--input-len", "24", "--output-len", "4"]


def load(name):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(120)
def test_bench_engine_gpu_cpu_path(tmp_path):
    out = tmp_path / "r.json"
    rc = load("bench_engine_gpu").main(SMALL + ["--decode-batches", "2", "--decode-steps", "3", "--ttft-lens", "32",
                                                "--max-num-seqs", "2", "--max-num-batched-tokens", "32",
                                                "--kv-cache-dtype", "fp8", "--json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["kv_cache_dtype"] == "fp8" and r["offline_steps"] > 0 and r["decode_b2_step_ms"] > 0
    assert 0 < r["offline_roofline_fraction"] and r["warmup_s"] > 0
    assert r["decode_b2_bound_ms"] >= r["decode_b2_roofline_ms"] > 0  # the FLOPs can only add


@pytest.mark.timeout(120)
def test_profile_decode_gpu_cpu_path(tmp_path):
    out = tmp_path / "p.json"
    rc = load("profile_decode_gpu").main(["--device", "cpu", "--batches", "1", "2", "--input-len", "24", "--steps", "2",
                                          "--mixed-batches", "2", "--mixed-prompt", "80", "--mixed-budget", "32",
                                          "--json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert [row["batch"] for row in r["decode"]] == [1, 2] and r["decode"][0]["host"]  # eager batch 1: host profile
    mixed = r["mixed"][0]
    assert mixed["mixed_steps"] >= 2 and mixed["chunk_steps"] >= 2 and mixed["mixed_ms"] > 0


@pytest.mark.timeout(120)
def test_bench_kv_fp8_cpu_path(tmp_path):
    out = tmp_path / "r.json"
    assert load("bench_kv_fp8").main(SMALL + ["--decode-batch", "2", "--quick", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["runs"]["fp8"]["kv_cache_dtype"] == "float8_e4m3fn" and len(r["greedy_agreement"]) == 8
    assert r["runs"]["fp8"]["kv_bytes_per_token"] < r["runs"]["bf16"]["kv_bytes_per_token"] / 3  # vs fp32 on cpu


@pytest.mark.timeout(120)
def test_bench_engine_replay_cpu_path(tmp_path):
    out = tmp_path / "r.json"
    rc = load("bench_engine_replay").main(["--device", "cpu", "--requests", "6", "--rate", "50", "--input-len", "20",
                                           "--output-len", "4", "--max-num-batched-tokens", "32", "--runs", "1",
                                           "--json", str(out)])
    assert rc == 0
    run = json.loads(out.read_text())["runs"][0]
    assert run["completed"] == 6 and run["tpot_p50_ms"] > 0 and run["ttft_p50_ms"] > 0
    assert run["steps"] == run["decode_only_steps"] + run["prefill_steps"] and run["prefill_steps"] >= 4


@pytest.mark.timeout(120)
def test_bench_engine_replay_points_write_records_the_simulator_reads(tmp_path):
    from experiments.sim_fidelity_one_gpu import runs
    from loadgen.records import read_jsonl

    bench = load("bench_engine_replay")
    rc = bench.main(["--device", "cpu", "--requests", "5", "--point", "20:4@50", "--point", "12:6@80",
                     "--max-num-batched-tokens", "32", "--runs", "1", "--records", str(tmp_path / "single")])
    assert rc == 0
    found = runs(tmp_path)  # the fidelity script's reader: summary.csv, in the order they ran
    assert [(d, r) for d, r, _, _ in found] == [("in20-out4", 50.0), ("in12-out6", 80.0)]
    assert found[0][2] == 0.0 and found[1][2] > 0
    records = read_jsonl(found[1][3])
    assert len(records) == 5 and all(r.ok and r.completion_tokens == 6 and r.prompt_tokens == 12 for r in records)
    assert all(0 < r.ttft_s <= r.e2e_s for r in records)
    with pytest.raises(SystemExit):
        bench.main(["--device", "cpu", "--point", "20:4"])


def test_served_vs_bare_cpu_path(tmp_path):
    """The served-vs-bare benchmark end to end on the CPU: the bare engine in its own process, a real
    `pdserve up` with its defaults, two loadgen runs; the table's ratios are computed from them."""
    import json

    rc = load("served_vs_bare").main(["--device", "cpu", "--model", "random:smollm2-135m", "--requests", "2",
                                      "--rate", "4", "--input-len", "12", "--output-len", "3",
                                      "--modes", "bare,colocated", "--max-run-time", "120", "--out", str(tmp_path)])
    assert rc == 0
    results = json.loads((tmp_path / "served_vs_bare.json").read_text())
    assert set(results["runs"]) == {"bare run 1", "bare run 2", "served run 1", "served run 2"}
    assert all(run["num_errors"] == 0 for run in results["runs"].values())
    assert any("defaults for cpu" in line for line in results["chosen"])
    assert {"served_minus_bare_ttft_p50_ms", "served_over_bare_tpot_p50", "first_over_second_ttft_p50"} <= set(results["ratios"])
