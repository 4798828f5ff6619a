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
from collections.abc import Iterator
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


def _import_nodes(body: list[ast.stmt], *, import_time: bool) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements in ``body``: all of them, or (``import_time``) those that run when the module
    is imported -- module level, ``try``/``if`` blocks and class bodies, not function bodies nor
    ``if TYPE_CHECKING:`` blocks."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
            continue
        if import_time and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if import_time and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from _import_nodes(node.orelse, import_time=True)
            continue
        yield from _import_nodes([c for c in ast.iter_child_nodes(node) if isinstance(c, (ast.stmt, ast.excepthandler))],
                                 import_time=import_time)


def _imports(name: str, path: Path, *, import_time: bool = False) -> set[str]:
    """Every module ``name`` imports (anywhere in the file, or only at import time), as dotted names."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.stem == "__init__" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in _import_nodes(tree.body, import_time=import_time):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
            continue
        base = node.module or ""
        if node.level:
            anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join([*anchor, base] if base else anchor)
        for alias in node.names:  # ``from pkg import mod`` imports the submodule when there is one
            found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    return found


GRAPH: dict[str, set[str]] = {name: _imports(name, path) for name, path in MODULES.items()}


def _reach(start: str, graph: dict[str, set[str]] | None = None, *, parents: bool = True) -> tuple[set[str], set[str]]:
    """(project modules reachable from ``start`` in ``graph`` (default: every import), third-party
    top-level names they import). A module's parent packages run too when it is imported, so their imports
    count (``parents``), except the root ``nanwatch``, whose only import of another room is lazy (checked
    on its own below)."""
    graph = GRAPH if graph is None else graph
    seen, external, todo = set(), set(), [start]
    while todo:
        mod = todo.pop()
        if mod in seen:
            continue
        seen.add(mod)
        if parents:
            todo.extend(p for p in (".".join(mod.split(".")[:i]) for i in range(2, mod.count(".") + 1))
                        if p in MODULES)
        for imp in graph[mod]:
            if imp in MODULES:
                todo.append(imp)
            elif imp.split(".")[0] != "nanwatch":
                external.add(imp.split(".")[0])
    return seen, external


_NEUTRAL = ("nanwatch.cli", "nanwatch.cli.demo", "nanwatch.bench")


@pytest.mark.parametrize("folder,banned_modules,banned_packages", [
    ("hooks", ("nanwatch.monitor", *_NEUTRAL), WEB_STACK),
    ("monitor", ("nanwatch.hooks", "nanwatch.hooks.integrations", *_NEUTRAL), {"torch", "transformers", "trl"}),
])
def test_each_side_keeps_to_its_room_at_any_depth(folder, banned_modules, banned_packages):
    """A room is a source folder: hooks/ (nanwatch.hooks, including nanwatch.hooks.integrations) or monitor/."""
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
    assert {(n.module, a.name) for n in top if isinstance(n, ast.ImportFrom) for a in n.names} <= {
        ("__future__", "annotations"), ("typing", "TYPE_CHECKING"), ("typing", "Any")}
    assert not [n for n in top if isinstance(n, ast.Import)]


# ---- the layout shows the flow: groups by concern, none importing back up -----------------------------------
#: each side's groups, lowest first. A group may import the groups before it in its list and never one
#: after it; groups in one tuple are siblings and import neither each other. A top-level module is a group
#: of its own (``nanwatch.hooks.facade``), a subpackage is one with everything under it.
LAYERS: dict[str, list[tuple[str, ...]]] = {
    "hooks": [("nanwatch.hooks.failsafe",), ("nanwatch.hooks.config",), ("nanwatch.hooks.measure",),
              ("nanwatch.hooks.directives",), ("nanwatch.hooks.instrument",), ("nanwatch.hooks.forensics",),
              ("nanwatch.hooks.remedies",),
              ("nanwatch.hooks.report",), ("nanwatch.hooks.facade",), ("nanwatch.hooks",),
              ("nanwatch.hooks.integrations",)],
    "monitor": [("nanwatch.monitor.data",), ("nanwatch.monitor.pg",), ("nanwatch.monitor.write", "nanwatch.monitor.read"),
                ("nanwatch.monitor.settings",), ("nanwatch.monitor.web",),
                ("nanwatch.monitor.app",), ("nanwatch.monitor.server",), ("nanwatch.monitor",)],
    "common": [("nanwatch.public_api", "nanwatch.wire"), ("nanwatch.policy", "nanwatch.tokens", "nanwatch.readable", "nanwatch.addresses",
                                         "nanwatch.run_status"),
               ("nanwatch.weight_sync",),
               ("nanwatch.hooks", "nanwatch.monitor"), ("nanwatch",), ("nanwatch.bench",), ("nanwatch.cli",)],
}


#: A feature room: one subpackage that holds a feature's parts across the stages (its measure, classify and
#: report parts), so that a change to the feature is made in one folder. Each of its modules counts as part of
#: the stage group it works at, so the one-way rule holds for a room's parts as for the stage folders, inside the
#: room too (its measure part never imports its report part). A room's module missing here is in no group, which
#: the layer test below names.
ROOM_STAGES: dict[str, str] = {
    "nanwatch.hooks.rollout": "nanwatch.hooks.measure",  # the front door imports nothing
    "nanwatch.hooks.rollout.compare": "nanwatch.hooks.measure",
    "nanwatch.hooks.rollout.generated": "nanwatch.hooks.measure",
    "nanwatch.hooks.rollout.weight_fingerprint": "nanwatch.hooks.measure",
    "nanwatch.hooks.rollout.attribution": "nanwatch.hooks.forensics",
    "nanwatch.hooks.rollout.mismatch": "nanwatch.hooks.report",
    "nanwatch.hooks.rollout.sync_verdict": "nanwatch.hooks.report",
    "nanwatch.hooks.rollout.weight_publish": "nanwatch.hooks.report",
    "nanwatch.hooks.moe": "nanwatch.hooks.measure",  # the front door imports nothing
    "nanwatch.hooks.moe.routers": "nanwatch.hooks.measure",
    "nanwatch.hooks.moe.routes": "nanwatch.hooks.measure",
    "nanwatch.hooks.moe.taps": "nanwatch.hooks.instrument",
    "nanwatch.hooks.moe.report": "nanwatch.hooks.report",
}


def _group(module: str, layers: list[tuple[str, ...]]) -> tuple[int, str] | None:
    """(layer index, group) of ``module``: the longest group name that is the module or a package above it
    (a feature room's module: its stage's group, ``ROOM_STAGES``)."""
    module = ROOM_STAGES.get(module, module)
    found = [(len(g), i, g) for i, groups in enumerate(layers) for g in groups
             if module == g or module.startswith(g + ".")]
    return max(found)[1:] if found else None


def back_edges(graph: dict[str, set[str]], layers: list[tuple[str, ...]]) -> list[str]:
    """Imports that go up a layer, or across to a sibling group."""
    bad = []
    for mod, imports in graph.items():
        here = _group(mod, layers)
        for imp in imports:
            there = _group(imp, layers)
            if here is None or there is None or there[1] == here[1]:
                continue
            if there[0] > here[0] or (there[0] == here[0] and there[1] != here[1]):
                bad.append(f"{mod} -> {imp}")
    return sorted(bad)


def test_no_import_goes_back_up_between_the_groups():
    """Every import counts (function-level and ``TYPE_CHECKING`` ones too): a lazy import back up is still
    a call back up. Both sides' groups, and the root package's contract under its applications."""
    for side in ("hooks", "monitor"):
        graph = {m: i for m, i in GRAPH.items() if MODULES[m].is_relative_to(ROOT / side)}
        assert back_edges(graph, LAYERS[side]) == [], side
        assert all(_group(m, LAYERS[side]) for m in graph), [m for m in graph if not _group(m, LAYERS[side])]
    root = {m: {_side(i) for i in imps} for m, imps in GRAPH.items() if MODULES[m].is_relative_to(ROOT / "common")}
    assert back_edges(root, LAYERS["common"]) == []


def _side(module: str) -> str:
    """A module of hooks/ or monitor/ seen from the root package: its side's package."""
    for side in ("nanwatch.hooks", "nanwatch.monitor"):
        if module == side or module.startswith(side + "."):
            return side
    return module


