"""The committed grid specs parse, and agree with run_gpu_grid.sh on where the cluster lives."""

from pathlib import Path

import pytest

from pdserve.loadgen.spec import load_spec

EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments"


@pytest.mark.parametrize("name, runs", [("gpu-grid", 36), ("gpu-grid-smoke", 2), ("gpu-grid-cpu", 4)])
def test_grid_spec(name, runs):
    spec = load_spec(EXPERIMENTS / f"{name}.yaml")
    assert spec.output_dir == f"results/{name}"
    assert spec.server.launch.vars == {"state": f"results/{name}-state",
                                       "profile": f"results/{name}-state/profile.json"}
    command = spec.server.launch.command
    assert "pdserve.launcher.paced router" in command and "--slow p1:d1" in command
    assert sum(len(spec.rates_for(b)) for b in spec.bandwidths) * len(spec.policies) == runs
    assert spec.slo is not None and spec.workload.ignore_eos


def test_full_grid_covers_the_issue():
    spec = load_spec(EXPERIMENTS / "gpu-grid.yaml")
    assert spec.bandwidths == (1.0, 10.0, 25.0, 100.0)
    assert spec.policies == ("round-robin", "least-loaded", "network-aware")
    assert spec.server.model == "random:llama-3.1-8b"


@pytest.mark.parametrize("name, args", [("gpu-grid", "0.1 1 2.5 10 25 100"), ("gpu-grid-smoke", "1 10"),
                                        ("gpu-grid-cpu", "0.005 0.05 0.5 --burst 64KiB")])
def test_links_step_paces_every_set_rate(name, args):
    """run_gpu_grid.sh's links step: benchmarks.bench_pacing at every SET rate of the spec (the bandwidths
    and their --slow-factor share), with the run's burst, into cluster/pacing.txt."""
    import importlib

    import yaml

    mod = importlib.import_module("experiments.grid_link_rates")
    assert " ".join(mod.link_rates(yaml.safe_load((EXPERIMENTS / f"{name}.yaml").read_text()))) == args
    script = (EXPERIMENTS / "run_gpu_grid.sh").read_text()
    assert "python3 -m benchmarks.bench_pacing" in script and 'timeout -k 10 "${LINKS_TIMEOUT_S:-90}"' in script
    assert '"$STATE/pacing.txt" "$OUT/cluster/"' in script
    # before the workers and the sweep
    assert script.index("-m benchmarks.bench_pacing") < script.index("pdserve.launcher.paced workers")
