"""The import rules are part of the architecture: ruff's banned-api rule keeps bare `hooks`/`monitor` out,
and the two sides keep to their rooms (hooks never imports the web stack, monitor never imports torch)."""

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _imports(folder: str, *, top_level_only: bool = False) -> set[str]:
    names = set()
    for path in (ROOT / folder).rglob("*.py"):
        tree = ast.parse(path.read_text(), str(path))
        for node in (tree.body if top_level_only else ast.walk(tree)):
            if isinstance(node, ast.Import):
                names.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module.split(".")[0])
    return names


def test_ruff_passes_including_the_banned_bare_imports():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed")
    out = subprocess.run([ruff, "check", str(ROOT)], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr


def test_each_side_keeps_to_its_room():
    assert not _imports("monitor") & {"torch", "transformers"}
    assert not _imports("hooks") & {"fastapi", "starlette", "uvicorn", "prometheus_client"}
    # transformers is optional: only imported lazily, inside the functions that need it
    assert "transformers" not in _imports("hooks", top_level_only=True)