def test_the_layer_check_can_fail():
    layers = [("a",), ("b", "c"), ("d",)]
    graph = {"a.x": {"b.y"}, "b.y": {"a.x", "c.z"}, "c.z": {"a.x"}, "d": {"b.y", "c.z"}}
    assert back_edges(graph, layers) == ["a.x -> b.y", "b.y -> c.z"]


#: What ``hooks/report`` may import besides itself, and why: the report reads a step's measurements and speaks the
#: wire; a pure helper it needs belongs below it (``measure/``), never in ``remedies/`` or ``forensics/`` (#38).
REPORT_MAY_IMPORT: dict[str, str] = {
    "nanwatch.hooks.measure": "the step's values, decoded, and the pure checks read from them",
    "nanwatch.wire": "the one contract",
    "nanwatch.hooks.failsafe": "monitoring never breaks training: every room's warn-and-carry-on",
    "nanwatch.hooks.config": "the options (each part its own section)",
    "nanwatch.hooks.rollout.mismatch": "the rollout room's classify part, at the report stage",
    "nanwatch.hooks.rollout.sync_verdict": "what the weight sync says, asked by the classify part",
    "nanwatch.hooks.moe.report": "the MoE room's report part: the routers' counts into the wire",
    "nanwatch.readable": "the wording of figures and file names (stdlib only)",
    "nanwatch.addresses": "the transport's collector URL check (stdlib only)",
    "nanwatch.tokens": "the transport's bearer token (stdlib only)",
}
#: The way back, by module: the flow feeds the directive state's clean streak and the local rule engine with
#: each report, and the hand-over reads the directive in force at step end. That is the design's loop from
#: reports to directives, not a helper to move down.
REPORT_WAY_BACK: dict[str, set[str]] = {
    "nanwatch.hooks.report.flow": {"nanwatch.hooks.directives.directive_state", "nanwatch.hooks.directives.local_rules"},
    "nanwatch.hooks.report.handover": {"nanwatch.hooks.directives.directive_state"},
}


