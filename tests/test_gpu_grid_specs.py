"""The committed grid specs parse, and agree with run_gpu_grid.sh on where the cluster lives."""

from pathlib import Path

import pytest

from loadgen.spec import load_spec

EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments"


@pytest.mark.parametrize("name, runs", [("gpu-grid", 36), ("gpu-grid-smoke", 2), ("gpu-grid-cpu", 4)])
def test_grid_spec(name, runs):
    spec = load_spec(EXPERIMENTS / f"{name}.yaml")
    assert spec.output_dir == f"experiments/results/{name}"
    assert spec.server.launch.vars == {"state": f"results/{name}-state",
                                       "profile": f"results/{name}-state/profile.json"}
    assert "launcher.paced router" in spec.server.launch.command and "--slow p1:d1" in spec.server.launch.command
    assert sum(len(spec.rates_for(b)) for b in spec.bandwidths) * len(spec.policies) == runs
    assert spec.slo is not None and spec.workload.ignore_eos


def test_full_grid_covers_the_issue():
    spec = load_spec(EXPERIMENTS / "gpu-grid.yaml")
    assert spec.bandwidths == (1.0, 10.0, 25.0, 100.0)
    assert spec.policies == ("round-robin", "least-loaded", "network-aware")
    assert spec.server.model == "random:llama-3.1-8b"
