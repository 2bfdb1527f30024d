"""The script rooms (benchmarks/, experiments/, tools/): each script runs as a module from the
repository root (`python -m benchmarks.bench_kernels`), none edits sys.path, none starts a server
in a session of its own except through loadgen's ServerProcess, and each room's README lists
every script in it."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROOMS = ("benchmarks", "experiments", "tools")


def scripts(room: str, suffixes: tuple[str, ...] = (".py",)) -> list[Path]:
    return sorted(p for p in (REPO / room).rglob("*") if p.suffix in suffixes and "__pycache__" not in p.parts)


@pytest.mark.parametrize("room", ROOMS)
def test_a_room_is_a_namespace_package_and_no_script_edits_sys_path(room):
    assert not (REPO / room / "__init__.py").exists()
    edits = [f"{p.relative_to(REPO)}:{node.lineno}" for p in scripts(room)
             for node in ast.walk(ast.parse(p.read_text(), str(p)))
             if isinstance(node, ast.Attribute) and node.attr == "path"
             and isinstance(node.value, ast.Name) and node.value.id == "sys"]
    assert not edits


@pytest.mark.parametrize("room", ROOMS)
def test_servers_are_started_through_the_one_helper(room):
    """A process group of its own (start_new_session) is what a server gets: only ServerProcess
    (pdserve/loadgen/launcher.py) makes one."""
    found = []
    for p in scripts(room):
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(node, ast.Call) and any(k.arg == "start_new_session" for k in node.keywords):
                found.append(f"{p.relative_to(REPO)}:{node.lineno}")
    assert not found


@pytest.mark.parametrize("room", ROOMS)
def test_the_readme_lists_every_script(room):
    readme = (REPO / room / "README.md").read_text()
    missing = [str(p.relative_to(REPO / room)) for p in scripts(room, (".py", ".sh"))
               if p.name not in readme and f"{p.parent.name}/" not in readme]
    assert not missing


def test_a_script_runs_as_a_module_of_its_room_from_the_root():
    """`python -m tools.kv_trace_report --help` from the root, with nothing on PYTHONPATH: the room
    imports as a namespace package and the script finds pdserve from there."""
    env = {"PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-m", "tools.kv_trace_report", "--help"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: ") and "--transfer" in proc.stdout