def outside_imports(graph: dict[str, set[str]], package: str, allowed: dict[str, str],
                    per_module: dict[str, set[str]]) -> list[str]:
    """Imports of ``package``'s modules that are neither inside it, nor under an ``allowed`` name, nor in the
    module's own ``per_module`` set, nor outside the project and its declared third-party packages (the
    standard library, torch and numpy pass)."""
    bad = []
    for mod, imports in graph.items():
        if not (mod == package or mod.startswith(package + ".")):
            continue
        for imp in imports:
            if imp == package or imp.startswith(package + ".") or imp in per_module.get(mod, set()):
                continue
            if any(imp == a or imp.startswith(a + ".") for a in allowed):
                continue
            top = imp.split(".")[0]
            if top == "nanwatch" or (top in THIRD_PARTY and top not in ("torch", "numpy")):
                bad.append(f"{mod} -> {imp}")
    return sorted(bad)


def test_the_report_imports_only_measure_and_the_wire():
    """Every import counts, lazy ones too; the few other names each say why (``REPORT_MAY_IMPORT``)."""
    assert outside_imports(GRAPH, "nanwatch.hooks.report", REPORT_MAY_IMPORT, REPORT_WAY_BACK) == []


def test_the_report_import_check_can_fail():
    graph = {"nanwatch.hooks.report.a": {"nanwatch.hooks.remedies.x", "nanwatch.hooks.measure.y", "torch", "json",
                                         "fastapi", "nanwatch.hooks.report.b", "nanwatch.hooks.directives.z"},
             "nanwatch.hooks.report.b": {"nanwatch.hooks.directives.z"}, "nanwatch.hooks.measure.y": {"nanwatch.hooks.x"}}
    assert outside_imports(graph, "nanwatch.hooks.report", {"nanwatch.hooks.measure": ""},
                           {"nanwatch.hooks.report.b": {"nanwatch.hooks.directives.z"}}) == [
        "nanwatch.hooks.report.a -> fastapi", "nanwatch.hooks.report.a -> nanwatch.hooks.directives.z",
        "nanwatch.hooks.report.a -> nanwatch.hooks.remedies.x"]


# ---- the collector has one writer: ``monitor.write`` -------------------------------------------------------------
#: calls that change a set, dict, list or counter in place
_MUTATORS = {"add", "update", "difference_update", "discard", "pop", "popitem", "clear", "append", "extend",
             "remove", "setdefault", "insert", "move_to_end"}
#: the names the collector's state goes by in the modules that read it
_STATE_NAMES = {"state", "run", "st", "rank_state"}


def _reaches_state(node: ast.expr) -> bool:
    """``node`` is a part of the collector's state: an attribute or item of a state name, or of an attribute
    named ``state``/``_state`` (``res.state.requests``), not that name itself (``self._state = state``)."""
    attrs = []
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        attrs.append(node.attr if isinstance(node, ast.Attribute) else "[]")
        node = node.value
    return bool(attrs) and (isinstance(node, ast.Name) and node.id in _STATE_NAMES
                            or any(a in ("state", "_state") for a in attrs[1:]))


