"""Imports run one way (DESIGN.md, Layout): a module imports only from its own layer or below.

    1. the composition root: launcher/ (CLI, `pdserve up`, `pdserve profile`, every way of
       starting workers and clusters, the link emulation)
    2. router/
    3. pdserve.worker and kvtransfer/
    4. the engine and everything else in pdserve/ (protocol, shared request types, loaders, ...)
    5. kernels/

Every `import` and `from ... import` is read with `ast`, wherever it stands (module level, in a
function, under TYPE_CHECKING); importing `a.b.c` also runs the packages `a` and `a.b`, so
those count too. loadgen/ imports none of these packages (it measures any OpenAI server).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# module prefix -> layer; the longest matching prefix wins
LAYERS: dict[str, int] = {
    "launcher": 1,
    "router": 2,
    "pdserve.worker": 3,
    "kvtransfer": 3,
    "pdserve": 4,
    "kernels": 5,
}
PACKAGES = ("launcher", "pdserve", "router", "kvtransfer", "kernels")
LAYER_NAMES = {1: "composition root", 2: "router", 3: "worker/kvtransfer", 4: "engine", 5: "kernels"}


def layer_of(module: str) -> int | None:
    best = None
    for prefix, layer in LAYERS.items():
        if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > len(best[0])):
            best = (prefix, layer)
    return None if best is None else best[1]


def modules(package: str) -> dict[str, str]:
    """module name -> path, for every .py file of a top-level package."""
    out = {}
    for directory, _, files in os.walk(os.path.join(REPO, package)):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                module = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".").removesuffix(".__init__")
                out[module] = path
    return out


def imported_modules(module: str, path: str) -> list[tuple[str, int]]:
    """(module name, line) of each import in the file, parents included, relative ones resolved."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    is_package = path.endswith("__init__.py")
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # `from pkg import name` may import the submodule pkg.name
            names = [target] + [f"{target}.{alias.name}" for alias in node.names if alias.name != "*"]
        else:
            continue
        for name in names:
            parts = name.split(".")
            found += [(".".join(parts[:i]), node.lineno) for i in range(1, len(parts) + 1)]
    return list(dict.fromkeys(found))


def all_modules() -> dict[str, str]:
    out = {}
    for package in PACKAGES:
        out.update(modules(package))
    return out


def test_every_module_has_a_layer():
    unassigned = [m for m in all_modules() if layer_of(m) is None]
    assert not unassigned


def test_no_module_imports_from_a_layer_above_it():
    known = all_modules()
    violations = []
    for module, path in sorted(known.items()):
        own = layer_of(module)
        for target, line in imported_modules(module, path):
            if target.split(".")[0] not in PACKAGES:
                continue
            if target not in known and target.rsplit(".", 1)[0] in known and target.rsplit(".", 1)[0] != target:
                continue  # `from pkg import name` where name is not a module: the package counts already
            layer = layer_of(target)
            if layer is not None and layer < own:
                violations.append(f"{os.path.relpath(path, REPO)}:{line}: {module} ({LAYER_NAMES[own]}) imports "
                                  f"{target} ({LAYER_NAMES[layer]})")
    assert not violations, "\n".join(violations)


def test_loadgen_imports_none_of_the_server_packages():
    violations = [
        f"{module} imports {target}"
        for module, path in modules("loadgen").items()
        for target, _ in imported_modules(module, path)
        if target.split(".")[0] in PACKAGES
    ]
    assert not violations


def test_the_check_catches_an_upward_import(tmp_path):
    """The checker itself: an engine module importing the router is reported."""
    path = tmp_path / "engine_mod.py"
    path.write_text("def f():\n    from router.server import create_app\n")
    targets = [t for t, _ in imported_modules("pdserve.engine_mod", str(path))]
    assert "router.server" in targets and "router" in targets
    assert layer_of("pdserve.engine_mod") == 4 and layer_of("router.server") == 2
    rel = tmp_path / "__init__.py"
    rel.write_text("from .sub import x\nfrom . import other\n")
    assert {"pdserve.worker.sub", "pdserve.worker.other"} <= {t for t, _ in imported_modules("pdserve.worker", str(rel))}


def test_cli_runs_from_its_module_path():
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-m", "launcher.cli", "--help"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "generate" in proc.stdout and "up" in proc.stdout


def test_console_script_points_at_the_composition_root():
    import tomllib

    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)
    assert project["project"]["scripts"]["pdserve"] == "launcher.cli:main"
    assert "launcher*" in project["tool"]["setuptools"]["packages"]["find"]["include"]
