"""`pdserve-sim experiment`: a loadgen spec in, the real runner's outputs out; bad input named."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from pdserve.loadgen.records import read_jsonl
from pdserve.router.placement.profiles import Profile, save_profile
from pdserve.sim.cli import main
from pdserve.sim.config import load_cluster, scale_profile

SPEC = """
name: tiny
seed: 3
server:
  launch: {{command: "true {{policy}}"}}
grid:
  policy: [round-robin, least-loaded, network-aware]
  rate: [2.0, 4.0]
workload:
  arrival: poisson
  num_requests: 6
  max_run_time_s: 60
  dataset: {{name: fixed, kind: synthetic, input: fixed:{prompt}, output: fixed:4}}
slo: {{ttft_s: 1.0, tpot_s: 0.2}}
"""

CLUSTER = """
profile: profile.json
topology:
  workers: {p0: a, p1: b, d0: c}
  links:
    - {between: [a, c], gbps: 10}
    - {between: [b, c], gbps: 0.1}
engine: {num_blocks: 256, block_size: 16, max_num_batched_tokens: 512, max_num_seqs: 8}
workers:
  - {id: p0, role: prefill, node: a}
  - {id: p1, role: prefill, node: b}
  - {id: d0, role: decode, node: c}
router:
  policy_options:
    network-aware: {slo_ttft: 1.0}