def state_writes(source: str) -> list[str]:
    """Where ``source`` assigns to a part of the collector's state or changes one in place."""
    out = []
    for n in ast.walk(ast.parse(source)):
        targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, ast.AugAssign) else []
        for t in targets:
            out += [f"{n.lineno}: {ast.unparse(e)}" for e in (t.elts if isinstance(t, ast.Tuple) else [t])
                    if isinstance(e, (ast.Attribute, ast.Subscript)) and _reaches_state(e)]
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in _MUTATORS \
                and _reaches_state(n.func.value):
            out.append(f"{n.lineno}: {ast.unparse(n.func)}")
    return out


def test_only_write_changes_the_collectors_state():
    """The readers (``read``: the exporter and the API's views) and the web layer never write the state: what
    a render marks shown, the render errors and the refusals are written by ``write`` (``write.exposure``,
    ``write.requests``), handed in where a reader needs them."""
    found = {name: w for name, path in MODULES.items()
             if name.startswith(("nanwatch.monitor.read", "nanwatch.monitor.web"))
             for w in [state_writes(path.read_text())] if w}
    assert found == {}


def test_the_state_write_check_can_fail():
    assert state_writes("run.newborn.add(k)\nstate.writes += 1\nres.state.requests.rejected[r] += 1\n"
                        "self._state = state\nx = run.counters.get(k)\n") == [
        "2: state.writes", "3: res.state.requests.rejected[r]", "1: run.newborn.add"]


def test_each_top_level_holds_at_most_ten_modules():
    for folder in ("hooks", "monitor", "common"):
        top = sorted(p.name for p in (ROOT / folder).glob("*.py"))
        assert len(top) <= 10, (folder, top)


def test_frameworks_are_only_imported_lazily_by_the_trainer_side():
    for name, path in MODULES.items():
        if path.is_relative_to(ROOT / "hooks"):
            top = ast.parse(path.read_text()).body
            names = {a.name for n in top if isinstance(n, ast.Import) for a in n.names}
            names |= {n.module for n in top if isinstance(n, ast.ImportFrom) and n.module}
            assert not {n for n in names if n.split(".")[0] in ("transformers", "trl", "accelerate", "lightning",
                                                                  "pytorch_lightning")}, name


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


# ---- each leaf imports with its own dependencies alone ----------------------------------------------------
#: third-party packages a shipped module may need; the rest of the environment is never blocked
THIRD_PARTY = {"torch", "numpy", "fastapi", "starlette", "uvicorn", "httptools", "uvloop", "prometheus_client",
               "pydantic_settings", "transformers", "trl", "accelerate", "datasets", "httpx", "yaml",
               "safetensors", "tensorboard", "grafana_foundation_sdk", "lightning", "pytorch_lightning"}
#: what a package brings along when it is imported (so allowing it allows these)
_BRINGS = {"torch": {"numpy"}, "fastapi": {"starlette"}, "uvicorn": {"httptools", "uvloop"}}
#: the trainers an integration module hooks into (imported through a function, so the scan cannot see them)
FRAMEWORKS = {"transformers", "trl", "accelerate", "datasets", "safetensors", "torch", "httpx", "yaml",
              "lightning", "pytorch_lightning"}
#: the dependencies a side's modules may need at all (pydantic and the standard library always)
SIDE_DEPS = {
    "hooks": {"torch", "numpy"},
    "monitor": {"fastapi", "starlette", "uvicorn", "httptools", "uvloop", "prometheus_client", "pydantic_settings"},
}


IMPORT_TIME = {name: _imports(name, path, import_time=True) for name, path in MODULES.items()}


# ---- how deep the trainer's imports go -------------------------------------------------------------------
def longest_chain(graph: dict[str, set[str]], members: set[str]) -> list[str]:
    """The longest path of imports among ``members``, as module names, first the importer (the graph has no
    cycle: tested above). Its length is how many modules a change at its bottom can ripple through."""
    memo: dict[str, list[str]] = {}

    def walk(mod: str) -> list[str]:
        if mod not in memo:
            memo[mod] = [mod, *max((walk(i) for i in sorted(graph[mod]) if i in members and i != mod), key=len,
                                   default=[])]
        return memo[mod]

    return max((walk(m) for m in sorted(members)), key=len)


