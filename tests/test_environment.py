"""Configuration at the edge (pdserve/environment.py): the one module of the namespace that reads
the process's environment, every variable in its table with a kind, a default and the flag it
mirrors, and a bad value a ValueError naming the variable.

Every module is read with `ast`: a read of `os.environ` (a subscript, `.get`, `in`, a copy, an
alias) or a call of `os.getenv` anywhere but in pdserve.environment fails the check. Writing
variables for children and libraries (`os.environ[k] = v`, `.setdefault(...)` as a statement,
`.pop`, `del`) and handing the environment to a subprocess (`env=os.environ | extra`) are not
reads. The kernels know nothing of the environment module either: their settings arrive
through `kernels.dispatch.configure`.
"""

from __future__ import annotations

import ast
import os
import sys
import textwrap

import pytest

from pdserve import environment
from tests.test_import_layers import imported_modules, modules

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
THE_READER = "pdserve.environment"
# methods of os.environ that only write (their result unused)
WRITES = {"setdefault", "update", "pop", "clear", "__setitem__", "__delitem__"}


def environ_reads(source: str, path: str = "<string>") -> list[tuple[int, str]]:
    """(line, what) of each read of the process's environment in `source`."""
    tree = ast.parse(source, path)
    parents: dict[ast.AST, ast.AST] = {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            parents[child] = node
    os_names, environ_names, getenv_names = {"os"}, set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "os":
                    os_names.add(alias.asname or "os")
        elif isinstance(node, ast.ImportFrom) and node.module in ("os", "posix"):
            for alias in node.names:
                if alias.name in ("environ", "environb"):
                    environ_names.add(alias.asname or alias.name)
                elif alias.name == "getenv":
                    getenv_names.add(alias.asname or alias.name)

    def is_environ(node: ast.AST) -> bool:
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "environb"):
            return isinstance(node.value, ast.Name) and node.value.id in os_names
        return isinstance(node, ast.Name) and node.id in environ_names

    def is_getenv(node: ast.AST) -> bool:
        if isinstance(node, ast.Attribute) and node.attr in ("getenv", "getenvb"):
            return isinstance(node.value, ast.Name) and node.value.id in os_names
        return isinstance(node, ast.Name) and node.id in getenv_names

    def handed_to_a_child(node: ast.AST) -> bool:
        """Inside the `env=` argument of a call (subprocess.Popen(..., env=os.environ | extra))."""
        parent = parents.get(node)
        while parent is not None:
            if isinstance(parent, ast.keyword) and parent.arg == "env":
                return True
            if isinstance(parent, (ast.stmt, ast.Lambda)):
                return False
            parent = parents.get(parent)
        return False

    found = []
    for node in ast.walk(tree):
        if is_getenv(node) and isinstance(parents.get(node), ast.Call) and parents[node].func is node:
            found.append((node.lineno, "os.getenv"))
            continue
        if not is_environ(node):
            continue
        parent = parents.get(node)
        if isinstance(parent, ast.Subscript) and parent.value is node and isinstance(parent.ctx, (ast.Store, ast.Del)):
            continue  # os.environ[k] = v, del os.environ[k]
        if isinstance(parent, ast.Attribute) and parent.attr in WRITES:
            call = parents.get(parent)
            if isinstance(call, ast.Call) and call.func is parent and isinstance(parents.get(call), ast.Expr):
                continue  # os.environ.setdefault(k, v) as a statement: a write for a library
        if handed_to_a_child(node):
            continue
        what = f"os.environ.{parent.attr}" if isinstance(parent, ast.Attribute) else "os.environ"
        found.append((node.lineno, what))
    return sorted(found)


def test_only_the_environment_module_reads_the_environment():
    violations = []
    for module, path in sorted(modules("pdserve").items()):
        if module == THE_READER:
            continue
        with open(path, encoding="utf-8") as f:
            source = f.read()
        violations += [f"{os.path.relpath(path, REPO)}:{line}: {what}" for line, what in environ_reads(source, path)]
    assert not violations, "read the variable through pdserve.environment:\n" + "\n".join(violations)


def test_the_check_catches_a_read():
    """The checker itself: each way of reading is found, writes and a child's env= are not."""
    reads = textwrap.dedent("""
        import os
        import os as system
        from os import environ as ENV, getenv

        a = os.environ.get("PDSERVE_X")
        b = os.environ["PDSERVE_X"]
        c = "PDSERVE_X" in os.environ
        d = system.getenv("PDSERVE_X")
        e = ENV.get("PDSERVE_X")
        f = getenv("PDSERVE_X")
        env = dict(os.environ) | {"A": "1"}
        alias = os.environ if True else {}
        g = os.environ.setdefault("PDSERVE_X", "1")  # its value is used: a read
    """)
    assert [line for line, _ in environ_reads(reads)] == [6, 7, 8, 9, 10, 11, 12, 13, 14]
    writes = textwrap.dedent("""
        import os
        import subprocess

        os.environ["UCX_TLS"] = "tcp"
        os.environ.setdefault("UCX_RNDV_THRESH", "inf")
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        del os.environ["UCX_TLS"]
        subprocess.Popen(["true"], env=os.environ | {"A": "1"})
        subprocess.run(["true"], env=dict(os.environ, B="2"))
    """)
    assert environ_reads(writes) == []