"""


def _profile() -> Profile:
    return Profile(
        hardware="test", device="cpu", model="tiny", dtype="float32", num_layers=4, kv_bytes_per_token=10_000,
        block_size=16, max_num_batched_tokens=512, prefill_tokens=(1, 1000), prefill_times=(0.001, 0.2),
        decode_batch_sizes=(1, 8), decode_contexts=(16, 1024), decode_times=((0.01, 0.012), (0.015, 0.02)),
    )


@pytest.fixture
def files(tmp_path: Path) -> tuple[Path, Path]:
    save_profile(_profile(), str(tmp_path / "profile.json"))
    (tmp_path / "spec.yaml").write_text(SPEC.format(prompt=200))
    (tmp_path / "cluster.yaml").write_text(CLUSTER)
    return tmp_path / "spec.yaml", tmp_path / "cluster.yaml"


def test_a_spec_simulates_into_the_real_runners_outputs(files, tmp_path, capsys):
    spec, cluster = files
    out = tmp_path / "out"
    assert main(["experiment", str(spec), "--cluster", str(cluster), "--output-dir", str(out)]) == 0
    rows = list(csv.DictReader(open(out / "summary.csv")))
    assert [(r["policy"], r["rate"]) for r in rows] == [
        (p, rate) for p in ("round-robin", "least-loaded", "network-aware") for rate in ("2.0", "4.0")]
    assert {r["run_id"] for r in rows} == {f"{p}_fixed_rate{r:g}"
                                          for p in ("round-robin", "least-loaded", "network-aware")
                                          for r in (2.0, 4.0)}
    for row in rows:
        records = read_jsonl(out / row["records_file"])
        assert len(records) == 6 and all(r.ok for r in records)
        assert all(r.prompt_tokens == 200 and r.completion_tokens == 4 and len(r.token_times_s) == 4 for r in records)
        assert row["num_ok"] == "6" and float(row["goodput"]) > 0 and row["simulated"] == "True"
    # round-robin alternates p0/p1; network-aware never takes the 0.1 Gbit/s p1 -> d0 link
    placements = {r["policy"]: json.loads(r["sim_placements"]) for r in rows if r["rate"] == "2.0"}
    assert placements["round-robin"] == {"p0->d0": 3, "p1->d0": 3}
    assert "p1->d0" not in placements["network-aware"]
    report = (out / "report.md").read_text()
    assert "tiny (simulated)" in report and "**simulated**" in report
    assert json.loads((out / "environment.json").read_text())["simulated"] is True
    assert (out / "spec.yaml").exists() and (out / "cluster.yaml").exists()


def test_replaying_a_runs_records_reproduces_it(files, tmp_path):
    spec, cluster = files
    first, second = tmp_path / "first", tmp_path / "second"
    assert main(["experiment", str(spec), "--cluster", str(cluster), "--output-dir", str(first)]) == 0
    assert main(["experiment", str(spec), "--cluster", str(cluster), "--output-dir", str(second),
                 "--replay", str(first)]) == 0
    a = {r["run_id"]: r for r in csv.DictReader(open(first / "summary.csv"))}
    b = {r["run_id"]: r for r in csv.DictReader(open(second / "summary.csv"))}
    for rid in a:
        for key in ("ttft_p50", "ttft_p90", "tpot_p50", "goodput", "num_ok"):
            assert a[rid][key] == b[rid][key], (rid, key)


@pytest.mark.parametrize("text, message", [
    ("profile: profile.json\nworkerz: []\n", "field 'workerz': unknown key"),
    ("profile: missing.json\n", "missing.json: cannot read the profile"),
    ("profile: profile.json\nengine: {num_blocks: -1}\n", "field 'engine.num_blocks': must be >= 1"),
    ("profile: profile.json\nworkers: [{id: a, role: chef}]\n", "workers.a.role must be prefill, decode or mixed"),
    ("profile: profile.json\nworkers: [{id: a, role: decode, host: h}]\n", "unknown host 'h'"),
])
def test_a_bad_cluster_file_is_one_line_naming_the_key(files, tmp_path, capsys, text, message):
    spec, cluster = files
    cluster.write_text(text)
    assert main(["experiment", str(spec), "--cluster", str(cluster), "--output-dir", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("pdserve-sim: error: --cluster:") and message in err and "\n" not in err


def test_the_loadgen_experiment_flags_select_and_list_runs(files, tmp_path, capsys):
    """--policy, --dry-run and --no-progress work as in `pdserve-loadgen experiment`, with the same run ids."""
    from pdserve.loadgen.cli import main as loadgen_main

    spec, cluster = files
    out = tmp_path / "out"
    assert main(["experiment", str(spec), "--cluster", str(cluster), "--dry-run", "--output-dir", str(out)]) == 0
    listed = capsys.readouterr().out.split()
    assert loadgen_main(["experiment", str(spec), "--dry-run"]) == 0
    assert capsys.readouterr().out.split() == listed
    assert listed == [f"{p}_fixed_rate{r:g}" for p in ("round-robin", "least-loaded", "network-aware")
                      for r in (2.0, 4.0)]
    assert not out.exists()  # a dry run writes nothing
    assert main(["experiment", str(spec), "--cluster", str(cluster), "--output-dir", str(out), "--no-progress",
                 "--policy", "network-aware", "--policy", "round-robin"]) == 0
    rows = list(csv.DictReader(open(out / "summary.csv")))
    assert [r["policy"] for r in rows] == ["round-robin", "round-robin", "network-aware", "network-aware"]
    capsys.readouterr()  # the runs' warnings about the test's unstamped profile
    assert main(["experiment", str(spec), "--cluster", str(cluster), "--policy", "nope", "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("pdserve-sim: error: --policy: 'nope' is not in the spec's grid.policy") and "\n" not in err


def test_a_missing_replay_run_is_a_clear_error(files, tmp_path, capsys):
    spec, cluster = files
    assert main(["experiment", str(spec), "--cluster", str(cluster), "--output-dir", str(tmp_path / "o"),
                 "--replay", str(tmp_path / "nowhere")]) == 2
    assert "nowhere" in capsys.readouterr().err


def test_a_scaled_profile_says_so_in_its_name(files):
    _, cluster = files
    profile = load_cluster(cluster).profile
    scaled = scale_profile(profile, time_factor=2.0, kv_bytes_per_token=5, label="test")
    assert scaled.model == "tiny scaled (test)" and scaled.kv_bytes_per_token == 5
    assert scaled.prefill_seconds(1000) == pytest.approx(2 * profile.prefill_seconds(1000))
    with pytest.raises(ValueError, match="time_factor"):
        scale_profile(profile, time_factor=0)


def test_prefill_and_decode_scale_apart(files):
    _, cluster = files
    profile = load_cluster(cluster).profile
    scaled = scale_profile(profile, prefill_factor=1.5, decode_factor=0.5)
    assert scaled.model == "tiny scaled (prefill x1.5, decode x0.5)"
    assert scaled.prefill_seconds(1000) == pytest.approx(1.5 * profile.prefill_seconds(1000))
    assert scaled.decode_step_seconds(8, 1024) == pytest.approx(0.5 * profile.decode_step_seconds(8, 1024))
    with pytest.raises(ValueError, match="decode_factor"):
        scale_profile(profile, decode_factor=-1)


def test_the_cluster_file_takes_front_s(files, tmp_path):
    _, cluster = files
    text = cluster.read_text().replace("router:\n", "router:\n  front_s: 0.03\n")
    path = tmp_path / "front.yaml"
    path.write_text(text)
    assert load_cluster(path).router.front_s == 0.03
    path.write_text(text.replace("front_s: 0.03", "front_s: -1"))
    with pytest.raises(ValueError, match="router.front_s"):
        load_cluster(path)


def test_the_simulator_imports_neither_the_engine_nor_ray_nor_torch():
    import subprocess
    import sys

    code = ("import sys, pdserve.sim.cli, pdserve.sim.experiment, pdserve.sim.cluster, pdserve.sim.workload, "
            "pdserve.sim.profiles; "
            "print(sorted(m for m in ('pdserve.engine', 'pdserve.worker', 'pdserve.router.http', 'torch', 'ray') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_a_trace_spec_with_cluster_shapes(files, tmp_path):
    _, cluster = files
    (tmp_path / "trace.csv").write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                                        + "".join(f"{i * 0.5},{100 + i},{3}\n" for i in range(8)))
    (tmp_path / "trace-spec.yaml").write_text("""
