"""Which backend the kernels run: forced, else the process's (`dispatch.configure`, which the
engine calls from EngineConfig.kernels; the CLI reads PDSERVE_KERNEL_BACKEND into it), else auto."""

import subprocess
import sys

import pytest
import torch

from pdserve import kernels
from pdserve.engine_args import kernel_config
from pdserve.kernels import dispatch, norm
from pdserve.kernels.dispatch import force_backend, kernel_backend

ENV_VAR = "PDSERVE_KERNEL_BACKEND"


@pytest.fixture(autouse=True)
def process_settings():
    """Each test starts from the defaults and leaves them (the settings are the process's)."""
    dispatch.configure()
    yield
    dispatch.configure()


@pytest.fixture
def no_env(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)


def configure_from_env() -> None:
    """What an engine's start does with the variable (EngineConfig.kernels, read at the edge)."""
    config = kernel_config()
    dispatch.configure(config.backend, config.prefill_attention)


def test_auto_is_torch_on_cpu(no_env):
    assert kernel_backend(torch.device("cpu")) == "torch"
    assert kernel_backend("cpu") == "torch"


def test_auto_on_cuda_follows_triton_availability(no_env, monkeypatch):
    monkeypatch.setattr(dispatch, "triton_available", lambda: True)
    assert kernel_backend("cuda") == "triton"
    monkeypatch.setattr(dispatch, "triton_available", lambda: False)
    assert kernel_backend("cuda:0") == "torch"


@pytest.mark.parametrize("value, expected", [("torch", "torch"), ("TORCH", "torch"), (" auto ", "torch")])
def test_env_choice(monkeypatch, value, expected):
    monkeypatch.setenv(ENV_VAR, value)
    configure_from_env()
    assert kernel_backend("cpu") == expected


def test_env_triton(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "triton")
    configure_from_env()
    monkeypatch.setattr(dispatch, "triton_available", lambda: True)
    assert kernel_backend("cpu") == "triton"
    monkeypatch.setattr(dispatch, "triton_available", lambda: False)
    with pytest.raises(RuntimeError, match="triton"):
        kernel_backend("cpu")


def test_bad_env_value_names_the_variable(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "cuda")
    with pytest.raises(ValueError, match=ENV_VAR):
        configure_from_env()
    with pytest.raises(ValueError, match="kernel backend must be one of auto, torch, triton; got 'cuda'"):
        dispatch.configure("cuda")


def test_the_variable_is_read_at_the_edge_not_at_each_dispatch(monkeypatch):
    """Set after the process configured its kernels, the variable changes nothing below."""
    monkeypatch.setenv(ENV_VAR, "torch")
    configure_from_env()
    monkeypatch.setattr(dispatch, "triton_available", lambda: True)
    monkeypatch.setenv(ENV_VAR, "triton")
    assert kernel_backend("cpu") == "torch" and dispatch.settings().backend == "torch"


def test_force_backend_overrides_env_and_restores(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "torch")
    configure_from_env()
    monkeypatch.setattr(dispatch, "triton_available", lambda: True)
    with force_backend("triton"):
        assert kernel_backend("cpu") == "triton"
        with force_backend("torch"):
            assert kernel_backend("cpu") == "torch"
        assert kernel_backend("cpu") == "triton"
    assert kernel_backend("cpu") == "torch"


def test_force_backend_rejects_unknown():
    with pytest.raises(ValueError, match="force_backend"):
        with force_backend("cuda"):
            pass


def test_public_function_dispatches(no_env, monkeypatch):
    calls = []
    monkeypatch.setattr(norm, "rms_norm_triton", lambda *a: calls.append("triton") or "t")
    monkeypatch.setattr(norm, "rms_norm_ref", lambda *a: calls.append("torch") or "r")
    monkeypatch.setattr(dispatch, "triton_available", lambda: True)
    x, w = torch.ones(2, 4), torch.ones(4)
    assert kernels.rms_norm(x, w, 1e-6) == "r"
    with force_backend("triton"):
        assert kernels.rms_norm(x, w, 1e-6) == "t"
    assert calls == ["torch", "triton"]


def test_package_imports_and_runs_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from pdserve import kernels\n"
        "from pdserve.kernels.dispatch import triton_available\n"
        "assert not triton_available()\n"
        "assert kernels.kernel_backend('cuda') == 'torch'\n"
        "x = torch.randn(3, 8)\n"
        "assert kernels.silu_and_mul(x).shape == (3, 4)\n"
        "assert 'triton.language' not in sys.modules\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != ENV_VAR}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr


def test_import_does_not_import_triton():
    code = "import sys; from pdserve import kernels; assert 'triton' not in sys.modules, 'triton imported eagerly'"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
