"""experiments/analyze_grid.py on a small hand-made results directory."""

import csv
import json

import pytest

from experiments import analyze_grid as grid_mod

MB = 1_000_000


def _timing(p, d, done, kv, nbytes=10 * MB, queue=0.01, prefill=0.05, lag=0.01, **link):
    """`lag`: the Prefill reply's delay after the ack; `link`: kv_link, kv_link_bytes (new records)."""
    return {"placement": "disaggregated", "prefill_worker": p, "decode_worker": d, "place": 0.001,
            "reserve": 0.002, "queue": queue, "prefill": prefill, "prefill_rpc": queue + prefill + 0.09 + lag,
            "kv": kv, "kv_tail": 0.09, "kv_wire": kv - 0.01, "kv_wait": 0.01, "first_decode": 0.02,
            "kv_bytes": nbytes, "kv_done_at": done} | link


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
        # link-bound: 2 x 7.5 MB in 2 x 0.05 s = 1.2 Gbit/s: 20% above its SET rate
        ("round-robin", 1.0, 2.0): (
            [_record(0, 0.2, _timing("p0", "d0", 100.1, 0.1, kv_link=0.05, kv_link_bytes=7.5 * MB)),
             _record(1, 0.3, _timing("p0", "d0", 100.2, 0.1, kv_link=0.05, kv_link_bytes=7.5 * MB))],
            1.0),
        # two overlapping 10 MB transfers on p1->d0 over [100, 100.16]: 1.0 Gbit/s (SET 1)
        ("network-aware", 1.0, 2.0): ([_record(0, 0.2, _timing("p1", "d0", 100.1, 0.1)),
                                       _record(1, 0.2, _timing("p1", "d0", 100.16, 0.1)),
                                       _record(2, 0.1, {"placement": "local", "decode_worker": "d1"})], 3.0),
        # link-bound 6.25 MB in 0.05 s: 1.0 Gbit/s, its SET rate
        ("least-loaded", 1.0, 2.0): ([_record(0, 0.2, _timing("p0", "d1", 100.1, 0.08, kv_link=0.05,
                                                                kv_link_bytes=6.25 * MB))], 1.5),
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
    assert float(links[("round-robin", "p0->d0")]["link_gbps"]) == pytest.approx(1.2)
    assert float(links[("round-robin", "p0->d0")]["link_share"]) == pytest.approx(0.75)
    assert links[("round-robin", "p0->d0")]["off_by_more_than_5pct"] == "True"  # judged on the link-bound rate
    assert float(links[("least-loaded", "p0->d1")]["link_ratio"]) == pytest.approx(1.0)
    assert links[("least-loaded", "p0->d1")]["off_by_more_than_5pct"] == "False"
    assert float(links[("round-robin", "p0->d0")]["run_mean_gbps"]) == pytest.approx(160e6 / 3.0 / 1e9)
    assert float(links[("round-robin", "p0->d0")]["busy_share"]) == pytest.approx(0.2 / 3.0)
    assert float(links[("network-aware", "p1->d0")]["achieved_gbps"]) == pytest.approx(1.0)
    # records without kv_link / kv_link_bytes (before the workers reported them): not judged
    assert links[("network-aware", "p1->d0")]["link_recorded"] == "False"
    assert links[("network-aware", "p1->d0")]["off_by_more_than_5pct"] == ""
    text = md.read_text()
    # RR's KV after the first token is 0.1 of its 0.25 s TTFT: visible, so NA must reach 1.5x / 1.2x
    assert "| 1 | best | 1.00 | 1.50 | 3.00 | 3.00 | 2.00 | 40% | NA >= 1.5x RR and >= 1.2x LL | yes |" in text
    assert best["target_met"] == "True"
    assert ("Target (link-bound within 5% of SET): 1 of 2 judged (run, pair) entries within, 1 more than 5% off; "
            "1 not recorded. Busy-interval above SET by more than 5%: 0 of 3.") in text
    assert "| 1 | network-aware | 2 | p1->d0 | 1 | not recorded | - | - | 1 | 1.00 | 10 |" in text
    assert "| 1 | round-robin | 2 | p0->d0 | 1 | 1.2 | 1.200 | 75% | 0.8 | 0.80 | 10 |" in text


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


def test_busy_interval_takes_the_reply_lag_off_the_done_stamp():
    """Two back-to-back 10 MB transfers on a 1 Gbit/s link, truly over [100, 100.08] and
    [100.08, 100.16], B enqueued at 100.04; A's Prefill reply came 50 ms after its ack (as it did
    when the sender recorded its sends late). Stamped at the reply, the union is 0.12 s: 1.33x the
    SET rate; from the ack (kv_done_at - reply lag) it is 0.16 s, the SET rate."""
    a = _timing("p0", "d0", 100.13, 0.08, lag=0.05)
    b = _timing("p0", "d0", 100.16, 0.12, lag=0.0)
    records = [_record(0, 0.2, a), _record(1, 0.2, b)]
    assert grid_mod.reply_lag(a) == pytest.approx(0.05)
    out = grid_mod.achieved_rates(records)["p0->d0"]
    assert out["busy_s"] == pytest.approx(0.16)
    assert out["achieved_gbps"] == pytest.approx(1.0)
    assert out["reply_lag_mean"] == pytest.approx(0.025)
    assert out["link_recorded"] is False and out["link_gbps"] is None
    old = [_record(0, 0.2, {k: v for k, v in a.items() if k != "prefill_rpc"}),
           _record(1, 0.2, {k: v for k, v in b.items() if k != "prefill_rpc"})]
    assert grid_mod.achieved_rates(old)["p0->d0"]["achieved_gbps"] == pytest.approx(20 * MB * 8 / 0.12 / 1e9)
