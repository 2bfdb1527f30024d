"""`make setup` picks the CUDA flavour of torch and ucxx from the driver (deploy/setup_flavour.py)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "deploy" / "setup_flavour.py"

_spec = importlib.util.spec_from_file_location("setup_flavour", SCRIPT)
flavour = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(flavour)

SMI_HEADER = """\
Tue Dec  1 12:00:00 2026
+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI 580.95.05              Driver Version: 580.95.05      CUDA Version: {cuda}     |
|-----------------------------------------+------------------------+----------------------+
| GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. ECC |
|   0  NVIDIA H200                    On  |   00000000:19:00.0 Off |                    0 |
+-----------------------------------------+------------------------+----------------------+
"""


@pytest.mark.parametrize("cuda, version", [("13.0", (13, 0)), ("12.4", (12, 4)), ("12.8", (12, 8))])
def test_parse_nvidia_smi_header(cuda, version):
    assert flavour.parse_nvidia_smi(SMI_HEADER.format(cuda=cuda)) == version


def test_parse_nvidia_smi_without_a_cuda_version():
    assert flavour.parse_nvidia_smi("NVIDIA-SMI has failed because it couldn't communicate with the driver.") is None


@pytest.mark.parametrize("override, detected, chosen", [
    ("", None, ("cpu", None)),  # no nvidia-smi
    ("", (13, 0), ("13", (13, 0))),
    ("", (12, 4), ("12", (12, 4))),
    ("", (14, 1), ("13", (14, 1))),  # a newer driver runs the CUDA 13 builds
    ("cpu", (13, 0), ("cpu", None)),  # the override wins over the driver
    ("CPU", None, ("cpu", None)),
    ("12", (13, 0), ("12", (12, 0))),
    ("13", None, ("13", (13, 0))),
    ("12.6", None, ("12", (12, 6))),
    ("auto", (12, 8), ("12", (12, 8))),
])
def test_choose(override, detected, chosen):
    assert flavour.choose(override, detected) == chosen


@pytest.mark.parametrize("override, detected", [("11", None), ("", (11, 8)), ("rocm", None), ("13.x", None)])
def test_choose_refuses_what_has_no_build(override, detected):
    with pytest.raises(ValueError, match="CUDA"):
        flavour.choose(override, detected)


def test_torch_and_extras_per_flavour():
    assert flavour.torch_args("cpu", None) == ["torch==2.13.0"]
    assert flavour.torch_args("13", (13, 0)) == ["torch==2.13.0", "--index-url", "https://download.pytorch.org/whl/cu130"]
    assert flavour.torch_args("12", (12, 8))[-1].endswith("/cu128")
    assert flavour.torch_args("12", (12, 4))[-1].endswith("/cu126")
    extras = {name: set(flavour.EXTRAS[name].split(",")) for name in ("cpu", "12", "13")}
    assert extras["cpu"] == extras["12"] == {"triton", "cluster", "dev"}
    assert extras["13"] == {"triton", "cluster-cu13", "dev"}


def test_extras_exist_in_pyproject_with_the_matching_ucxx():
    optional = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for name in ("cpu", "12", "13"):
        assert set(flavour.EXTRAS[name].split(",")) <= set(optional)
    assert any(d.startswith("ucxx-cu12") for d in optional["cluster"])
    assert any(d.startswith("ucxx-cu13") for d in optional["cluster-cu13"])
    assert not any(d.startswith("ucxx-cu12") for d in optional["cluster-cu13"])


def test_detect_without_nvidia_smi(monkeypatch):
    monkeypatch.setattr(flavour.shutil, "which", lambda name: None)
    assert flavour.detect_cuda() is None


def test_detect_reads_nvidia_smi(monkeypatch, tmp_path):
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\ncat <<'EOF'\n{SMI_HEADER.format(cuda='13.0')}EOF\n")
    smi.chmod(0o755)
    monkeypatch.setattr(flavour.shutil, "which", lambda name: str(smi))
    assert flavour.detect_cuda() == (13, 0)
    smi.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    assert flavour.detect_cuda() is None  # a failing nvidia-smi means CPU


def _run(*args: str, path: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60,
                          env={"PATH": path})


def test_command_line_as_the_makefile_calls_it(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    assert _run("torch", path=str(bin_dir)).stdout.split() == ["torch==2.13.0"]  # no nvidia-smi: CPU
    assert _run("extras", "", path=str(bin_dir)).stdout.strip() == "triton,cluster,dev"
    smi = bin_dir / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\ncat <<'EOF'\n{SMI_HEADER.format(cuda='13.0')}EOF\n")
    smi.chmod(0o755)
    path = f"{bin_dir}:/usr/bin:/bin"
    assert _run("flavour", path=path).stdout.strip() == "13"
    assert _run("extras", path=path).stdout.strip() == "triton,cluster-cu13,dev"
    assert _run("flavour", "cpu", path=path).stdout.strip() == "cpu"
    assert _run("extras", "12", path=path).stdout.strip() == "triton,cluster,dev"
    bad = _run("torch", "11", path=path)
    assert bad.returncode == 2 and "CUDA" in bad.stderr and bad.stdout == ""


def test_makefile_installs_what_the_script_chooses():
    makefile = (ROOT / "Makefile").read_text()
    assert "CUDA ?=" in makefile
    assert "$(FLAVOUR) torch $(CUDA)" in makefile and "$(FLAVOUR) extras $(CUDA)" in makefile
    assert "torch==" not in makefile and "cluster," not in makefile  # the versions live in the script only
