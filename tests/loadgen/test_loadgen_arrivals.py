import json

import numpy as np
import pytest

from pdserve.loadgen.arrivals import arrival_offsets, constant_offsets, gamma_offsets, load_trace, poisson_offsets
from pdserve.loadgen.errors import TraceFormatError


def test_seeded_reproducibility():
    assert np.array_equal(poisson_offsets(5, 100, seed=3), poisson_offsets(5, 100, seed=3))
    assert not np.array_equal(poisson_offsets(5, 100, seed=3), poisson_offsets(5, 100, seed=4))
    assert np.array_equal(gamma_offsets(5, 100, 0.5, seed=1), gamma_offsets(5, 100, 0.5, seed=1))


@pytest.mark.parametrize("kind,burstiness", [("poisson", 1.0), ("gamma", 0.5), ("gamma", 4.0)])
def test_mean_rate(kind, burstiness):
    offsets = arrival_offsets(kind, 10.0, num_requests=20000, seed=0, burstiness=burstiness)
    assert np.all(np.diff(offsets) >= 0)
    gaps = np.diff(np.concatenate([[0.0], offsets]))
    assert 1 / gaps.mean() == pytest.approx(10.0, rel=0.05)
    cv = gaps.std() / gaps.mean()
    assert cv == pytest.approx(1 / np.sqrt(burstiness), rel=0.1)


def test_gamma_with_burstiness_one_matches_poisson_statistics():
    gaps = np.diff(gamma_offsets(4.0, 20000, 1.0, seed=2))
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)


def test_constant_and_duration_bound():
    assert constant_offsets(4, 4) == pytest.approx([0.25, 0.5, 0.75, 1.0])
    offsets = arrival_offsets("poisson", 50, duration_s=10, seed=0)
    assert offsets.max() < 10 and 400 < len(offsets) < 600
    assert len(arrival_offsets("poisson", 50, duration_s=10, num_requests=30, seed=0)) == 30
    assert np.all(arrival_offsets("poisson", float("inf"), num_requests=5) == 0)


def test_bad_arguments():
    with pytest.raises(ValueError, match="rate"):
        arrival_offsets("poisson", 0, num_requests=1)
    with pytest.raises(ValueError, match="arrival kind"):
        arrival_offsets("weibull", 1, num_requests=1)


def test_azure_trace(tmp_path):
    p = tmp_path / "azure.csv"
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                 "2023-11-16 18:15:47.0000000,100,10\n"
                 "2023-11-16 18:15:46.5000000,200,0\n"
                 "2023-11-16 18:15:49.2500000,300,30\n")
    t = load_trace(p)
    assert t.format == "azure"
    assert t.offsets_s == pytest.approx([0.0, 0.5, 2.75])
    assert t.input_tokens == [200, 100, 300]
    assert t.output_tokens == [1, 10, 30]  # clipped to >= 1
    assert t.scaled(speedup=2).offsets_s == pytest.approx([0.0, 0.25, 1.375])
    assert t.scaled(rate=4).native_rate == pytest.approx(4)


def test_mooncake_trace(tmp_path):
    p = tmp_path / "mooncake.jsonl"
    rows = [{"timestamp": 0, "input_length": 1024, "output_length": 5, "hash_ids": [1, 2]},
            {"timestamp": 1500, "input_length": 600, "output_length": 7, "hash_ids": [1, 3]}]
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    t = load_trace(p)
    assert t.format == "mooncake"
    assert t.offsets_s == [0.0, 1.5]
    assert t.hash_ids == [[1, 2], [1, 3]]
    assert t.output_tokens == [5, 7]


def test_burstgpt_trace_skips_failed(tmp_path):
    p = tmp_path / "burst.csv"
    p.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                 "5,ChatGPT,472,18,490,Conversation log\n"
                 "10,GPT-4,1087,0,1087,Conversation log\n"
                 "7.5,ChatGPT,100,50,150,API log\n")
    t = load_trace(p)
    assert t.format == "burstgpt"
    assert t.offsets_s == [0.0, 2.5]
    assert t.input_tokens == [472, 100] and t.output_tokens == [18, 50]
    assert t.skipped_rows == 1 and t.models == ["ChatGPT", "ChatGPT"]
    assert len(load_trace(p, skip_failed=False)) == 3
    assert len(load_trace(p, max_requests=1)) == 1


@pytest.mark.parametrize("name,text,fmt,line,field", [
    ("a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,10,1\n2023-11-16 18:15:47,abc,1\n",
     None, 3, "ContextTokens"),
    ("b.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,10,1\n", None, 2, "TIMESTAMP"),
    ("c.csv", "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n1,m,5,-2,3,x\n",
     None, 2, "Response tokens"),
    ("d.csv", "TIMESTAMP,ContextTokens\n1,2\n", "azure", 1, "GeneratedTokens"),
    ("e.jsonl", '{"timestamp": 0, "input_length": 1, "output_length": 1}\n{"timestamp": 5, "input_length": 3}\n',
     None, 2, "output_length"),
    ("f.jsonl", '{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": "x"}\n', None, 1, "hash_ids"),
])
def test_malformed_trace_names_file_line_field(tmp_path, name, text, fmt, line, field):
    p = tmp_path / name
    p.write_text(text)
    with pytest.raises(TraceFormatError) as info:
        load_trace(p, fmt)
    err = info.value
    assert (err.path, err.line, err.field) == (str(p), line, field)
    assert str(err).startswith(f"{p}:{line}: field '{field}'")


def test_bad_json_line_and_unknown_header(tmp_path):
    p = tmp_path / "g.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 1, "output_length": 1}\n{oops\n')
    with pytest.raises(TraceFormatError, match=r"g.jsonl:2: invalid JSON"):
        load_trace(p)
    q = tmp_path / "h.csv"
    q.write_text("when,what\n1,2\n")
    with pytest.raises(TraceFormatError, match=r"h.csv:1: cannot tell"):
        load_trace(q)
