"""experiments/analyze_grid.py on a small hand-made results directory."""

import csv
import importlib.util
import json
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "analyze_grid", Path(__file__).resolve().parents[1] / "experiments" / "analyze_grid.py")
grid_mod = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(grid_mod)

MB = 1_000_000


def _timing(p, d, done, kv, nbytes=10 * MB, queue=0.01, prefill=0.05):
    return {"placement": "disaggregated", "prefill_worker": p, "decode_worker": d, "place": 0.001,
            "reserve": 0.002, "queue": queue, "prefill": prefill, "prefill_rpc": queue + prefill + 0.1,
            "kv": kv, "kv_tail": 0.09, "kv_wire": kv - 0.01, "kv_wait": 0.01, "first_decode": 0.02,
            "kv_bytes": nbytes, "kv_done_at": done}


def _record(i, ttft, timing):
    return {"index": i, "request_id": f"r{i}", "scheduled_s": 0, "sent_s": 0, "ttft_s": ttft, "e2e_s": ttft + 0.2,
            "status": 200, "error": None, "token_times_s": [ttft], "server_timing": timing}


@pytest.fixture
def exp(tmp_path):
    (tmp_path / "runs").mkdir()
    (tmp_path / "cluster").mkdir()
    rows = []
    runs = {
        # two back-to-back 10 MB transfers on p0->d0, 0.1 s each: 160 Mbit in 0.2 s = 0.8 Gbit/s (SET 1)
        ("round-robin", 1.0, 2.0): ([_record(0, 0.2, _timing("p0", "d0", 100.1, 0.1)),
                                     _record(1, 0.3, _timing("p0", "d0", 100.2, 0.1))], 1.0),
        # two overlapping 10 MB transfers on p1->d0 over [100, 100.16]: 1.0 Gbit/s (SET 1)
        ("network-aware", 1.0, 2.0): ([_record(0, 0.2, _timing("p1", "d0", 100.1, 0.1)),
                                       _record(1, 0.2, _timing("p1", "d0", 100.16, 0.1)),
                                       _record(2, 0.1, {"placement": "local", "decode_worker": "d1"})], 3.0),
        ("least-loaded", 1.0, 2.0): ([_record(0, 0.2, _timing("p0", "d1", 100.1, 0.08))], 1.5),
    }
    for (policy, bw, rate), (records, goodput) in runs.items():
        rid = f"2P2D_{policy}_{bw:g}gbps_d_rate{rate:g}"
        with open(tmp_path / "runs" / f"{rid}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
        rows.append({"run_id": rid, "policy": policy, "bandwidth_gbps": bw, "rate": rate,
                     "records_file": f"runs/{rid}.jsonl", "num_requests": len(records), "num_ok": len(records),
                     "ttft_p50": 0.2, "ttft_p90": 0.3, "tpot_p50": 0.01, "tpot_p90": 0.02, "goodput": goodput,
                     "slo_attainment": 1.0, "start_time_unix": 99.0, "duration_s": 3.0})
    with open(tmp_path / "summary.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    with open(tmp_path / "cluster" / "links.jsonl", "w") as f:
        for policy in ("round-robin", "least-loaded", "network-aware"):
            f.write(json.dumps({"policy": policy, "bandwidth_gbps": 1,
                                "links": {"p0->d0": 1, "p0->d1": 1, "p1->d0": 1, "p1->d1": 0.1}}) + "\n")
    (tmp_path / "cluster" / "gpu_samples.csv").write_text(
        "time_unix,source,gpu,pid,worker,sm_pct,mem_pct,mem_used_mib\n"
        "100,gpu,0,,,80,,1000\n100,process,0,11,p0,60,10,\n101,process,0,11,p0,40,10,\n200,gpu,0,,,5,,1000\n")
    return tmp_path


def test_tables_ratios_links_and_gpu(exp):
    md = grid_mod.analyze(exp)
    grid = {r["policy"]: r for r in csv.DictReader(open(exp / "analysis" / "grid.csv"))}
    rr = grid["round-robin"]
    assert float(rr["ttft_kv_after_mean"]) == pytest.approx(0.1)
    assert float(rr["ttft_rest_mean"]) == pytest.approx(0.25 - 0.003 - 0.06 - 0.1)
    assert float(rr["gpu_util_p0"]) == pytest.approx(50) and float(rr["gpu_util_gpu0"]) == pytest.approx(80)
    assert grid["network-aware"]["pairs"] == "local@d1:1 p1->d0:2"
    ratios = list(csv.DictReader(open(exp / "analysis" / "ratios.csv")))
    best = next(r for r in ratios if r["rate"] == "best")
    assert float(best["na_over_rr"]) == pytest.approx(3.0) and float(best["na_over_ll"]) == pytest.approx(2.0)
    links = {(r["policy"], r["pair"]): r for r in csv.DictReader(open(exp / "analysis" / "links.csv"))}
    assert float(links[("round-robin", "p0->d0")]["achieved_gbps"]) == pytest.approx(0.8)
    assert links[("round-robin", "p0->d0")]["off_by_more_than_5pct"] == "True"
    assert float(links[("round-robin", "p0->d0")]["run_mean_gbps"]) == pytest.approx(160e6 / 3.0 / 1e9)
    assert float(links[("round-robin", "p0->d0")]["busy_share"]) == pytest.approx(0.2 / 3.0)
    assert float(links[("network-aware", "p1->d0")]["achieved_gbps"]) == pytest.approx(1.0)
    assert links[("network-aware", "p1->d0")]["off_by_more_than_5pct"] == "False"
    text = md.read_text()
    # RR's KV after the first token is 0.1 of its 0.25 s TTFT: visible, so NA must reach 1.5x / 1.2x
    assert "| 1 | best | 1.00 | 1.50 | 3.00 | 3.00 | 2.00 | 40% | NA >= 1.5x RR and >= 1.2x LL | yes |" in text
    assert best["target_met"] == "True"
    assert "1 of 3 (run, pair) entries are more than 5% off" in text


def test_missing_gpu_samples_are_missing_not_zero(exp):
    (exp / "cluster" / "gpu_samples.csv").unlink()
    grid_mod.analyze(exp)
    row = next(csv.DictReader(open(exp / "analysis" / "grid.csv")))
    assert not any(k.startswith("gpu_util") for k in row)
    assert "missing: no nvidia-smi samples" in (exp / "analysis" / "grid.md").read_text()


def test_not_a_results_dir_is_a_clear_error(tmp_path, capsys):
    assert grid_mod.main([str(tmp_path)]) == 2
    assert "summary.csv: not found" in capsys.readouterr().err
    (tmp_path / "summary.csv").write_text("run_id,rate\nx,1\n")
    with pytest.raises(grid_mod.AnalysisError, match="policy and bandwidth_gbps"):
        grid_mod.analyze(tmp_path)


def test_verdict_where_the_network_does_not_matter():
    grid = [{"policy": "round-robin", "bandwidth_gbps": 100.0, "rate": r, "ttft_kv_after_mean": 0.002,
             "ttft_mean_timed": 0.05} for r in (10.0, 20.0)]
    ok = grid_mod.verdict(grid, 100.0, {"round-robin": 10.0, "least-loaded": 10.0, "network-aware": 9.6})
    assert ok["network_visible"] is False and ok["target_met"] is True and ok["kv_share"] == pytest.approx(0.04)
    miss = grid_mod.verdict(grid, 100.0, {"round-robin": 10.0, "least-loaded": 10.0, "network-aware": 9.4})
    assert miss["target_met"] is False
    assert grid_mod.verdict([], 100.0, {"network-aware": 1.0})["target_met"] is None
