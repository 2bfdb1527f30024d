"""The GPU benchmark scripts' code paths (benchmarks/, and the served studies of experiments/), run
on the CPU with a tiny model (smoke tests: the figures mean nothing here; a typo must not surface
first on a rented GPU)."""

from __future__ import annotations

import importlib
import json

import pytest

SMALL = ["--device", "cpu", "--requests", "4", "--input-len", "24", "--output-len", "4"]


def load(name):
    """A script as the module it runs as (`python -m benchmarks.bench_engine_gpu`)."""
    room = "experiments" if name in ("served_vs_bare", "defaults_vs_flags") else "benchmarks"
    return importlib.import_module(f"{room}.{name}")


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
                                          "--prefill-lens", "40", "--json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert [row["batch"] for row in r["decode"]] == [1, 2] and r["decode"][0]["host"]  # eager batch 1: host profile
    mixed = r["mixed"][0]
    assert mixed["mixed_steps"] >= 2 and mixed["chunk_steps"] >= 2 and mixed["mixed_ms"] > 0
    prefill = r["prefill"][0]
    assert prefill["prompt"] == 40 and len(prefill["walls_ms"]) == 3 and prefill["flops_bound_ms"] > 0


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
    from pdserve.loadgen.records import read_jsonl

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


def test_served_vs_bare_cpu_path(tmp_path, capsys):
    """The served-vs-bare benchmark end to end on the CPU: the bare engine in its own process, a real
    `pdserve up` with its defaults, two loadgen runs; the table's ratios are computed from them.
    Each run's row is printed as the run ends (a call cut short keeps what it measured)."""
    import json

    rc = load("served_vs_bare").main(["--device", "cpu", "--model", "random:smollm2-135m", "--requests", "2",
                                      "--rate", "4", "--input-len", "12", "--output-len", "3",
                                      "--modes", "bare,colocated", "--max-run-time", "120", "--out", str(tmp_path)])
    assert rc == 0
    results = json.loads((tmp_path / "served_vs_bare.json").read_text())
    assert set(results["runs"]) == {"bare run 1", "bare run 2", "served run 1", "served run 2"}
    assert all(run["num_errors"] == 0 for run in results["runs"].values())
    assert any("defaults for cpu" in line for line in results["chosen"])
    assert {"served_minus_bare_ttft_p50_ms", "served_over_bare_tpot_p50",
            "first_over_second_ttft_p50"} <= set(results["ratios"])
    # the workers' steps during each served run, from the router's /metrics: every request's
    # prompt took a step that was not decode-only; no prefill graphs on the CPU
    for label in ("served run 1", "served run 2"):
        run = results["runs"][label]
        assert run["prefill_steps"] >= 1 and run["prefill_graph_steps"] == 0, run
    printed = capsys.readouterr()
    text = printed.out + printed.err
    assert text.index("served run 1: | served run 1 |") < text.index("| run | TTFT p50 ms")