#: The trainer's modules: the hooks side and the shared modules it imports (not the CLI, benches or collector).
TRAINER = {m for m in MODULES if not m.startswith(("nanwatch.monitor", "nanwatch.cli", "nanwatch.bench"))}
#: An alarm, not a target: a longer chain asks whether a module imports what it should not. #38 measured 13 at
#: import time (integrations -> facade -> handover -> flow -> job -> job_stats -> loss_scaling -> weight_guard ->
#: directive_state -> mode_effects -> recorder -> optimizer_check -> wire), 14 counting lazy imports; 10 and 11 once the
#: pure helpers moved down (the report reaches no remedy, the recorder no optimizer check); 7 and 8 once the facade
#: became the composition root (integrations -> facade -> rerun -> directive_state -> agreement -> decision -> wire;
#: counting lazy imports, ``nanwatch -> hooks ->`` above the facade): it builds the rooms' parts and hands each its
#: collaborators (the flow its builder and job reporting, the remedies how to make the rerun and the replica check,
#: patching the SDPA probe's body), and a part types what it is handed by what it asks of it (a small Protocol),
#: since an import under ``TYPE_CHECKING`` still counts in the every-import graph.
MAX_CHAIN = {"import time": 7, "every import": 8}


def test_the_trainers_longest_import_chain_stays_short():
    """Printed with ``-s``: both chains, for the record."""
    for name, graph in (("import time", IMPORT_TIME), ("every import", GRAPH)):
        chain = longest_chain(graph, TRAINER)
        print(f"{name}: {len(chain)} modules: {' -> '.join(chain)}")
        assert len(chain) <= MAX_CHAIN[name], f"{name}: {len(chain)} modules: {' -> '.join(chain)}"


def test_the_chain_finder_finds_the_longest():
    graph = {"a": {"b", "c"}, "b": {"d"}, "c": set(), "d": {"e", "x"}, "e": set(), "x": set()}
    assert longest_chain(graph, {"a", "b", "c", "d", "e"}) == ["a", "b", "d", "e"]


def own_dependencies(module: str) -> set[str]:
    """The third-party packages ``module`` itself needs: those it and the project modules it imports at
    import time import, transitively -- not those of the packages above it, which must not add any."""
    deps = _reach(module, IMPORT_TIME, parents=False)[1] & THIRD_PARTY
    if ".integrations." in module:  # an integration needs the framework it integrates, found at import
        deps |= FRAMEWORKS
    for dep in list(deps):
        deps |= _BRINGS.get(dep, set())
    return deps


_PROBE = r"""
import importlib, json, os, sys
jobs = json.loads(sys.argv[1])
import pydantic  # noqa: F401 - every module may use it
for name in jobs[0][1]:  # the group's own dependencies, imported once before forking (they are allowed)
    importlib.import_module(name)
known = set(json.loads(sys.argv[2]))
failures = {}
for module, allowed in jobs:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            importlib.import_module(module)
            loaded = {m.split(".")[0] for m in list(sys.modules)} & known
            msg = ", ".join(sorted(loaded - set(allowed)))
            msg = f"loaded {msg}" if msg else ""
        except BaseException as e:
            msg = f"{type(e).__name__}: {e}"
        os.write(w, msg.encode()[:500])
        os._exit(0)
    os.close(w)
    msg = os.read(r, 600).decode()
    os.close(r)
    os.waitpid(pid, 0)
    if msg:
        failures[module] = msg
print(json.dumps(failures))
"""


def test_each_shipped_module_imports_with_only_its_own_dependencies():
    """A module's package ``__init__`` files must not make it need more than it uses: the collector's store
    imports without the web stack, the trainer's transport without torch, the wire with pydantic alone.
    Each module is imported in a fresh (forked) interpreter, which must then hold no third-party package
    the project knows of beyond the module's own."""
    if not hasattr(__import__("os"), "fork"):
        pytest.skip("needs fork")
    for side, allowed in SIDE_DEPS.items():
        for mod, path in MODULES.items():
            if path.is_relative_to(ROOT / side) and ".integrations." not in mod:
                extra = own_dependencies(mod) - allowed
                assert not extra, f"{mod} needs {sorted(extra)}, beyond the {side} side's dependencies"
    import json

    groups: dict[frozenset[str], list[str]] = defaultdict(list)
    for mod in MODULES:  # an integration needs a whole training stack: checked statically above, not here
        if ".integrations." not in mod and not mod.endswith(".__main__"):  # a __main__ runs its program
            groups[frozenset(own_dependencies(mod))].append(mod)
    failures = {}
    for deps, members in groups.items():
        jobs = [(m, sorted(deps)) for m in members]
        out = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(jobs), json.dumps(sorted(THIRD_PARTY))],
                             capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert out.returncode == 0, out.stderr
        failures |= json.loads(out.stdout.strip().splitlines()[-1])
    assert failures == {}


