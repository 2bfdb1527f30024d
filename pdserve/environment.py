"""Every environment variable pdserve reads, and the one module that reads them.

A variable is read at the edge of a process, where it starts: the CLI (`pdserve.engine_args`,
`pdserve.launcher`), a worker's start (`pdserve.launcher.workers.worker_config`), an engine
started without a kernel configuration, a benchmark. What it says travels down as
configuration from there: `EngineConfig` (its switches and `kernels`), `WorkerConfig`
(`kv_settings`, `kv_options`, `cluster_token`), `UpConfig` and `RouterSettings`. Below the edge
nothing reads the environment; the kernels and the KV plane take process-wide settings that
the edge sets once (`pdserve.kernels.dispatch.configure`, `pdserve.kvtransfer.settings.configure`).

Each `Variable` says what its values are, its default and the flag that mirrors it; a flag wins
over its variable, which wins over the default. A bad value is a ValueError naming the variable.
tests/test_environment.py checks that no other module of the namespace reads `os.environ`.

Writing variables for child processes and libraries (CUDA_VISIBLE_DEVICES, UCX_*) is not
reading them and happens where it is needed; `child_env` is this process's environment handed
to a subprocess. This module imports only the standard library: every layer may use it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


@dataclass(frozen=True)
class Variable:
    name: str
    kind: str  # what its values are, in words
    default: Any  # its value when unset
    parse: Callable[[str, str], Any]  # (name, text) -> value; ValueError naming the variable
    flag: str | None = None  # the command-line flag that mirrors it (and wins over it)
    help: str = ""


def _switch(name: str, text: str) -> bool:
    value = text.strip().lower()
    if value not in _TRUE + _FALSE:
        raise ValueError(f"{name} must be 0 or 1, got {text!r}")
    return value in _TRUE


def _is_one(name: str, text: str) -> bool:
    return text == "1"


def _choice(*choices: str, words: str, sep: str = ",") -> Callable[[str, str], str]:
    def parse(name: str, text: str) -> str:
        value = text.strip().lower()
        if value not in choices:
            raise ValueError(f"{name} must be {words}{sep} got {text!r}")
        return value
    return parse


def _exact(*choices: str, words: str) -> Callable[[str, str], str]:
    def parse(name: str, text: str) -> str:
        if text not in choices:
            raise ValueError(f"{name} must be {words}, got {text!r}")
        return text
    return parse


def _positive_int(name: str, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {text!r}")
    return value


def _positive_seconds(name: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise ValueError(f"{name} must be a positive number of seconds, got {text!r}")
    return value


def _text(name: str, text: str) -> str:
    return text


def _text_or_none(name: str, text: str) -> str | None:
    return text or None


_SWITCHES = (  # the engine's switches (pdserve.engine_args.ENGINE_ENV; defaults in SWITCH_DEFAULTS)
    ("PDSERVE_OVERLAP_STEPS", "--[no-]overlap-steps", True, "GPU: overlap a decode-only step with the last"),
    ("PDSERVE_CUDA_GRAPHS", "--[no-]cuda-graphs", True, "GPU: replay CUDA graphs for decode-only steps"),
    ("PDSERVE_WARMUP", "--[no-]warmup", True, "worker: run the serving shapes before saying it is ready"),
    ("PDSERVE_EXPERIMENTAL_FP8_KV", "--experimental-fp8-kv", False, "allow --kv-cache-dtype fp8 on CUDA"),
    ("PDSERVE_PREFILL_GRAPHS", "--[no-]prefill-graphs", True, "GPU: piecewise CUDA graphs for prefill steps"),
)

VARIABLES: dict[str, Variable] = {v.name: v for v in (
    *(Variable(name, "1/0, true/false, yes/no, on/off", default, _switch, flag, text)
      for name, flag, default, text in _SWITCHES),
    Variable("PDSERVE_KERNEL_BACKEND", "auto | torch | triton", "auto",
             _choice("auto", "torch", "triton", words="one of auto, torch, triton", sep=";"),
             help="the kernels' backend (auto: Triton on CUDA when it imports, else the torch references); "
                  "EngineConfig.kernels"),
    Variable("PDSERVE_PREFILL_ATTENTION", "auto | dense | paged", "auto",
             _choice("auto", "dense", "paged", words="auto, dense or paged", sep=";"),
             help="fresh prompts' attention over their own K/V (dense) or the paged cache; EngineConfig.kernels"),
    Variable("PDSERVE_KV_TRACE", "1 (anything else: off)", False, _is_one,
             help="the KV plane marks each message's time points (pdserve.kvtransfer.trace); "
                  "WorkerConfig.kv_settings"),
    Variable("PDSERVE_KV_TRACE_DIR", "a directory", None, _text_or_none,
             help="with PDSERVE_KV_TRACE=1, a served process appends its points there"),
    Variable("PDSERVE_KV_RECV_SLOTS", "int >= 1", 8, _positive_int,
             help="staging slots of a UCX receiver"),
    Variable("PDSERVE_NIXL_SLOT_BYTES", "int >= 1", 16 << 20, _positive_int,
             help="bytes of a NIXL WRITE connection's staging slot"),
    Variable("PDSERVE_NIXL_SLOTS", "int >= 1", 4, _positive_int,
             help="staging slots of a NIXL WRITE connection"),
    Variable("PDSERVE_UCX_PROGRESS_MODE", "thread | thread-polling", "thread",
             _exact("thread", "thread-polling", words="thread or thread-polling"),
             help="how the UCX progress thread waits (thread-polling spins)"),
    Variable("PDSERVE_GIL_SWITCH_INTERVAL_S", "seconds > 0", 0.0002, _positive_seconds,
             help="the UCX runtime lowers sys.setswitchinterval to it"),
    Variable("PDSERVE_UCX_ALLOW_SYSTEM_LIB", "1 (anything else: off)", False, _is_one,
             help="accept a libucp that is not the libucx wheel's"),
    Variable("PDSERVE_KV_FAULTS", "drop=P,duplicate=P,reorder=P,corrupt=P,seed=N", "", _text,
             help="fault injection in the KV plane (tests, benchmarks/faults.py); WorkerConfig.kv_options"),
    Variable("PDSERVE_CLUSTER_TOKEN", "a secret of 16 characters or more", None, _text_or_none,
             flag="--cluster-token-file", help="the request plane's and KV plane's cluster token"),
    Variable("PDSERVE_API_KEY", "a secret", None, _text_or_none, flag="--api-key",
             help="the key clients must send to the router"),
    Variable("PDSERVE_CACHE_DIR", "a directory ('' : no cache)", None, _text,
             help="where converted GGUF tokenizers are kept (else $XDG_CACHE_HOME/pdserve)"),
    Variable("XDG_CACHE_HOME", "a directory", None, _text_or_none,
             help="the user's cache directory, when PDSERVE_CACHE_DIR is unset (else ~/.cache)"),
    Variable("OPENAI_API_KEY", "a secret", None, _text_or_none, flag="pdserve-loadgen --api-key",
             help="the key the load generator sends"),
    Variable("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES", "1 / true", None, _text_or_none,
             help="set in a GPU worker's Ray runtime env: the worker picks the GPU Ray assigned it"),
    Variable("CUDA_VISIBLE_DEVICES", "GPU indices or UUIDs, comma-separated", None, _text,
             help="read by a Ray worker to find the GPU Ray assigned it"),
)}


def _environ(environ: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if environ is None else environ


def is_set(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """Whether the variable `name` (one of VARIABLES) is set, to anything."""
    _variable(name)
    return name in _environ(environ)


def get(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """The value of variable `name` (one of VARIABLES): parsed, or its default when unset;
    ValueError naming the variable when its text is not a value. `environ`: tests' stand-in for
    the process's environment."""
    variable = _variable(name)
    text = _environ(environ).get(name)
    return variable.default if text is None else variable.parse(name, text)


def lookup(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The text of a variable a user names (the load generator's `server.api_key_env`), or None."""
    return _environ(environ).get(name)


def cache_root(environ: Mapping[str, str] | None = None) -> str | None:
    """Where pdserve keeps what it derives from model files: `$PDSERVE_CACHE_DIR`, else
    `$XDG_CACHE_HOME/pdserve`, else `~/.cache/pdserve`; None when PDSERVE_CACHE_DIR is set empty."""
    explicit = get("PDSERVE_CACHE_DIR", environ)
    if explicit is not None:
        return explicit or None
    base = get("XDG_CACHE_HOME", environ) or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "pdserve")


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment with `extra` over it, for a subprocess."""
    return dict(os.environ) | dict(extra or {})


def _variable(name: str) -> Variable:
    try:
        return VARIABLES[name]
    except KeyError:
        raise KeyError(f"{name} is not one of pdserve's environment variables (environment.VARIABLES)") from None
