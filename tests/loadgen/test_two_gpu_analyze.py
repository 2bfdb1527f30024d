"""experiments/two-gpu/analyze.py on hand-made records: both SLO sets from the same records,
the ratios, and the light-load bound."""

from __future__ import annotations

import csv
import importlib
from pathlib import Path

import pytest

from pdserve.loadgen.records import RequestRecord, write_jsonl


def _analyze():
    return importlib.import_module("experiments.two-gpu.analyze")  # `python -m experiments.two-gpu.analyze`


def _run(root: Path, config: str, rate: float, ttft: float, tpot: float, n: int = 10) -> None:
    """n requests 1 s apart, 11 output tokens each: e2e = ttft + 10 tpot."""
    records = [RequestRecord(index=i, request_id=f"{config}-{i}", scheduled_s=float(i), sent_s=float(i),
                             ttft_s=ttft, e2e_s=ttft + 10 * tpot, completion_tokens=11, prompt_tokens=2000,
                             status=200) for i in range(n)]
    (root / config / "runs").mkdir(parents=True, exist_ok=True)
    name = f"runs/{config}_w_rate{rate:g}.jsonl"
    write_jsonl(root / config / name, records)
    summary = root / config / "summary.csv"
    new = not summary.exists()
    with open(summary, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["run_id", "dataset", "rate", "records_file"])
        if new:
            writer.writeheader()
        writer.writerow({"run_id": name, "dataset": "w", "rate": rate, "records_file": name})


def test_two_gpu_analysis_by_hand(tmp_path):
    a = _analyze()
    _run(tmp_path, "pd", 2, ttft=0.2, tpot=0.008)          # meets both SLO sets
    _run(tmp_path, "colocated", 2, ttft=0.1, tpot=0.02)    # meets only the loose one
    _run(tmp_path, "hybrid-tight", 2, ttft=0.15, tpot=0.009)
    (tmp_path / "kvtransfer.txt").write_text("   2048    268.4   1908.9    16.11   100.00    139.88\n")
    rows = a.load_rows(tmp_path)
    by = {r["config"]: r for r in rows}
    duration = 9 + 0.2 + 10 * 0.008  # first send to last finish
    assert by["pd"]["goodput_tight"] == pytest.approx(10 / duration)
    assert by["colocated"]["goodput_tight"] == 0.0 and by["colocated"]["goodput_loose"] > 0
    assert a.link_gbytes(tmp_path) == 100.0
    text = a.tables(rows, a.link_gbytes(tmp_path))
    assert "| tight | 2 | inf |" in text  # PD meets the tight set, colocated does not
    # hybrid-tight against the better of the two at the tight set (PD)
    ratio = by["hybrid-tight"]["goodput_tight"] / by["pd"]["goodput_tight"]
    assert f"| tight | 2 | inf | {ratio:.2f}x |" in text
    # bound: colocated 100 ms + 2000 x 128 KiB / 100 GB/s + 5 ms = 107.6 ms < PD's 200 ms
    assert "bound 107.6 ms" in text and "**missed**" in text
