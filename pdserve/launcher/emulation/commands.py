"""The two Linux commands the link emulation runs, `ip` and `tc`, and the name of a node's
interface inside its namespace. Failures raise EmulationError naming the command."""

from __future__ import annotations

import subprocess

from pdserve.launcher.emulation.errors import EmulationError

NODE_DEVICE = "pds0"  # the node's interface inside its namespace


def ip_cmd(*args: str, netns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``ip [-n netns] args``; EmulationError names the command and ip's message."""
    return _run(["ip", *(["-n", netns] if netns else []), *args], check)


def tc_cmd(*args: str, netns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``tc`` (inside ``netns`` when given)."""
    return _run([*(["ip", "netns", "exec", netns] if netns else []), "tc", *args], check)


def _run(argv: list[str], check: bool) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        raise EmulationError(f"{argv[0]!r} not found; install iproute2") from None
    if check and proc.returncode != 0:
        raise EmulationError(f"`{' '.join(argv)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc
