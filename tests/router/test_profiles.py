"""Profiles: interpolation over the measured points, and files that fail loudly."""

from __future__ import annotations

import json

import pytest

from pdserve.router.placement.profiles import Profile, load_profile, save_profile
from tests.router.network_fixtures import PROFILE


def test_prefill_interpolates_and_extends():
    p = Profile.from_dict({**PROFILE.to_dict(), "prefill": {"tokens": [16, 64, 256], "seconds": [0.01, 0.02, 0.05]}})
    assert p.prefill_seconds(0) == 0.0
    assert p.prefill_seconds(8) == 0.01  # below the first point: its value
    assert p.prefill_seconds(40) == pytest.approx(0.015)
    assert p.prefill_seconds(256) == pytest.approx(0.05)
    assert p.prefill_seconds(512) == pytest.approx(0.05 + 256 * 0.03 / 192)  # the last slope


def test_decode_is_bilinear():
    assert PROFILE.decode_step_seconds(0, 100) == 0.0
    assert PROFILE.decode_step_seconds(1, 100) == pytest.approx(0.01)
    assert PROFILE.decode_step_seconds(64, 4000) == pytest.approx(0.05)
    assert PROFILE.decode_step_seconds(32, 4000) == pytest.approx(0.01 + 31 * 0.04 / 63)
    grid = Profile.from_dict({**PROFILE.to_dict(), "decode": {"batch_sizes": [1, 3], "contexts": [100, 300],
                                                              "seconds": [[1.0, 2.0], [3.0, 4.0]]}})
    assert grid.decode_step_seconds(2, 200) == pytest.approx(2.5)


def test_round_trip(tmp_path):
    path = tmp_path / "p.json"
    save_profile(PROFILE, str(path))
    assert load_profile(str(path)) == PROFILE


@pytest.mark.parametrize("change, match", [
    ({"colour": 1}, r"colour: unknown key"),
    ({"version": 2}, r"version: this pdserve reads version 1, got 2"),
    ({"num_layers": 0}, r"num_layers must be a positive integer"),
    ({"prefill": {"tokens": [16, 16], "seconds": [1, 2]}}, r"prefill.tokens must be strictly increasing"),
    ({"prefill": {"tokens": [16, 32], "seconds": [1]}}, r"prefill.seconds must have 2 values"),
    ({"prefill": {"tokens": [16], "seconds": [-1]}}, r"prefill.seconds must hold numbers > 0"),
    ({"decode": {"batch_sizes": [1], "contexts": [1], "seconds": [[1], [2]]}}, r"decode.seconds must have one row"),
    ({"hardware": {"device": "cpu"}}, r"hardware.name: missing"),
])
def test_malformed_profiles_name_the_file_and_field(tmp_path, change, match):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({**PROFILE.to_dict(), **change}))
    with pytest.raises(ValueError, match=rf"bad.json: {match}"):
        load_profile(str(path))


def test_missing_or_invalid_file(tmp_path):
    with pytest.raises(ValueError, match=r"nope.json: cannot read the profile"):
        load_profile(str(tmp_path / "nope.json"))
    path = tmp_path / "broken.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match=r"broken.json: not valid JSON \(line 1"):
        load_profile(str(path))
    path.write_text("[]")
    with pytest.raises(ValueError, match=r"broken.json: the profile must be a JSON object"):
        load_profile(str(path))
