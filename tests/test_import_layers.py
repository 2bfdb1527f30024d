"""Imports run one way (docs/design.md, Layers): a module imports only from its own layer or below.

Everything lives in one namespace, `pdserve`, whose `__init__` imports nothing:

    1. the composition root: pdserve.launcher (CLI, `pdserve up`, `pdserve profile`, every way
       of starting workers and clusters, the link emulation), pdserve.sim, pdserve.loadgen
    2. pdserve.router: its HTTP side (.http) and cluster side (.cluster), which import each
       other not at all, and what they share (.backend, .errors, .metrics)
    3. pdserve.router.placement: pure placement, below the rest of the router and used by sim
    4. pdserve.worker and pdserve.kvtransfer
    5. the engine and everything else in pdserve/ (protocol, shared request types, loaders, ...)
    6. pdserve.kernels
    7. pdserve.loadgen.yamlconfig, the one reader of configuration files: it imports only
       pydantic and yaml, so every package may use it; and pdserve.environment, the one reader
       of environment variables, which imports only the standard library

Every `import` and `from ... import` is read with `ast`, wherever it stands (module level, in a
function, under TYPE_CHECKING); importing `a.b.c` also runs the packages `a` and `a.b`, so
those count too. pdserve.loadgen imports nothing else of the namespace but the environment
module (it measures any OpenAI server); pdserve.sim imports the router's placement and nothing
else of it. No file of the namespace is in an import circle.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = "pdserve"  # the one import namespace; its __init__ imports nothing

# module prefix -> layer; the longest matching prefix wins
LAYERS: dict[str, int] = {
    "pdserve.launcher": 1,
    "pdserve.sim": 1,
    "pdserve.loadgen": 1,
    "pdserve.router": 2,
    "pdserve.router.http": 2,
    "pdserve.router.cluster": 2,
    "pdserve.router.placement": 3,
    "pdserve.worker": 4,
    "pdserve.kvtransfer": 4,
    "pdserve": 5,
    "pdserve.kernels": 6,
    "pdserve.loadgen.yamlconfig": 7,
    "pdserve.environment": 7,
}
LAYER_NAMES = {1: "composition root", 2: "router", 3: "placement", 4: "worker/kvtransfer", 5: "engine", 6: "kernels",
               7: "config readers"}


def layer_of(module: str) -> int | None:
    best = None
    for prefix, layer in LAYERS.items():
        if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > len(best[0])):
            best = (prefix, layer)
    return None if best is None else best[1]


def modules(package: str = ROOT) -> dict[str, str]:
    """module name -> path, for every .py file of a package of the namespace (`pdserve.router`)."""
    out = {}
    for directory, _, files in os.walk(os.path.join(REPO, *package.split("."))):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                module = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".").removesuffix(".__init__")
                out[module] = path
    return out


def imported_modules(module: str, path: str, explicit: bool = False) -> list[tuple[str, int]]:
    """(module name, line) of each import in the file, parents included, relative ones resolved;
    with `explicit`, only the modules the statements name (`a.b` of `from a.b import c`)."""
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
            first = len(parts) if explicit else 1
            found += [(".".join(parts[:i]), node.lineno) for i in range(first, len(parts) + 1)]
    return list(dict.fromkeys(found))


def all_modules() -> dict[str, str]:
    return modules(ROOT)


def ours(target: str) -> bool:
    return target == ROOT or target.startswith(ROOT + ".")


def _imports_any_package(module: str, path: str) -> bool:
    return any(ours(target) for target, _ in imported_modules(module, path))


def test_every_module_has_a_layer():
    unassigned = [m for m in all_modules() if layer_of(m) is None]
    assert not unassigned


def test_no_module_imports_from_a_layer_above_it():
    known = all_modules()
    violations = []
    for module, path in sorted(known.items()):
        own = layer_of(module)
        for target, line in imported_modules(module, path):
            if not ours(target):
                continue
            if target not in known and target.rsplit(".", 1)[0] in known and target.rsplit(".", 1)[0] != target:
                continue  # `from pkg import name` where name is not a module: the package counts already
            if known.get(target, "").endswith("__init__.py") and not _imports_any_package(target, known[target]):
                continue  # a package that imports nothing on the way (pdserve.loadgen for its yamlconfig)
            layer = layer_of(target)
            if layer is not None and layer < own:
                violations.append(f"{os.path.relpath(path, REPO)}:{line}: {module} ({LAYER_NAMES[own]}) imports "
                                  f"{target} ({LAYER_NAMES[layer]})")
    assert not violations, "\n".join(violations)


def test_loadgen_imports_none_of_the_server_packages():
    """(pdserve.environment, the reader of the variables it takes too, imports only the standard library.)"""
    violations = [
        f"{module} imports {target}"
        for module, path in modules("pdserve.loadgen").items()
        for target, _ in imported_modules(module, path)
        if ours(target) and target not in (ROOT, "pdserve.environment") and not target.startswith("pdserve.loadgen")
    ]
    assert not violations


def test_the_namespace_root_imports_nothing():
    """`pdserve/__init__.py` binds its names lazily: importing `pdserve.loadgen` or
    `pdserve.kernels` must not run the engine."""
    with open(os.path.join(REPO, "pdserve", "__init__.py"), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    assert not [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]


def test_nothing_but_the_namespace_is_importable_from_the_checkout():
    """The design card's folders live inside the namespace (`pdserve/kernels/`, ...): a top-level
    folder with an `__init__.py` would be importable as `kernels` wherever the checkout is on
    sys.path (pytest's rootdir, `python -m` from it) and would shadow a registry package."""
    packages = sorted(name for name in os.listdir(REPO) if os.path.isfile(os.path.join(REPO, name, "__init__.py")))
    assert packages == ["pdserve", "tests"], packages
    for name in ("kernels", "router", "kvtransfer", "launcher", "sim", "loadgen"):
        proc = subprocess.run([sys.executable, "-c", f"import {name}; print(*{name}.__path__)"], cwd=REPO,
                              capture_output=True, text=True, timeout=60)
        ours_dirs = (os.path.join(REPO, name), os.path.join(REPO, "pdserve"))
        assert not any(path.startswith(ours_dirs) for path in proc.stdout.split()), (name, proc.stdout)


def test_the_config_reader_imports_only_pydantic_and_yaml():
    allowed = {"pydantic", "yaml", "__future__"} | set(sys.stdlib_module_names)
    path = os.path.join(REPO, "pdserve", "loadgen", "yamlconfig.py")
    found = {target for target, _ in imported_modules("pdserve.loadgen.yamlconfig", path)}
    assert {t.split(".")[0] for t in found} <= allowed, found


def _imports_of(package: str) -> list[tuple[str, str, str, int]]:
    """(module, path, imported module, line) for every import of a package's files."""
    return [(module, path, target, line) for module, path in sorted(modules(package).items())
            for target, line in imported_modules(module, path)]


def test_router_http_and_cluster_sides_do_not_import_each_other():
    violations = [
        f"{os.path.relpath(path, REPO)}:{line}: {module} imports {target}"
        for module, path, target, line in _imports_of("pdserve.router")
        for side, other in (("pdserve.router.http", "pdserve.router.cluster"),
                            ("pdserve.router.cluster", "pdserve.router.http"))
        if (module == side or module.startswith(side + ".")) and (target == other or target.startswith(other + "."))
    ]
    assert not violations, "\n".join(violations)


def test_sim_imports_only_placement_of_the_router():
    """The simulator runs the router's placement and nothing else of it (`router` itself is the
    parent package of router.placement, and holds no code)."""
    violations = [
        f"{os.path.relpath(path, REPO)}:{line}: {module} imports {target}"
        for module, path, target, line in _imports_of("pdserve.sim")
        if target.startswith("pdserve.router") and target != "pdserve.router"
        and not (target == "pdserve.router.placement" or target.startswith("pdserve.router.placement."))
    ]
    assert not violations, "\n".join(violations)
    with open(os.path.join(REPO, "pdserve", "router", "__init__.py"), encoding="utf-8") as f:
        assert not [node for node in ast.parse(f.read()).body if isinstance(node, (ast.Import, ast.ImportFrom))]


def import_graph(package: str = ROOT) -> dict[str, set[str]]:
    """module -> the modules (files of `package`) it imports, parent packages included, except
    the module's own enclosing packages: Python runs those before the module whatever it imports,
    so they are no choice of the module's (an explicit `from pkg import name` of one still counts)."""
    known = modules(package)
    graph = {}
    for module, path in known.items():
        edges = set()
        named = imported_modules(module, path, explicit=True)
        submodules = {(target.rsplit(".", 1)[0], line) for target, line in named if target in known}
        for target, line in named:
            if (target, line) in submodules and module.startswith(target + "."):
                continue  # `from pkg import submodule` inside pkg: the package is only the way there
            if target in known and target != module:
                edges.add(target)
        for target, _ in imported_modules(module, path):
            if target in known and target != module and not module.startswith(target + "."):
                edges.add(target)
        graph[module] = edges
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def test_no_import_circle_between_files():
    """No file of the namespace imports, through any chain, a file that imports it back (the
    placement registry imports policies only by name, when it builds one; the KV codec's kernels
    are imported by the cache's FP8 path where they run)."""
    circles = import_circles(import_graph())
    assert not circles, "\n".join(" <-> ".join(c) for c in circles)


def test_the_circle_check_finds_a_circle():
    assert import_circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_circles({"a": {"b"}, "b": set()}) == []


def test_the_check_catches_an_upward_import(tmp_path):
    """The checker itself: an engine module importing the router is reported."""
    path = tmp_path / "engine_mod.py"
    path.write_text("def f():\n    from pdserve.router.http.server import create_app\n")
    targets = [t for t, _ in imported_modules("pdserve.engine_mod", str(path))]
    assert "pdserve.router.http.server" in targets and "pdserve.router" in targets
    assert layer_of("pdserve.engine_mod") == 5 and layer_of("pdserve.router.http.server") == 2
    rel = tmp_path / "__init__.py"
    rel.write_text("from .sub import x\nfrom . import other\n")
    found = {t for t, _ in imported_modules("pdserve.worker", str(rel))}
    assert {"pdserve.worker.sub", "pdserve.worker.other"} <= found


def test_cli_runs_from_its_module_path():
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-m", "pdserve.launcher.cli", "--help"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "generate" in proc.stdout and "up" in proc.stdout


def test_console_script_points_at_the_composition_root():
    import tomllib

    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)
    assert project["project"]["scripts"]["pdserve"] == "pdserve.launcher.cli:main"
    assert project["project"]["scripts"]["pdserve-loadgen"] == "pdserve.loadgen.cli:main"
    assert project["tool"]["setuptools"]["packages"]["find"]["include"] == ["pdserve*"]