server: {launch: {command: "true {policy} {prefill} {decode}"}}
grid: {cluster: [1P1D, 2P2D], policy: [least-loaded], rate: [4]}
workload: {arrival: trace, trace: {path: trace.csv, format: azure}}
""")
    out = tmp_path / "out"
    assert main(["experiment", str(tmp_path / "trace-spec.yaml"), "--cluster", str(cluster),
                 "--output-dir", str(out)]) == 0
    rows = list(csv.DictReader(open(out / "summary.csv")))
    assert [r["cluster"] for r in rows] == ["1P1D", "2P2D"]
    for row in rows:
        records = read_jsonl(out / row["records_file"])
        # the trace's 8 requests, rescaled to 4 req/s (native 2 req/s): sent every 0.25 s
        assert [r.prompt_tokens for r in records] == [100 + i for i in range(8)]
        assert [round(r.scheduled_s, 6) for r in records] == [0.25 * i for i in range(8)]
    two = json.loads(rows[1]["sim_placements"])
    assert set(two) <= {"prefill-0->decode-0", "prefill-0->decode-1", "prefill-1->decode-0", "prefill-1->decode-1"}
    assert sum(two.values()) == 8


def test_per_run_adjusts_each_runs_cluster(files, tmp_path):
    """`per_run` gets each run id and its cluster; what it returns is what that run simulates."""
    from dataclasses import replace

    from pdserve.loadgen.spec import load_spec
    from pdserve.sim.experiment import run_sim_experiment

    spec, cluster = files
    config = load_cluster(cluster)
    seen = []

    def slower(rid, c):
        seen.append(rid)
        factor = 2.0 if rid == "round-robin_fixed_rate2" else 1.0
        return replace(c, profile=scale_profile(c.profile, time_factor=factor))

    rows = {r["run_id"]: r for r in run_sim_experiment(load_spec(str(spec)), config, output_dir=tmp_path / "o",
                                                          per_run=slower)}
    assert sorted(seen) == sorted(rows)
    assert rows["round-robin_fixed_rate2"]["model"] == "tiny scaled (times x2)"
    assert rows["round-robin_fixed_rate4"]["model"] == "tiny scaled (times x1)"
    # a step is at least one request's step of the profile: twice that in the run with the profile x2,
    # and below it in the other (at most 6 requests of ~200 tokens in a batch: < 0.0207 s)
    one = _profile().decode_step_seconds(1, 200)
    assert (float(rows["round-robin_fixed_rate2"]["tpot_p50"]) >= 2 * one
            > float(rows["round-robin_fixed_rate4"]["tpot_p50"]))


def test_the_cluster_file_takes_overlap_steps(files, tmp_path):
    _, cluster = files
    assert load_cluster(cluster).engine.overlap_steps is False
    text = cluster.read_text().replace("max_num_seqs: 8}", "max_num_seqs: 8, overlap_steps: true}")
    path = tmp_path / "overlap.yaml"
    path.write_text(text)
    assert load_cluster(path).engine.overlap_steps is True
    path.write_text(text.replace("overlap_steps: true", "overlap_steps: 1"))
    with pytest.raises(ValueError, match="engine.overlap_steps"):
        load_cluster(path)
