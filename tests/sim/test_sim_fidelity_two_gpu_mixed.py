"""The two-H200 fidelity script's `chained-mixed` model: the mixed profile it reads, and the
workers' profile it builds (profile.json plus that file's mixed table; the router's unchanged)."""

from __future__ import annotations

import dataclasses

import pytest

from experiments import sim_fidelity_two_gpu as fid
from pdserve.router.placement.profiles import load_profile, save_profile


def _mixed(profile):
    return dataclasses.replace(profile, model="other run", mixed_context=2048, mixed_batch_sizes=(1, 16),
                               mixed_chunk_tokens=(64, 512), mixed_times=((0.02, 0.04), (0.025, 0.045)))


def test_an_absent_file_skips_the_model_with_a_note(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(fid.MIXED_PROFILE_ENV, raising=False)
    assert fid.load_mixed_profile(tmp_path / "none.json") is None
    assert "model `chained-mixed` skipped" in capsys.readouterr().err


def test_a_file_without_a_mixed_table_is_refused(tmp_path):
    path = tmp_path / "p.json"
    save_profile(load_profile(str(fid.PROFILE)), str(path))
    with pytest.raises(ValueError, match="no mixed table"):
        fid.load_mixed_profile(path)


def test_the_env_names_the_file_and_the_workers_take_only_its_mixed_table(tmp_path, monkeypatch):
    base = load_profile(str(fid.PROFILE))
    path = tmp_path / "mixed.json"
    save_profile(_mixed(base), str(path))
    monkeypatch.setenv(fid.MIXED_PROFILE_ENV, str(path))
    mixed = fid.load_mixed_profile(None)
    assert mixed is not None and mixed.mixed_context == 2048
    cfg, policy = fid.cluster("hybrid-tight", fid.kv_link(), mixed=mixed)
    assert cfg.profile.has_mixed and cfg.profile.mixed_times == mixed.mixed_times
    # everything else is profile.json's, and the router prices with profile.json as measured
    assert dataclasses.replace(cfg.profile, mixed_context=None, mixed_batch_sizes=(), mixed_chunk_tokens=(),
                               mixed_times=()) == base
    assert not cfg.router.policy_options["network-aware"]["profile"].has_mixed
    plain, _ = fid.cluster("colocated", fid.kv_link())
    assert plain.profile == base