@pytest.mark.slow
def test_defaults_vs_flags_cpu_path(tmp_path):
    """The defaults-vs-flags benchmark end to end on the CPU: a real `pdserve up` with its defaults and one
    with flags, one loadgen run each; the table has both, goodput is computed per SLO set from the records,
    the ratio of the defaults to the best is a number, and the data is packed after every configuration."""
    import math
    import tarfile

    out, tar = tmp_path / "out", tmp_path / "dvf.tar.gz"
    flags = "--max-num-batched-tokens 256 --max-num-seqs 8"
    rc = load("defaults_vs_flags").main(["--device", "cpu", "--model", "random:smollm2-135m", "--rates", "2",
                                         "--requests", "4", "--input-len", "16", "--output-len", "4",
                                         "--configs", flags, "--slo", "ttft=60,tpot=10", "--slo", "ttft=60,tpot=20",
                                         "--max-run-time", "120", "--out", str(out), "--tar", str(tar)])
    assert rc == 0
    results = json.loads((out / "defaults_vs_flags.json").read_text())
    assert [c["label"] for c in results["configs"]] == ["defaults", flags]
    assert "defaults for cpu" in results["configs"][0]["chosen"][0]
    assert "max_num_batched_tokens=256 max_num_seqs=8 (given)" in results["configs"][1]["chosen"][0]
    for config in results["configs"]:
        [run] = config["runs"]
        assert run["rate"] == 2 and run["errors"] == 0 and run["summary"]["num_ok"] == 4
        for slo in run["slo"].values():  # SLOs every CPU request meets: goodput = 4 requests / the run's time
            assert slo["attainment"] == 1.0
            assert math.isclose(slo["goodput"], 4 / run["summary"]["duration_s"])
    # paired: both configurations got the same seed, so the same arrival times and prompts
    assert results["configs"][0]["runs"][0]["seed"] == results["configs"][1]["runs"][0]["seed"]
    schedules = [[json.loads(line)["scheduled_s"] for line in (out / f"config{i}" / "rate2" / "records.jsonl").open()]
                 for i in (0, 1)]
    assert sorted(schedules[0]) == sorted(schedules[1])
    for name, entry in results["comparison"].items():
        assert entry["best_config"] in ("defaults", flags)
        assert isinstance(entry["defaults_over_best"], float) and 0 < entry["defaults_over_best"] <= 1.0
    table = (out / "defaults_vs_flags.md").read_text()
    assert all(f"| {label} | 2 |" in table for label in ("defaults", flags))
    with tarfile.open(tar) as packed:
        names = packed.getnames()
    assert "out/defaults_vs_flags.json" in names and "out/config1/rate2/records.jsonl" in names


def test_defaults_vs_flags_slo_parsing_and_comparison():
    """The SLO option's form and errors, and the comparison: a configuration's goodput is its best over the
    rates, the ratio is the defaults' best over the best configuration's, None where nothing met the SLO."""
    bench = load("defaults_vs_flags")
    slo = bench.parse_slo("ttft=1,tpot=0.05")
    assert (slo.ttft_s, slo.tpot_s) == (1.0, 0.05)
    bad_slos = (("ttft=1", "tpot"), ("ttft=1,tpot=x", "tpot"), ("ttft=1,itl=0.1", "itl"), ("ttft=0,tpot=1", "ttft"))
    for bad, word in bad_slos:
        with pytest.raises(ValueError, match=word):
            bench.parse_slo(bad)
    loose, tight = bench.slo_name(slo), bench.slo_name(bench.parse_slo("ttft=1,tpot=0.01"))

    def run(rate, a, b):
        return {"rate": rate, "slo": {loose: {"goodput": a}, tight: {"goodput": b}}}

    defaults_runs = [run(4, 3.0, 0.0), run(8, 6.0, 0.0), {"rate": 12, "error": "x"}]
    results = {"configs": [{"label": "defaults", "runs": defaults_runs},
                           {"label": "big", "runs": [run(4, 3.5, 0.0), run(8, 7.5, 0.0)]},
                           {"label": "off", "runs": [], "skipped": "time budget"}]}
    cmp = bench.compare(results, [slo, bench.parse_slo("ttft=1,tpot=0.01")])
    assert cmp[loose]["best_config"] == "big" and cmp[loose]["defaults_over_best"] == 6.0 / 7.5
    assert cmp[loose]["best_per_config"] == {"defaults": {"goodput": 6.0, "rate": 8},
                                            "big": {"goodput": 7.5, "rate": 8}}
    assert cmp[tight]["defaults_over_best"] is None and cmp[tight]["best_goodput"] == 0.0


@pytest.mark.timeout(120)
def test_profile_decode_gpu_prefill_only(tmp_path):
    """No decode or mixed batches (`--batches --mixed-batches` with no values): the prefills alone."""
    out = tmp_path / "p.json"
    rc = load("profile_decode_gpu").main(["--device", "cpu", "--batches", "--mixed-batches", "--prefill-lens", "40",
                                          "--json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["decode"] == [] and r["mixed"] == [] and r["prefill"][0]["prompt"] == 40
