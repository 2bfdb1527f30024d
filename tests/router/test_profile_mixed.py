"""The profile's optional mixed table (a decode batch plus a prefill chunk in one step): queries
checked by hand, the round trip, old files without it, and malformed tables naming the field."""

from __future__ import annotations

import dataclasses
import json

import pytest

from pdserve.router.placement.profiles import Profile, load_profile, save_profile
from tests.router.network_fixtures import PROFILE

# D(1, c) = 0.010 + 1e-5 (c - 100), D(5, c) = 0.020 + 5e-5 (c - 100) for c in [100, 300]
DECODE = {"batch_sizes": [1, 5], "contexts": [100, 300], "seconds": [[0.010, 0.012], [0.020, 0.030]]}
MIXED = {"context": 100, "batch_sizes": [1, 5], "chunk_tokens": [100, 300], "seconds": [[0.030, 0.050], [0.040, 0.070]]}


def mixed_profile(mixed=MIXED) -> Profile:
    return Profile.from_dict({**PROFILE.to_dict(), "decode": DECODE, "mixed": mixed})


def test_the_table_points_are_what_the_table_says():
    p = mixed_profile()
    assert p.has_mixed and not PROFILE.has_mixed
    assert p.mixed_step_seconds(1, 100, 100) == pytest.approx(0.030)
    assert p.mixed_step_seconds(1, 300, 100) == pytest.approx(0.050)
    assert p.mixed_step_seconds(5, 100, 100) == pytest.approx(0.040)
    assert p.mixed_step_seconds(5, 300, 100) == pytest.approx(0.070)


def test_interpolation_along_chunk_and_batch():
    p = mixed_profile()
    # chunk 200: row 1 -> 0.040, row 5 -> 0.055; batch 3 halfway: 0.0475
    assert p.mixed_step_seconds(3, 200, 100) == pytest.approx(0.0475)
    assert p.mixed_step_seconds(1, 50, 100) == pytest.approx(0.030)  # below the first chunk: its value
    assert p.mixed_step_seconds(1, 500, 100) == pytest.approx(0.050 + 200 * 0.020 / 200)  # the last slope


def test_another_context_adds_the_decode_tables_difference_at_that_batch():
    p = mixed_profile()
    # D(3, 300) - D(3, 100) = (0.012 + 0.030) / 2 - (0.010 + 0.020) / 2 = 0.006
    assert p.mixed_step_seconds(3, 200, 300) == pytest.approx(0.0475 + 0.006)
    assert p.mixed_step_seconds(1, 100, 200) == pytest.approx(0.030 + 0.001)


def test_a_mixed_step_never_costs_less_than_its_decodes_alone():
    # a (made-up) mixed step of 5 ms measured at context 300: at context 100 the correction
    # 0.005 + 0.010 - 0.012 = 0.003 is below D(1, 100) = 0.010, which is taken instead
    p = mixed_profile({"context": 300, "batch_sizes": [1], "chunk_tokens": [100], "seconds": [[0.005]]})
    assert p.mixed_step_seconds(1, 100, 100) == pytest.approx(0.010)


def test_no_decodes_or_no_chunk_fall_back_to_the_other_tables():
    p = mixed_profile()
    assert p.mixed_step_seconds(0, 64, 100) == p.prefill_seconds(64)
    assert p.mixed_step_seconds(3, 0, 200) == p.decode_step_seconds(3, 200)
    with pytest.raises(ValueError, match="no mixed table"):
        PROFILE.mixed_step_seconds(1, 64, 100)


def test_round_trip_with_the_table(tmp_path):
    path = tmp_path / "p.json"
    p = mixed_profile()
    save_profile(p, str(path))
    assert json.loads(path.read_text())["mixed"] == MIXED
    assert load_profile(str(path)) == p


def test_a_file_without_the_table_loads_and_saves_as_before(tmp_path):
    old = PROFILE.to_dict()
    assert "mixed" not in old
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    loaded = load_profile(str(path))
    assert loaded == PROFILE and not loaded.has_mixed and loaded.to_dict() == old


@pytest.mark.parametrize("mixed, match", [
    ({**MIXED, "colour": 1}, r"mixed.colour: unknown key"),
    ({k: v for k, v in MIXED.items() if k != "context"}, r"mixed.context: missing"),
    ({**MIXED, "context": 0}, r"mixed.context must be a positive integer"),
    ({**MIXED, "context": None}, r"mixed.context must be a positive integer"),
    ({**MIXED, "batch_sizes": [5, 1]}, r"mixed.batch_sizes must be strictly increasing"),
    ({**MIXED, "chunk_tokens": []}, r"mixed.chunk_tokens must not be empty"),
    ({**MIXED, "chunk_tokens": "64"}, r"mixed.chunk_tokens must be a list"),
    ({**MIXED, "seconds": [[0.03, 0.05]]}, r"mixed.seconds must have one row per batch size \(2\), got 1"),
    ({**MIXED, "seconds": [[0.03], [0.04, 0.07]]}, r"mixed.seconds\[0\] must have 2 values"),
    ({**MIXED, "seconds": [[0.03, 0.05], [0.04, -1]]}, r"mixed.seconds\[1\] must hold numbers > 0"),
    ({**MIXED, "seconds": [0.03, 0.05]}, r"mixed.seconds must be a list of lists"),
    ([], r"mixed must be a JSON object"),
])
def test_malformed_mixed_tables_name_the_file_and_field(tmp_path, mixed, match):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({**PROFILE.to_dict(), "mixed": mixed}))
    with pytest.raises(ValueError, match=rf"bad.json: {match}"):
        load_profile(str(path))


def test_a_table_without_its_context_is_refused_in_code_too():
    with pytest.raises(ValueError, match="mixed.context: missing"):
        dataclasses.replace(PROFILE, mixed_batch_sizes=(1,), mixed_chunk_tokens=(64,), mixed_times=((0.02,),))
