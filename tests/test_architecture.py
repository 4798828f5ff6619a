"""The architecture, enforced: who may import whom, no import cycles, one name per file, and a wheel that
ships the product only.

* ``nanwatch.hooks`` (trainer side) never reaches the web stack or ``nanwatch.monitor``, at any depth;
  ``nanwatch.monitor`` (collector) never reaches torch or ``nanwatch.hooks``. Every import counts:
  module-level, function-level and ``TYPE_CHECKING`` ones.
* The project's modules import each other without a cycle.
* ruff passes, including the banned bare ``hooks``/``monitor``/``common`` imports.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import zipfile
from collections import defaultdict
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
_PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
#: installed package name -> source folder, as setuptools maps them
PACKAGE_DIRS: dict[str, str] = _PYPROJECT["tool"]["setuptools"]["package-dir"]
PACKAGES: list[str] = _PYPROJECT["tool"]["setuptools"]["packages"]
WEB_STACK = {"fastapi", "starlette", "uvicorn", "prometheus_client"}


def _source_folder(package: str) -> Path:
    """Where setuptools takes ``package`` from (the longest package-dir prefix that maps it)."""
    base = max((p for p in PACKAGE_DIRS if package == p or package.startswith(p + ".")), key=len)
    rest = package[len(base):].lstrip(".")
    return ROOT / PACKAGE_DIRS[base] / Path(*rest.split(".")) if rest else ROOT / PACKAGE_DIRS[base]


def _modules() -> dict[str, Path]:
    """Every shipped module: installed dotted name -> source file."""
    out = {}
    for package in PACKAGES:
        folder = _source_folder(package)
        for path in folder.glob("*.py"):
            out[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """Every module ``name`` imports, anywhere in the file, resolved to dotted names."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.stem == "__init__" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:  # ``from pkg import mod`` imports the submodule when there is one
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    return found


GRAPH: dict[str, set[str]] = {name: _imports(name, path) for name, path in MODULES.items()}


def _reach(start: str) -> tuple[set[str], set[str]]:
    """(project modules reachable from ``start``, third-party top-level names they import). A module's
    parent packages run too when it is imported, so their imports count, except the root ``nanwatch``,
    whose only import of another room is lazy (checked on its own below)."""
    seen, external, todo = set(), set(), [start]
    while todo:
        mod = todo.pop()
        if mod in seen:
            continue
        seen.add(mod)
        parents = [".".join(mod.split(".")[:i]) for i in range(2, mod.count(".") + 1)]
        todo.extend(p for p in parents if p in MODULES)
        for imp in GRAPH[mod]:
            if imp in MODULES:
                todo.append(imp)
            elif imp.split(".")[0] != "nanwatch":
                external.add(imp.split(".")[0])
    return seen, external


_NEUTRAL = ("nanwatch.cli", "nanwatch.demo", "nanwatch.bench")


@pytest.mark.parametrize("folder,banned_modules,banned_packages", [
    ("hooks", ("nanwatch.monitor", *_NEUTRAL), WEB_STACK),
    ("monitor", ("nanwatch.hooks", "nanwatch.integrations", *_NEUTRAL), {"torch", "transformers", "trl"}),
])
def test_each_side_keeps_to_its_room_at_any_depth(folder, banned_modules, banned_packages):
    """A room is a source folder: hooks/ (nanwatch.hooks and nanwatch.integrations) or monitor/."""
    members = [m for m, path in MODULES.items() if path.is_relative_to(ROOT / folder)]
    assert len(members) > 5, members
    for mod in members:
        reached, external = _reach(mod)
        bad = sorted(r for r in reached if r.startswith(banned_modules))
        assert not bad, f"{mod} reaches {bad}"
        assert not external & banned_packages, f"{mod} reaches {sorted(external & banned_packages)}"


def test_the_wire_imports_pydantic_alone():
    reached, external = _reach("nanwatch.wire")
    assert reached == {"nanwatch.wire"} and external <= {"pydantic", "typing", "__future__"}, (reached, external)


def test_the_root_package_imports_nothing_at_import_time():
    tree = ast.parse(MODULES["nanwatch"].read_text())
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert {n.module for n in top if isinstance(n, ast.ImportFrom)} <= {"__future__", "typing"}
    assert not [n for n in top if isinstance(n, ast.Import)]


def test_frameworks_are_only_imported_lazily_by_the_trainer_side():
    for name, path in MODULES.items():
        if path.is_relative_to(ROOT / "hooks"):
            top = ast.parse(path.read_text()).body
            names = {a.name for n in top if isinstance(n, ast.Import) for a in n.names}
            names |= {n.module for n in top if isinstance(n, ast.ImportFrom) and n.module}
            assert not {n for n in names if n.split(".")[0] in ("transformers", "trl", "accelerate")}, name


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module, or with a self-edge (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph[v]:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_among_the_projects_modules():
    assert _cycles(GRAPH) == []


def test_the_cycle_finder_finds_a_cycle():  # so that the test above can fail
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_two_shipped_files_share_a_name():
    names = defaultdict(list)
    for name, path in MODULES.items():
        if path.stem != "__init__":
            names[path.name].append(name)
    assert {n: m for n, m in names.items() if len(m) > 1} == {}


def test_ruff_passes_including_the_banned_bare_imports():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed")
    out = subprocess.run([ruff, "check", str(ROOT)], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.slow
def test_the_wheel_ships_the_product_and_nothing_else(tmp_path):
    # built from a copy without the checkout's build/ (setuptools reuses it: a deleted module would ship)
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__",
                                                             ".*_cache", ".hypothesis"))
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(src)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    (wheel,) = tmp_path.glob("nanwatch-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    shipped = {n for n in names if not n.startswith("nanwatch-")}
    expected = {f"{'/'.join(m.split('.'))}{'/__init__' if p.stem == '__init__' else ''}.py"
                for m, p in MODULES.items()}
    assert shipped == expected, (sorted(shipped - expected), sorted(expected - shipped))
    assert not [n for n in shipped if "test" in n or "loadgen" in n]
    # every source file of the product folders is a listed module (a forgotten subpackage would not ship)
    sources = {p for folder in set(PACKAGE_DIRS.values()) for p in (ROOT / folder).rglob("*.py")}
    assert sources == set(MODULES.values()), sorted(map(str, sources - set(MODULES.values())))
