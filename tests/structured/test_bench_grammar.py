"""benchmarks.bench_grammar's code path on a tiny model (a smoke test: the figures mean nothing here)."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_grammar


@pytest.mark.timeout(300)
def test_bench_grammar_runs_and_reports(tmp_path):
    out = tmp_path / "r.json"
    assert bench_grammar.main(["--model", "random:tiny-serve-tp", "--tokenizer", "smollm2", "--batches", "1,2",
                               "--steps", "3", "--repeats", "1", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert [row["batch"] for row in r["rows"]] == [1, 2]
    for row in r["rows"]:
        assert row["free_tpot_ms"] > 0 and row["json_tpot_ms"] > 0 and row["grammar_ms"] > 0 and row["steps"] >= 1