def test_the_leaves_that_promise_no_torch_or_web_stack_keep_it():
    """The light leaves named in their docstrings, checked by name so that a regression is not hidden by
    the dependency scan above growing with it."""
    assert own_dependencies("nanwatch.wire") == set()
    assert own_dependencies("nanwatch.policy") == set()
    assert own_dependencies("nanwatch.tokens") == set()
    for light in ("nanwatch.hooks", "nanwatch.hooks.report.transport", "nanwatch.hooks.directives.decision",
                  "nanwatch.hooks.measure.call_stack", "nanwatch.hooks.directives.local_rules", "nanwatch.bench.tiny_models"):
        assert own_dependencies(light) == set(), light
    for write_path in ("data.store", "data.state", "write.ledger", "write.fold", "write.directive_rules", "web.body",
                       "data.event_log", "data.directive_log"):
        assert own_dependencies(f"nanwatch.monitor.{write_path}") == set(), write_path


#: the commands a trainer's machine runs: they never reach the collector or its web stack, at any depth
TRAINER_COMMANDS = ("nanwatch.cli.status", "nanwatch.cli.directive", "nanwatch.cli.push",
                    "nanwatch.cli.replay_verdict")


def test_the_cli_only_dispatches_and_its_trainer_commands_keep_off_the_web_stack():
    """``nanwatch.cli`` imports no command at import time (each is imported when it runs or the parser is
    built), every command module imports nothing third-party at import time, and the trainer-side commands
    never reach ``nanwatch.monitor`` or the web stack, lazily either."""
    commands = [m for m in MODULES if m.startswith("nanwatch.cli.") and m != "nanwatch.cli.__main__"]
    assert set(TRAINER_COMMANDS) <= set(commands), commands
    assert not {m for m in IMPORT_TIME["nanwatch.cli"] if m.startswith("nanwatch")}, IMPORT_TIME["nanwatch.cli"]
    for mod in ["nanwatch.cli", *commands]:
        assert own_dependencies(mod) == set(), mod
    for mod in TRAINER_COMMANDS:
        reached, external = _reach(mod)
        assert not [r for r in reached if r.startswith("nanwatch.monitor")], mod
        assert not external & WEB_STACK, mod


# ---- collaborators talk through methods, not through each other's privates --------------------------------
def _private_names_by_class() -> dict[str, set[str]]:
    """For each private name (``_x``, not dunder) the project's classes define -- methods, class attributes
    and ``self._x = ...`` assignments -- the classes that define it."""
    owners: dict[str, set[str]] = defaultdict(set)
    for path in MODULES.values():
        for cls in (n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)):
            for node in ast.walk(cls):
                name = None
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node in cls.body:
                    name = node.name
                elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                      and isinstance(node.value, ast.Name) and node.value.id == "self"):
                    name = node.attr
                elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node in cls.body:
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    for t in targets:
                        if isinstance(t, ast.Name) and t.id.startswith("_") and not t.id.startswith("__"):
                            owners[t.id].add(cls.name)
                if name and name.startswith("_") and not name.startswith("__"):
                    owners[name].add(cls.name)
    return owners


def private_reach(tree: ast.AST, owners: dict[str, set[str]]) -> list[str]:
    """``x._name`` where ``_name`` is a private of one of the project's classes and the access is not made
    from inside a class that defines it (``self._x``, or ``other._x`` within the same class); and
    ``from nanwatch... import _name``."""
    bad = []

    def visit(node: ast.AST, inside: str | None) -> None:
        if isinstance(node, ast.ClassDef):
            inside = node.name
        if (isinstance(node, ast.Attribute) and node.attr in owners
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
                and inside not in owners[node.attr]):
            bad.append(f"line {node.lineno}: {ast.unparse(node)}")
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("nanwatch"):
            bad.extend(f"line {node.lineno}: import {a.name}" for a in node.names
                       if a.name.startswith("_") and not a.name.startswith("__"))
        for child in ast.iter_child_nodes(node):
            visit(child, inside)

    visit(tree, None)
    return bad


