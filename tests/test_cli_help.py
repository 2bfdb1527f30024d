"""`pdserve --help` explains every option, and --max-tokens-default reaches the router's app."""

from __future__ import annotations

import argparse

import pytest

from pdserve.launcher.cli import build_parser
from pdserve.launcher.cluster.config import load_up_config


def _options(parser: argparse.ArgumentParser, name: str = "pdserve"):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _options(sub, f"{name} {sub_name}")
        elif not isinstance(action, argparse._HelpAction):
            yield name, action


def test_every_option_of_every_subcommand_has_help():
    options = list(_options(build_parser()))
    assert {name for name, _ in options} == {"pdserve", "pdserve generate", "pdserve up", "pdserve worker",
                                             "pdserve router", "pdserve profile", "pdserve plan"}
    missing = [(name, action.option_strings or action.dest) for name, action in options
               if not (action.help or "").strip() or action.help == argparse.SUPPRESS]
    assert missing == []


def _help_of(subcommand: str, flag: str) -> str:
    for name, action in _options(build_parser()):
        if name == f"pdserve {subcommand}".strip() and flag in action.option_strings:
            return action.help
    raise KeyError(flag)


@pytest.mark.parametrize("flag, default", [("--port", "8000"), ("--policy", "round-robin"),
                                           ("--startup-timeout-s", "600"), ("--block-size", "16")])
def test_up_help_says_the_defaults(flag, default):
    # `pdserve up` leaves flags unset (so that --config applies): the default is in the text itself
    assert f"default {default}" in _help_of("up", flag)


def test_up_help_of_the_batch_limits_says_they_depend_on_the_device():
    for flag in ("--max-num-batched-tokens", "--max-num-seqs"):
        text = _help_of("up", flag)
        assert "device-dependent" in text and "CUDA" in text and "CPU" in text


def test_log_level_lists_its_choices_and_takes_any_case(capsys):
    parser = build_parser()
    assert parser.parse_args(["--log-level", "debug", "router", "--worker", "prefill=h:1"]).log_level == "DEBUG"
    with pytest.raises(SystemExit):
        parser.parse_args(["--log-level", "loud", "router", "--worker", "prefill=h:1"])
    assert "DEBUG" in capsys.readouterr().err
    assert "{DEBUG,INFO,WARNING,ERROR,CRITICAL}" in parser.format_help()


def test_max_tokens_default_from_flag_and_config_file(tmp_path):
    args = build_parser().parse_args(["up", "--max-tokens-default", "256"])
    assert args.max_tokens_default == 256
    assert "max_tokens_default" not in vars(build_parser().parse_args(["up"]))  # unset: the file may set it
    path = tmp_path / "c.yaml"
    path.write_text("max-tokens-default: 128\n")
    assert load_up_config({}, str(path)).max_tokens_default == 128
    assert load_up_config({"max_tokens_default": 64}, str(path)).max_tokens_default == 64
    assert load_up_config({}).max_tokens_default is None
    with pytest.raises(ValueError, match="--max-tokens-default: must be >= 1"):
        load_up_config({"max_tokens_default": 0})


def test_router_settings_pass_max_tokens_default_to_the_app(monkeypatch):
    import pdserve.router.http.server as http_server
    from pdserve.launcher.cluster.serving import RouterModel, RouterSettings, build_app
    from pdserve.router.cluster.directory import StaticDirectory
    from pdserve.router.placement.registry import make_policy

    seen = {}
    real = http_server.create_app

    def create_app(backend, **kwargs):
        seen.update(kwargs)
        return real(backend, **kwargs)

    monkeypatch.setattr(http_server, "create_app", create_app)
    settings = RouterSettings(model="m", max_tokens_default=42, usage_timing=True)
    build_app(StaticDirectory([]), settings, RouterModel(tokenizer=object(), max_model_len=64, name="m"),
              make_policy("round-robin"))
    assert seen["max_tokens_default"] == 42 and seen["usage_timing"] is True


def test_usage_timing_flag_on_up_and_router(tmp_path):
    assert build_parser().parse_args(["up", "--usage-timing"]).usage_timing is True
    assert "usage_timing" not in vars(build_parser().parse_args(["up"]))  # unset: the file may set it
    assert load_up_config({"usage_timing": True}).usage_timing is True
    assert load_up_config({}).usage_timing is False
    path = tmp_path / "c.yaml"
    path.write_text("usage-timing: true\n")
    assert load_up_config({}, str(path)).usage_timing is True
    router = build_parser().parse_args(["router", "--worker", "prefill=h:1"])
    assert router.usage_timing is False
