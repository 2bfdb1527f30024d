"""grid.rate as a mapping of link rate -> rates: each bandwidth gets its own rates."""

import csv

import pytest

from pdserve.loadgen import experiment
from pdserve.loadgen.errors import SpecError
from pdserve.loadgen.spec import load_spec
from tests.loadgen.test_loadgen_experiment import launch_spec, pids_gone


def test_rates_per_bandwidth_run_only_their_rates(tmp_path):
    spec = load_spec(launch_spec(tmp_path, rates="{1: [20], 10: [30, 40]}"))
    assert spec.rates == (20.0, 30.0, 40.0)
    assert spec.rates_for(1.0) == (20.0,) and spec.rates_for(10.0) == (30.0, 40.0)
    result = experiment.run_experiment(spec, progress=False)
    assert [(r["policy"], r["bandwidth_gbps"], r["rate"]) for r in result.rows] == [
        ("round-robin", 1.0, 20.0), ("network-aware", 1.0, 20.0),   # every policy at a bandwidth,
        ("round-robin", 10.0, 30.0), ("round-robin", 10.0, 40.0),   # then the next bandwidth
        ("network-aware", 10.0, 30.0), ("network-aware", 10.0, 40.0)]
    with open(tmp_path / "out" / "summary.csv") as f:
        assert len(list(csv.DictReader(f))) == 6
    assert pids_gone(tmp_path)[1] == []


def test_plain_rate_list_applies_to_every_bandwidth(tmp_path):
    spec = load_spec(launch_spec(tmp_path, rates="[20, 40]"))
    assert spec.rates_for(1.0) == spec.rates_for(10.0) == (20.0, 40.0)


@pytest.mark.parametrize("rates, message", [
    ("{1: [20]}", "missing 10"),
    ("{1: [20], 10: [30], 25: [5]}", "not in grid.bandwidth_gbps: 25"),
    ("{1: [20], fast: [30]}", "keys are link rates"),
    ("{1: [20], 10: [-1]}", "must be > 0"),
    ("{}", "non-empty"),
])
def test_bad_rate_mappings_name_the_field(tmp_path, rates, message):
    with pytest.raises(SpecError, match=message) as info:
        load_spec(launch_spec(tmp_path, rates=rates))
    assert info.value.field.startswith("grid.rate")


def test_rates_per_bandwidth_need_a_bandwidth_axis(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text("server: {url: 'http://x:1'}\ngrid:\n  rate: {1: [2]}\nworkload: {num_requests: 1}\n")
    with pytest.raises(SpecError, match="need grid.bandwidth_gbps"):
        load_spec(p)