def test_no_module_touches_another_classs_private_attributes():
    owners = _private_names_by_class()
    found = {name: hits for name, path in MODULES.items() if (hits := private_reach(ast.parse(path.read_text()), owners))}
    assert found == {}


def test_the_private_reach_check_can_fail():
    tree = ast.parse("class A:\n    def __init__(self):\n        self._buf = 1\n\ndef f(a):\n    return a._buf\n"
                     "class B:\n    def g(self, a):\n        return a._buf\nfrom nanwatch.x import _y\n")
    assert private_reach(tree, {"_buf": {"A"}}) == ["line 6: a._buf", "line 9: a._buf", "line 10: import _y"]


# ---- the glossary's words and the README's map match the tree ------------------------------------------------
README = (ROOT / "README.md").read_text()
GLOSSARY = (ROOT / "docs" / "glossary.md").read_text()


def _readme_table(heading: str, text: str = README) -> list[list[str]]:
    """The rows of the first table under ``## heading`` in ``text``, as cells (header and rule dropped)."""
    section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    return [[c.strip() for c in row.strip("|").split("|")] for row in rows[2:]]


def _definitions() -> dict[str, list[tuple[str, ast.AST]]]:
    """Top-level classes, functions and assigned names of every shipped module, by name."""
    out: dict[str, list[tuple[str, ast.AST]]] = defaultdict(list)
    for mod, path in MODULES.items():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                out[node.name].append((mod, node))
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    if isinstance(t, ast.Name):
                        out[t.id].append((mod, node))
    return out


def test_each_word_of_the_glossary_is_defined_once_where_it_says():
    defs = _definitions()
    rows = _readme_table("Words", GLOSSARY)
    assert len(rows) >= 7, rows
    for word, _, where in rows:
        for dotted in (w.strip(" `") for w in where.split(",")):
            module = max((m for m in MODULES if dotted.startswith(m + ".")), key=len)
            name, _, attr = dotted[len(module) + 1:].partition(".")
            places = [m for m, _ in defs[name]]
            assert places == [module], f"{word}: {name} is defined in {places}, the glossary says {module}"
            if attr:
                (node,) = [n for _, n in defs[name]]
                members = {getattr(b, "name", None) for b in node.body} | {
                    b.target.id for b in node.body if isinstance(b, ast.AnnAssign) and isinstance(b.target, ast.Name)}
                assert attr in members, f"{word}: {name} has no {attr}"


#: a word of the glossary -> the only classes whose names may contain it
WORD_OWNERS = {"Policy": set(), "Monitor": {"Monitor", "MonitorConfig"},
               "Collector": {"CollectorState", "CollectorProcess"}, "Ledger": {"Ledger"}}


def test_no_class_borrows_a_word_of_the_glossary():
    defs = _definitions()
    for word, owners in WORD_OWNERS.items():
        borrowers = {n for n, places in defs.items() if word in n
                     and any(isinstance(node, ast.ClassDef) for _, node in places)}
        assert borrowers <= owners, (word, sorted(borrowers - owners))


def test_the_readme_map_lists_every_shipped_module():
    listed: set[Path] = set()
    folder = None
    for cells in _readme_table("Layout"):
        if cells[0]:  # a folder's first row names it; a row without one continues the folder above
            folder = cells[0].split("`")[1] if cells[0].startswith("`") else folder
        listed |= {ROOT / folder / n.strip(" `") for n in cells[1].split(",") if n.strip(" `").endswith(".py")}
    shipped = set(MODULES.values())
    assert shipped - listed == set(), sorted(str(p.relative_to(ROOT)) for p in shipped - listed)
    assert listed - shipped == set(), sorted(str(p.relative_to(ROOT)) for p in listed - shipped)


