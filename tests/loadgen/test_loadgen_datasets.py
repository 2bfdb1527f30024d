import json

import numpy as np
import pytest

from pdserve.loadgen.arrivals import Trace
from pdserve.loadgen.datasets import DatasetConfig, LengthDist, build_requests, requests_from_trace
from pdserve.loadgen.errors import DatasetError


def test_length_dists_are_clipped_and_seeded():
    rng = lambda: np.random.default_rng(0)  # noqa: E731
    assert list(LengthDist.parse("fixed:7").sample(3, rng())) == [7, 7, 7]
    u = LengthDist.parse("uniform:5:9").sample(1000, rng())
    assert u.min() == 5 and u.max() == 9
    n = LengthDist.parse("normal:10:50:40").sample(1000, rng())
    assert n.min() >= 1 and n.max() <= 40
    ln = LengthDist.parse("lognormal:200:0.5").sample(20000, rng())
    assert ln.mean() == pytest.approx(200, rel=0.05)
    assert np.array_equal(ln, LengthDist.parse("lognormal:200:0.5").sample(20000, rng()))
    assert LengthDist.parse("64") == LengthDist("fixed", value=64)
    with pytest.raises(ValueError, match="bad length distribution"):
        LengthDist.parse("zipf:3")


def test_synthetic_prompts_approximate_length_and_reproduce():
    cfg = DatasetConfig(input=LengthDist("fixed", value=130), output=LengthDist("fixed", value=20))
    a = build_requests(cfg, 5, seed=1)
    assert a == build_requests(cfg, 5, seed=1)
    assert a != build_requests(cfg, 5, seed=2)
    assert all(r.max_tokens == 20 and r.prompt_tokens_est == 130 for r in a)
    assert all(len(r.prompt.split()) == 100 for r in a)  # 130 tokens / 1.3 tokens per word


def test_shared_prefix_groups():
    cfg = DatasetConfig(kind="shared-prefix", num_groups=3, prefix_tokens=65, input=LengthDist("fixed", value=13))
    reqs = build_requests(cfg, 30, seed=0)
    by_group = {}
    for r in reqs:
        by_group.setdefault(r.group, []).append(r.prompt.split())
    assert set(by_group) <= {0, 1, 2} and len(by_group) >= 2
    for prompts in by_group.values():
        assert all(p[:50] == prompts[0][:50] for p in prompts)      # common 50-word prefix
    prefixes = {tuple(p[0][:50]) for p in by_group.values()}
    assert len(prefixes) == len(by_group)                            # distinct across groups
    assert len({tuple(r.prompt.split()) for r in reqs}) == 30         # unique suffixes


def test_sharegpt(tmp_path):
    p = tmp_path / "sg.json"
    p.write_text(json.dumps([
        {"id": "a", "conversations": [{"from": "human", "value": "one two three"},
                                      {"from": "gpt", "value": " ".join(["w"] * 10)}]},
        {"id": "b", "conversations": [{"from": "gpt", "value": "no human first"}]},
        {"id": "c", "conversations": [{"from": "system", "value": "sys"}, {"from": "human", "value": "hi"},
                                      {"from": "gpt", "value": "hello there"}, {"from": "human", "value": "x"}]},
    ]))
    reqs = build_requests(DatasetConfig(kind="sharegpt", path=str(p)), 4, seed=0)
    prompts = sorted({r.prompt for r in reqs})
    assert prompts == ["hi", "one two three"]
    by_prompt = {r.prompt: r for r in reqs}
    assert by_prompt["one two three"].max_tokens == 13  # ceil(10 words * 1.3)
    assert by_prompt["hi"].max_tokens == 3


def test_sharegpt_errors(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('[\n {"conversations": [}\n]')
    with pytest.raises(DatasetError, match=r"bad.json:2: invalid JSON"):
        build_requests(DatasetConfig(kind="sharegpt", path=str(bad)), 1)
    shape = tmp_path / "shape.json"
    shape.write_text(json.dumps([{"conversations": [{"from": "human", "value": 3}]}]))
    with pytest.raises(DatasetError, match=r"field '\[0\].conversations\[0\]'"):
        build_requests(DatasetConfig(kind="sharegpt", path=str(shape)), 1)


def test_trace_requests_share_blocks_by_hash_id():
    trace = Trace("t", "mooncake", [0.0, 1.0], [1024, 600], [5, 7], hash_ids=[[1, 2], [1, 3]])
    a, b = requests_from_trace(trace, seed=0, block_tokens=512)
    block_words = round(512 / 1.3)
    assert a.prompt.split()[:block_words] == b.prompt.split()[:block_words]
    assert a.prompt.split()[block_words:] != b.prompt.split()[block_words:]
    assert (a.max_tokens, b.max_tokens) == (5, 7)
