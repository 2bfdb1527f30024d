"""The test configuration's gates: markers are declared (`--strict-markers`), and the GPU skip lives in
one place (tests/conftest.py), so no test file repeats it."""

from __future__ import annotations

import ast
import pathlib
import tomllib

from tests.conftest import _gpus_needed

TESTS = pathlib.Path(__file__).resolve().parent


def test_markers_are_strict_and_declared():
    with open(TESTS.parent / "pyproject.toml", "rb") as f:
        options = tomllib.load(f)["tool"]["pytest"]["ini_options"]
    assert "--strict-markers" in options["addopts"]
    declared = {line.split(":")[0].split("(")[0] for line in options["markers"]}
    assert {"gpu", "multinode", "slow", "cpu"} <= declared


GPU_CONDITIONS = ("not torch.cuda.is_available()", "torch.cuda.device_count() < 2")


def test_no_test_file_repeats_the_gpu_skip():
    """`skipif(not torch.cuda.is_available())` and `skip("needs a CUDA GPU")` belong to the `gpu` marker."""
    copies = []
    for path in TESTS.rglob("*.py"):
        if path == TESTS / "conftest.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            func, first = ast.unparse(node.func), ast.unparse(node.args[0])
            if (func.endswith("mark.skipif") and first in GPU_CONDITIONS
                    or func.endswith("skip") and "needs a CUDA GPU" in first):
                copies.append(f"{path.relative_to(TESTS)}:{node.lineno}")
    assert not copies, copies


def test_the_gpu_marker_counts_gpus():
    class Item:
        def __init__(self, *args):
            self.marker = None if args == (None,) else type("M", (), {"args": args})()

        def get_closest_marker(self, name):
            return self.marker

    assert _gpus_needed(Item(None)) == 0
    assert _gpus_needed(Item()) == 1
    assert _gpus_needed(Item(2)) == 2
