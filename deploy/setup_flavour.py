"""Which CUDA flavour of torch and ucxx `make setup` installs.

Run by the Makefile before anything is installed, so it uses the standard library only:

    python3 deploy/setup_flavour.py torch [CUDA]    # pip arguments that install torch
    python3 deploy/setup_flavour.py extras [CUDA]   # the extras of `pip install -e '.[...]'`
    python3 deploy/setup_flavour.py flavour [CUDA]  # cpu, 12 or 13

CUDA is `cpu`, `12`, `13` (or a version such as `12.4`) or empty: empty reads the CUDA version
the driver supports from the header of `nvidia-smi` ("CUDA Version: 13.0"), and means CPU where
there is no nvidia-smi or it fails. CPU installs torch==2.13.0 as it resolves on the machine
and ucxx-cu12 (the `cluster` extra: it installs and runs on CPU machines); CUDA 12 installs
PyTorch's CUDA 12 build of torch (from PyTorch's index) with the same extra; CUDA 13, PyTorch's
CUDA 13 build and ucxx-cu13 (the `cluster-cu13` extra).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

TORCH_VERSION = "2.13.0"
TORCH_INDEX = "https://download.pytorch.org/whl/{tag}"
EXTRAS = {"cpu": "triton,cluster,dev", "12": "triton,cluster,dev", "13": "triton,cluster-cu13,dev"}
_CUDA_VERSION = re.compile(r"CUDA Version:\s*(\d+)\.(\d+)")


def parse_nvidia_smi(header: str) -> tuple[int, int] | None:
    """The (major, minor) CUDA version in nvidia-smi's header, or None when it names none."""
    match = _CUDA_VERSION.search(header)
    return (int(match[1]), int(match[2])) if match else None


def detect_cuda() -> tuple[int, int] | None:
    """The CUDA version the driver supports, or None (no nvidia-smi, or it failed)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi], capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_nvidia_smi(out)


def choose(override: str = "", detected: tuple[int, int] | None = None) -> tuple[str, tuple[int, int] | None]:
    """(flavour, version): flavour is "cpu", "12" or "13"; version the CUDA (major, minor) when known.

    `override` (the Makefile's CUDA variable) wins: "cpu", "12", "13", "12.4"; empty uses `detected`.
    A driver newer than CUDA 13 takes the CUDA 13 builds (drivers run older CUDA builds)."""
    override = override.strip().lower()
    if override in ("", "auto"):
        version = detected
    elif override == "cpu":
        return "cpu", None
    else:
        match = re.fullmatch(r"(\d+)(?:\.(\d+))?", override)
        if match is None:
            raise ValueError(f"CUDA must be cpu, 12, 13 or a version such as 12.4, got {override!r}")
        version = (int(match[1]), int(match[2] or 0))
    if version is None:
        return "cpu", None
    if version[0] < 12:
        raise ValueError(f"CUDA {version[0]}.{version[1]} is older than the CUDA 12 builds of torch and ucxx; "
                         "update the driver or set CUDA=cpu")
    return ("13" if version[0] >= 13 else "12"), version


def torch_args(flavour: str, version: tuple[int, int] | None) -> list[str]:
    """pip arguments that install torch for the flavour."""
    if flavour == "cpu":
        return [f"torch=={TORCH_VERSION}"]
    if flavour == "13":
        tag = "cu130"
    else:  # CUDA 12.8+ drivers take the cu128 build; older 12.x drivers the cu126 one
        tag = "cu128" if version is None or version[1] >= 8 else "cu126"
    return [f"torch=={TORCH_VERSION}", "--index-url", TORCH_INDEX.format(tag=tag)]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] not in ("torch", "extras", "flavour") or len(args) > 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    override = args[1] if len(args) > 1 else ""
    try:
        flavour, version = choose(override, detect_cuda() if override.strip().lower() in ("", "auto") else None)
    except ValueError as e:
        print(f"setup_flavour: {e}", file=sys.stderr)
        return 2
    if args[0] == "torch":
        print(" ".join(torch_args(flavour, version)))
    elif args[0] == "extras":
        print(EXTRAS[flavour])
    else:
        print(flavour)
    return 0


if __name__ == "__main__":
    sys.exit(main())
