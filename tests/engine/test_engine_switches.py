"""Every engine switch (pdserve/engine_args.py): its default, its --flag / --no-flag, its
environment variable (1/0 and friends), the flag winning over the variable, and a bad value
of the variable named. Read at the CLI edge into the EngineConfig a worker gets."""

from __future__ import annotations

import argparse

import pytest

from pdserve.engine_args import ENGINE_ENV, SWITCH_DEFAULTS, add_engine_args, engine_config

# where each switch lands in the EngineConfig
LANDS = {
    "overlap_steps": lambda c: c.overlap_steps,
    "cuda_graphs": lambda c: not c.cache.enforce_eager,
    "warmup": lambda c: c.warmup,
    "experimental_fp8_kv": lambda c: c.cache.experimental_fp8_kv,
    "prefill_graphs": lambda c: c.cache.prefill_graphs,
}


def test_every_switch_is_covered():
    assert set(LANDS) == set(SWITCH_DEFAULTS) == set(ENGINE_ENV)


@pytest.mark.parametrize("switch", sorted(SWITCH_DEFAULTS))
def test_a_switch_from_its_flag_its_variable_or_its_default(switch, monkeypatch):
    flag, var, default = "--" + switch.replace("_", "-"), ENGINE_ENV[switch], SWITCH_DEFAULTS[switch]

    def value(*flags):
        parser = argparse.ArgumentParser()
        add_engine_args(parser)
        return LANDS[switch](engine_config(parser.parse_args(list(flags))))

    monkeypatch.delenv(var, raising=False)
    assert value() is default
    assert value(flag) is True
    assert value("--no-" + flag[2:]) is False
    for text, expected in (("1", True), ("yes", True), ("0", False), ("off", False)):
        monkeypatch.setenv(var, text)
        assert value() is expected
    monkeypatch.setenv(var, "0")
    assert value(flag) is True  # the flag wins over the variable
    monkeypatch.setenv(var, "sometimes")
    with pytest.raises(ValueError, match=var):
        value()
