"""experiments/kv_precision_sweep.py's table: a row per cell and the full/auto ratios per link
(the sweep itself starts a cluster: run it by hand, `--quick`)."""

from __future__ import annotations

import importlib


def _sweep():
    return importlib.import_module("experiments.kv_precision_sweep")


def _cell(gbps, precision, ttft, tail, kv, met, goodput, chosen):
    return {"gbps": gbps, "precision": precision, "requests": 4, "ok": 4, "ttft_p50_s": ttft, "kv_tail_p50_s": tail,
            "kv_p50_s": kv, "slo_met": met, "goodput_rps": goodput, "chosen": chosen, "wire_mb_per_request": 47.2}


def test_table_rows_and_ratios():
    sweep = _sweep()
    cells = [_cell(1.0, "full", 2.0, 0.8, 1.2, 1, 0.1, {"full": 4}),
             _cell(1.0, "auto", 1.0, 0.4, 0.6, 3, 0.3, {"fp8": 4}),
             _cell(sweep.HOST_GBPS, "full", 0.9, None, 0.1, 4, 0.4, {"full": 4}),
             _cell(sweep.HOST_GBPS, "auto", 0.9, None, 0.1, 4, 0.4, {"full": 3, "local": 1})]
    text = sweep.table(cells, 1.0)
    assert "| 1 Gbit/s | auto | 1.000 | 0.400 | 0.600 | 0.300 (3/4) | fp8 4 | 47.2 |" in text
    assert "| 1 Gbit/s | 2.00x | 2.00x | 2.00x | 3.00x |" in text
    assert "| host | 1.00x | - | 1.00x | 1.00x |" in text
    assert "full 3, local 1" in text