# ---- one word, one meaning ---------------------------------------------------------------------------------
def _identifiers(tree: ast.AST) -> set[str]:
    """The names a module gives: classes, functions, arguments, keywords, assigned names and attributes."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.keyword) and node.arg:
            names.add(node.arg)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
    return names


#: a glossary word -> (modules where it may name anything, the other names that may contain it). "guard" is
#: the weight guard alone (``weight_guard`` anywhere; the bare word in the names listed, each the weight
#: guard's: its option, its reduction, its slot); "replay" a capsule's replay alone (the differential re-run is "rerun", an
#: HTTP retry a "resend"); a heartbeat is never a "beat". Routing replay (R3, #39) is the field's own name for
#: reusing the rollout's MoE routes: its option, mode type and gauge keep the name users search for.
WORD_PLACES: dict[str, tuple[tuple[str, ...], set[str]]] = {
    "guard": (("nanwatch.hooks.remedies.weight_guard", "nanwatch.bench.guard"),
              {"GUARD_SKIPPED", "GuardChoice", "guard", "guard_reduce", "guard_skipped"}),
    "replay": (("nanwatch.hooks.forensics.replay", "nanwatch.hooks.forensics.capsule", "nanwatch.cli"),
               {"REPLAY_TRY", "replay_command", "routing_replay", "RoutingReplay", "MOE_REPLAY_NOT_APPLIED"}),
    "beat": ((), set()),
}


def misused_words(module: str, names: set[str]) -> list[str]:
    bad = []
    for word, (homes, allowed) in WORD_PLACES.items():
        if module.startswith(homes):
            continue
        for name in names:
            lowered = name.lower().replace("heartbeat", "").replace("weight_guard", "").replace("weightguard", "")
            if word in lowered and name not in allowed:
                bad.append(f"{module}: {name}")
    return sorted(bad)


def test_no_module_uses_a_glossary_word_for_another_thing():
    found = [b for mod, path in MODULES.items() for b in misused_words(mod, _identifiers(ast.parse(path.read_text())))]
    assert found == []


def test_the_word_check_can_fail():
    assert misused_words("nanwatch.monitor.x", {"IngressGuard", "beat_seq", "heartbeat_s", "_replay"}) == [
        "nanwatch.monitor.x: IngressGuard", "nanwatch.monitor.x: _replay", "nanwatch.monitor.x: beat_seq"]


# ---- small pieces: a class one sitting can hold, a function one screen can -----------------------------------
#: Alarms, not targets. A class over ``MAX_METHODS`` methods or a function over ``MAX_FUNCTION_LINES`` lines
#: asks for a review of its concerns, nothing more: split it where it holds two responsibilities (as the
#: recorder's evaluation windows went to ``instrument/eval_windows.py``), or, where the review finds one concern,
#: list it in ``REVIEWED`` with what the review found. Never cut a class or pad one to land under a number: a
#: class at exactly the limit is the smell these numbers were meant to catch (#38).
MAX_METHODS, MAX_FUNCTION_LINES = 20, 60
#: "module: class Name" or "module: function_name" -> what the review found (one concern, and why it is large)
REVIEWED: dict[str, str] = {
    "nanwatch.hooks.facade: class Monitor": "the public facade: one method per user-facing verb (attach, step, "
    "watch, rlhf, publish_weights, guard, ..., and #39's routes); its bodies are one-line hand-offs to the parts",
    "nanwatch.monitor.data.store: class Store": "the SQLite store: one method per operation of the DurableStore "
    "interface (#40 added the weight-sync rows' put and delete), each a statement or two; one concern, the SQL",
    "nanwatch.monitor.pg.database: class PgStore": "the PostgreSQL store: the same DurableStore operations as "
    "Store, method for method, plus the replicas' changed_runs; one concern, the SQL",
}


def oversized(tree: ast.AST, where: str) -> list[str]:
    """Classes with more than ``MAX_METHODS`` methods and functions longer than ``MAX_FUNCTION_LINES`` lines."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            methods = [b for b in node.body if isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef))]
            if len(methods) > MAX_METHODS:
                found.append(f"{where}: class {node.name} has {len(methods)} methods")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1
            if lines > MAX_FUNCTION_LINES:
                found.append(f"{where}: {node.name} is {lines} lines")
    return found


def test_no_class_over_twenty_methods_and_no_function_over_sixty_lines():
    """The alarm: what it names wants a review (see ``MAX_METHODS``), not a trim to the number."""
    found = [f for name, path in MODULES.items() for f in oversized(ast.parse(path.read_text()), name)]
    assert [f for f in found if f.rsplit(" has ", 1)[0].rsplit(" is ", 1)[0] not in REVIEWED] == [], (
        "review each: split by responsibility, or list it in REVIEWED with why it is one concern")


def test_the_size_check_can_fail():
    body = "\n".join(f"    def m{i}(self):\n        pass" for i in range(21))
    long = "def f():\n" + "    x = 1\n" * 60
    assert oversized(ast.parse(f"class C:\n{body}\n{long}"), "m") == ["m: class C has 21 methods", "m: f is 61 lines"]
