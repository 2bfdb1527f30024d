"""Profiles that stay true: the engine's step version and the hardware, warned about or refused."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from pdserve.step_version import ENGINE_STEP_VERSIONS, engine_step_version
from pdserve.router.placement.profiles import Profile, load_profile, save_profile
from pdserve.sim.cli import main
from pdserve.sim.profile_check import StaleProfile, check_profiles, profile_problems, same_hardware

ROOT = Path(__file__).resolve().parents[2]


def _profile(**kw) -> Profile:
    base = dict(hardware="AMD EPYC (1 threads)", device="cpu", model="smollm2", dtype="float32", num_layers=30,
                kv_bytes_per_token=46080, block_size=16, max_num_batched_tokens=512,
                prefill_tokens=(128, 512), prefill_times=(0.3, 1.6), decode_batch_sizes=(1, 4),
                decode_contexts=(512,), decode_times=((0.03,), (0.06,)),
                engine_step_version=ENGINE_STEP_VERSIONS["cpu"], engine_release="0.1.0")
    return Profile(**(base | kw))


def test_a_current_profile_on_its_hardware_has_no_problem():
    assert profile_problems(_profile(), hardware="AMD EPYC (1 threads)") == []
    assert profile_problems(_profile(), hardware="amd  epyc") == []  # no thread count named: not compared


def test_an_older_or_unstamped_profile_is_named_with_the_command_that_measures_a_new_one():
    old = profile_problems(_profile(engine_step_version=1), path="p.json", hardware="AMD EPYC")
    assert len(old) == 1
    assert old[0].startswith(f"p.json: measured by engine step version 1, older than this engine's "
                             f"{ENGINE_STEP_VERSIONS['cpu']} on cpu")
    assert old[0].endswith("measure a new one: OMP_NUM_THREADS=1 pdserve profile --model smollm2 --dtype float32 "
                           "--device cpu --max-num-batched-tokens 512 --block-size 16 --out NEW-PROFILE.json")
    unstamped = profile_problems(_profile(engine_step_version=None), hardware="AMD EPYC")
    assert "measured by an engine without a step version" in unstamped[0]


def test_other_hardware_is_named():
    (line,) = profile_problems(_profile(), hardware="Intel(R) Xeon(R) Processor")
    assert "measured on 'AMD EPYC (1 threads)', the target hardware is 'Intel(R) Xeon(R) Processor'" in line
    assert not same_hardware("AMD EPYC (1 threads)", "AMD EPYC (2 threads)")
    assert same_hardware("NVIDIA H200", "nvidia h200")


def test_versions_are_per_device():
    gpu = _profile(device="cuda", hardware="NVIDIA H200", engine_step_version=ENGINE_STEP_VERSIONS["cuda"] - 1)
    assert len(profile_problems(gpu, hardware="NVIDIA H200")) == 1
    assert engine_step_version("cuda") == ENGINE_STEP_VERSIONS["cuda"]


def test_strict_refuses():
    pairs = [("p.json", _profile(engine_step_version=1))]
    assert len(check_profiles(pairs, hardware="AMD EPYC")) == 1
    with pytest.raises(StaleProfile, match="^--strict-profile: p.json: measured by engine step version 1"):
        check_profiles(pairs, hardware="AMD EPYC", strict=True)


def test_the_stamp_round_trips_and_is_checked(tmp_path):
    path = tmp_path / "p.json"
    save_profile(_profile(), str(path))
    data = json.loads(path.read_text())
    assert data["engine"] == {"step_version": ENGINE_STEP_VERSIONS["cpu"], "release": "0.1.0"}
    assert load_profile(str(path)) == _profile()
    data["engine"]["step_version"] = 0
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="engine.step_version must be a positive integer"):
        load_profile(str(path))
    data["engine"] = {"step_version": 2, "extra": 1}
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="engine.extra: unknown key"):
        load_profile(str(path))


def test_the_shipped_cluster_file_uses_a_current_profile():
    from pdserve.sim.config import load_cluster
    from pdserve.sim.profile_check import cluster_profiles

    cluster = load_cluster(ROOT / "experiments" / "sim" / "headline-cluster.yaml")
    assert cluster.hardware == "AMD EPYC (1 threads)"
    assert check_profiles(cluster_profiles(cluster), hardware=cluster.hardware) == []
    old = load_profile(str(ROOT / "experiments" / "profile-smollm2-cpu-1thread.json"))
    assert old.engine_step_version == 1 and profile_problems(old, hardware=old.hardware)


def test_pdserve_sim_warns_and_refuses_with_strict_profile(tmp_path, capsys):
    save_profile(_profile(engine_step_version=1), str(tmp_path / "old.json"))
    (tmp_path / "cluster.yaml").write_text("profile: old.json\nhardware: AMD EPYC\ncluster: 1P1D\n")
    spec = ROOT / "experiments" / "headline.yaml"
    assert main(["experiment", str(spec), "--cluster", str(tmp_path / "cluster.yaml"), "--dry-run"]) == 0
    err = capsys.readouterr().err
    assert err.startswith("pdserve-sim: warning: ") and "old.json: measured by engine step version 1" in err
    assert main(["experiment", str(spec), "--cluster", str(tmp_path / "cluster.yaml"), "--dry-run",
                 "--strict-profile"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("pdserve-sim: error: --strict-profile: ") and "pdserve profile --model smollm2" in err
    assert "\n" not in err
    # --hardware overrides the cluster file's
    assert main(["experiment", str(spec), "--cluster", str(tmp_path / "cluster.yaml"), "--dry-run",
                 "--hardware", "NVIDIA H200"]) == 0
    assert "the target hardware is 'NVIDIA H200'" in capsys.readouterr().err


def test_a_bad_hardware_key_is_named(tmp_path):
    from pdserve.sim.config import load_cluster

    save_profile(replace(_profile()), str(tmp_path / "p.json"))
    (tmp_path / "c.yaml").write_text("profile: p.json\nhardware: [a, b]\n")
    with pytest.raises(ValueError, match="c.yaml:2: field 'hardware': expected a string"):
        load_cluster(tmp_path / "c.yaml")