def test_the_check_finds_a_read_in_a_module_of_the_namespace(tmp_path):
    """A module that reads a variable on its own is reported with its line."""
    path = tmp_path / "engine_mod.py"
    path.write_text("import os\n\n\ndef backend():\n    return os.environ.get('PDSERVE_KERNEL_BACKEND', 'auto')\n")
    assert environ_reads(path.read_text(), str(path)) == [(5, "os.environ.get")]


def test_every_variable_has_a_kind_a_default_and_reads_as_documented():
    for name, variable in environment.VARIABLES.items():
        assert variable.name == name and variable.kind and variable.help, name
        assert environment.get(name, {}) == variable.default  # unset: its default
    assert environment.get("PDSERVE_OVERLAP_STEPS", {"PDSERVE_OVERLAP_STEPS": " Off "}) is False
    assert environment.get("PDSERVE_KV_RECV_SLOTS", {"PDSERVE_KV_RECV_SLOTS": "3"}) == 3
    assert environment.get("PDSERVE_KERNEL_BACKEND", {"PDSERVE_KERNEL_BACKEND": " Torch"}) == "torch"
    assert environment.get("PDSERVE_GIL_SWITCH_INTERVAL_S", {"PDSERVE_GIL_SWITCH_INTERVAL_S": "5e-5"}) == 5e-5
    assert environment.get("PDSERVE_KV_TRACE", {"PDSERVE_KV_TRACE": "1"}) is True
    assert environment.get("PDSERVE_KV_TRACE", {"PDSERVE_KV_TRACE": "yes"}) is False  # only 1 switches it on
    assert environment.get("PDSERVE_API_KEY", {"PDSERVE_API_KEY": ""}) is None
    assert environment.VARIABLES["PDSERVE_API_KEY"].flag == "--api-key"
    assert environment.VARIABLES["PDSERVE_WARMUP"].flag == "--[no-]warmup"
    assert environment.lookup("MY_KEY", {"MY_KEY": "k"}) == "k" and environment.lookup("MY_KEY", {}) is None
    with pytest.raises(KeyError, match="PDSERVE_NOPE"):
        environment.get("PDSERVE_NOPE", {})


@pytest.mark.parametrize("name, text, message", [
    ("PDSERVE_WARMUP", "sometimes", "PDSERVE_WARMUP must be 0 or 1, got 'sometimes'"),
    ("PDSERVE_KERNEL_BACKEND", "cuda", "PDSERVE_KERNEL_BACKEND must be one of auto, torch, triton; got 'cuda'"),
    ("PDSERVE_PREFILL_ATTENTION", "flash", "PDSERVE_PREFILL_ATTENTION must be auto, dense or paged; got 'flash'"),
    ("PDSERVE_NIXL_SLOTS", "zero", "PDSERVE_NIXL_SLOTS must be an int >= 1, got 'zero'"),
    ("PDSERVE_KV_RECV_SLOTS", "0", "PDSERVE_KV_RECV_SLOTS must be an int >= 1, got '0'"),
    ("PDSERVE_UCX_PROGRESS_MODE", "spin", "PDSERVE_UCX_PROGRESS_MODE must be thread or thread-polling, got 'spin'"),
    ("PDSERVE_GIL_SWITCH_INTERVAL_S", "-1", "PDSERVE_GIL_SWITCH_INTERVAL_S must be a positive number of seconds, "
                                            "got '-1'"),
])
def test_a_bad_value_is_a_value_error_naming_the_variable(name, text, message):
    with pytest.raises(ValueError) as err:
        environment.get(name, {name: text})
    assert str(err.value) == message


def test_the_cache_root_follows_the_variables(tmp_path):
    assert environment.cache_root({"PDSERVE_CACHE_DIR": str(tmp_path)}) == str(tmp_path)
    assert environment.cache_root({"PDSERVE_CACHE_DIR": ""}) is None
    assert environment.cache_root({"XDG_CACHE_HOME": str(tmp_path)}) == str(tmp_path / "pdserve")


def test_the_environment_module_imports_only_the_standard_library():
    path = os.path.join(REPO, "pdserve", "environment.py")
    found = {target.split(".")[0] for target, _ in imported_modules(THE_READER, path)}
    assert found <= set(sys.stdlib_module_names) | {"__future__"}, found


def test_the_kernels_know_nothing_of_the_environment():
    """Their settings arrive through kernels.dispatch.configure, from whoever starts the engine."""
    offenders = [module for module, path in modules("pdserve.kernels").items()
                 if any(target == THE_READER for target, _ in imported_modules(module, path))]
    assert offenders == []
