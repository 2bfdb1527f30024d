"""`pdserve plan` (pdserve/sim/plan.py, pdserve/sim/plan_cli.py): the candidates, the choice on small simulated
cases, and the command's errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.launcher.cli import main as pdserve_main
from pdserve.step_version import ENGINE_STEP_VERSIONS
from pdserve.router.placement.profiles import Profile, save_profile
from pdserve.sim.config import ClusterConfig, EngineLimits, WorkerConfig
from pdserve.sim.plan import Candidate, PlanOptions, SLOs, Workload, enumerate_candidates, plan
from pdserve.sim.run import Arrival

ROOT = Path(__file__).resolve().parents[2]


def _profile(prefill=(0.02, 0.04, 0.16), decode=(0.01, 0.02, 0.08)) -> Profile:
    """Prefill of 16/64/256 tokens; decode steps at batch 1/4/16 (the same at every context)."""
    return Profile(hardware="test cpu", device="cpu", model="test", dtype="float32", num_layers=4,
                   kv_bytes_per_token=64, block_size=16, max_num_batched_tokens=256,
                   prefill_tokens=(16, 64, 256), prefill_times=prefill, decode_batch_sizes=(1, 4, 16),
                   decode_contexts=(64, 4096), decode_times=tuple((d, d) for d in decode),
                   engine_step_version=ENGINE_STEP_VERSIONS["cpu"])


def _base(profile: Profile | None = None) -> ClusterConfig:
    return ClusterConfig(profile=profile or _profile(), workers=(WorkerConfig("w", "mixed"),),
                         engine=EngineLimits(num_blocks=4096, block_size=16, max_num_batched_tokens=256,
                                             max_num_seqs=16))


def _workload(prompt: int, output: int, n: int = 200) -> Workload:
    return Workload(tuple(Arrival(i * 0.1, prompt, output, prompt) for i in range(n)))


FAST = dict(requests_per_gpu=40, min_requests=120, max_requests=400, bisections=2)


def test_a_budget_of_two_gpus_has_three_candidates():
    assert enumerate_candidates(2) == [Candidate("disaggregated", 1, 1), Candidate("colocated", mixed=2),
                                       Candidate("hybrid", mixed=2)]
    assert enumerate_candidates(1) == [Candidate("colocated", mixed=1)]
    assert [c.label for c in enumerate_candidates(4)] == ["1P3D", "2P2D", "3P1D", "4 colocated", "4 hybrid"]


def test_a_large_budget_steps_the_splits_and_keeps_1_to_1():
    splits = [c for c in enumerate_candidates(1000) if c.mode == "disaggregated"]
    assert splits[0].label == "1P999D" and splits[-1].label == "999P1D"
    assert Candidate("disaggregated", 500, 500) in splits
    assert len(splits) == 65  # 1, 17, ..., 993 by 16, then 999 and 500
    assert all(c.gpus == 1000 for c in splits)


def test_a_large_candidate_is_simulated_as_a_slice_in_the_same_ratio():
    assert Candidate("disaggregated", 750, 250).slice(64) == Candidate("disaggregated", 48, 16)
    assert Candidate("disaggregated", 999, 1).slice(64) == Candidate("disaggregated", 63, 1)
    assert Candidate("disaggregated", 1, 999).slice(64) == Candidate("disaggregated", 1, 63)
    assert Candidate("hybrid", mixed=64).slice(16) == Candidate("hybrid", mixed=16)
    assert Candidate("disaggregated", 3, 5).slice(64) == Candidate("disaggregated", 3, 5)


def test_workers_take_the_topology_nodes_in_turn():
    workers = Candidate("disaggregated", 2, 1).workers(("a", "b"))
    assert [(w.worker_id, w.role, w.node) for w in workers] == [
        ("prefill-0", "prefill", "a"), ("prefill-1", "prefill", "b"), ("decode-0", "decode", "a")]


def _splits_only(**kw) -> PlanOptions:
    return PlanOptions(modes=("disaggregated",), simulate_top=3, **(FAST | kw))


def test_a_decode_bound_workload_gets_more_decode_workers():
    # 16-token prompts (0.02 s to prefill), 200 tokens out at a step that grows with the batch
    result = plan(_base(), _workload(16, 200), SLOs(ttft_s=1.0, tpot_s=0.05), 4, options=_splits_only())
    best = result.best.candidate
    assert best.decode > best.prefill, [e.to_dict() for e in result.evaluations]
    assert result.best.goodput_per_gpu > 0


def test_a_prefill_bound_workload_gets_more_prefill_workers():
    # 256-token prompts (0.16 s each), 2 tokens out
    result = plan(_base(), _workload(256, 2), SLOs(ttft_s=0.5, tpot_s=0.5), 4, options=_splits_only())
    best = result.best.candidate
    assert best.prefill > best.decode, [e.to_dict() for e in result.evaluations]
    one_to_one = result.find("2P2D")
    assert one_to_one.simulated and result.best.goodput_per_gpu > one_to_one.goodput_per_gpu
    assert "lower goodput per GPU" in one_to_one.reason


def test_a_tight_tpot_slo_prefers_disaggregated():
    # long prompts whose prefill chunks share a colocated worker's decode steps: a 0.16 s chunk
    # in a step stalls every decode there, past the 0.06 s TPOT; split, decodes step at <= 0.08 s
    # only at batch 16, so they keep the SLO at a moderate rate
    profile = _profile(decode=(0.01, 0.015, 0.05))
    result = plan(_base(profile), _workload(256, 64), SLOs(ttft_s=2.0, tpot_s=0.04), 4,
                  options=PlanOptions(modes=("disaggregated", "colocated"), simulate_top=3, **FAST))
    assert result.best.candidate.mode == "disaggregated", [e.to_dict() for e in result.evaluations]
    colocated = result.find("4 colocated")
    assert colocated.simulated and colocated.goodput_per_gpu < result.best.goodput_per_gpu
    assert "TPOT" in colocated.reason or "no simulated rate" in colocated.reason


def test_every_loser_says_why():
    result = plan(_base(), _workload(64, 32), SLOs(1.0, 0.1), 4, options=PlanOptions(simulate_top=1, **FAST))
    assert result.best.reason == ""
    for e in result.evaluations[1:]:
        assert e.reason, e.candidate.label
    pruned = [e for e in result.evaluations if not e.simulated]
    assert pruned and all(e.reason.startswith("pruned: the model's estimate") for e in pruned)
    data = json.loads(json.dumps(result.to_dict()))
    assert data["best"]["config"] == result.best.candidate.label and len(data["candidates"]) == 5


# ---------------------------------------------------------------- the command


@pytest.fixture
def profile_file(tmp_path):
    path = tmp_path / "p.json"
    save_profile(_profile(), str(path))
    return path


def _plan(*argv) -> int:
    return pdserve_main(["plan", *map(str, argv)])


def test_pdserve_plan_prints_a_table_and_json(profile_file, capsys):
    args = ["--gpus", 2, "--slo-ttft", 1, "--slo-tpot", 0.1, "--profile", profile_file, "--hardware", "test cpu",
            "--rate", 5, "--input-len", "fixed:64", "--output-len", "fixed:16", "--requests-per-gpu", 60]
    assert _plan(*args) == 0
    out = capsys.readouterr().out
    assert out.startswith("plan: 2 GPUs, SLOs TTFT <= 1 s and TPOT <= 100 ms for 90% of requests")
    assert "why the others lose:" in out and "1P1D" in out
    assert _plan(*args, "--json") == 0
    data = json.loads(capsys.readouterr().out)
    assert {c["config"] for c in data["candidates"]} == {"1P1D", "2 colocated", "2 hybrid"}
    assert data["best"]["goodput_per_gpu"] > 0


def test_pdserve_plan_reads_an_azure_trace(profile_file, tmp_path, capsys):
    trace = tmp_path / "t.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" +
                     "".join(f"{i * 0.2:.1f},64,16\n" for i in range(100)))
    assert _plan("--gpus", 2, "--slo-ttft", 1, "--slo-tpot", 0.1, "--profile", profile_file, "--hardware", "test cpu",
                 "--trace", trace, "--json", "--mode", "disaggregated") == 0
    data = json.loads(capsys.readouterr().out)
    assert data["offered_rate_rps"] == pytest.approx(5.0) and data["best"]["config"] == "1P1D"


@pytest.mark.parametrize("argv, message", [
    (["--gpus", 2, "--slo-ttft", 1, "--slo-tpot", 0.1, "--rate", 1, "--input-len", "fixed:8",
      "--output-len", "fixed:8"],
     "--profile: required without --cluster"),
    (["--gpus", 2, "--slo-ttft", 1, "--slo-tpot", 0.1, "--profile", "PROFILE", "--rate", 1],
     "--input-len: required without --trace"),
    (["--gpus", 2, "--slo-ttft", 1, "--slo-tpot", 0.1, "--profile", "nope.json", "--rate", 1,
      "--input-len", "fixed:8", "--output-len", "fixed:8"], "--profile: nope.json: cannot read the profile"),
    (["--gpus", 2, "--slo-ttft", 1, "--slo-tpot", 0.1, "--profile", "PROFILE", "--trace", "missing.csv"],
     "--trace: "),
    (["--gpus", 2, "--slo-ttft", 1, "--slo-tpot", 0.1, "--cluster", "nope.yaml", "--rate", 1,
      "--input-len", "fixed:8", "--output-len", "fixed:8"], "--cluster: nope.yaml: cannot read the cluster file"),
    (["--gpus", 2, "--slo-ttft", 1, "--slo-tpot", 0.1, "--profile", "PROFILE", "--rate", 1, "--policy", "best",
      "--input-len", "fixed:8", "--output-len", "fixed:8"], "--policy: unknown policy 'best'"),
    (["--gpus", 0, "--slo-ttft", 1, "--slo-tpot", 0.1], "argument --gpus: must be >= 1, got '0'"),
    (["--gpus", 2, "--slo-ttft", -1, "--slo-tpot", 0.1], "argument --slo-ttft: must be > 0"),
    (["--gpus", 2, "--slo-ttft", 1, "--slo-tpot", 0.1, "--input-len", "wide"], "argument --input-len: bad length"),
])
def test_pdserve_plan_errors_name_the_flag_or_file(profile_file, argv, message, capsys):
    argv = [profile_file if a == "PROFILE" else a for a in argv]
    try:
        rc = _plan(*argv)
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("pdserve: error: ") and message in err, err


def test_pdserve_plan_warns_on_a_stale_profile_and_refuses_with_strict(tmp_path, capsys):
    from dataclasses import replace

    path = tmp_path / "old.json"
    save_profile(replace(_profile(), engine_step_version=1), str(path))
    args = ["--gpus", 2, "--slo-ttft", 1, "--slo-tpot", 0.1, "--profile", path, "--hardware", "test cpu",
            "--rate", 5, "--input-len", "fixed:64", "--output-len", "fixed:16", "--mode", "colocated"]
    assert _plan(*args) == 0
    err = capsys.readouterr().err
    assert "pdserve: warning: " in err and "measured by engine step version 1" in err and "pdserve profile" in err
    assert _plan(*args, "--strict-profile") == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("pdserve: error: --strict-profile: ") and "\n" not in err
