"""The public API is declared once (``nanwatch.public_api``), and everything else agrees with it: docs/api.md
lists exactly its names and commands, each name imports, the public packages' ``__all__`` export nothing
undeclared, and ``nanwatch --help`` offers exactly its commands."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

from nanwatch.public_api import COMMANDS, NAMES

ROOT = Path(__file__).resolve().parents[1]
API_PAGE = ROOT / "docs" / "api.md"
#: the packages users import public names from (``from nanwatch.hooks import *`` gives their ``__all__``)
PUBLIC_PACKAGES = ("nanwatch", "nanwatch.hooks", "nanwatch.monitor")


def listed(text: str, heading: str) -> list[str]:
    """The code span that opens each row of the table under ``## heading`` (header and rule dropped)."""
    section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")][2:]
    return [m.group(1) if (m := re.match(r"\|\s*`([^`]+)`\s*\|", row)) else row for row in rows]


def resolve(dotted: str) -> object:
    """The object a dotted name names: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


def test_the_page_lists_the_declared_names_and_commands_and_nothing_else():
    text = API_PAGE.read_text()
    assert listed(text, "Python") == list(NAMES)
    assert listed(text, "Command line") == [f"nanwatch {c}" for c in COMMANDS]


def test_the_page_check_can_fail():
    text = "# API\n\n## Python\n\n| name | what |\n|---|---|\n| `a.b` | x |\n| c.d | y |\n\n## Other\n"
    assert listed(text, "Python") == ["a.b", "| c.d | y |"]


@pytest.mark.parametrize("dotted", NAMES)
def test_each_declared_name_imports(dotted):
    obj = resolve(dotted)
    assert callable(obj), dotted  # every public name is a function or a class


def test_the_public_packages_export_only_declared_names():
    """A name in a public package's ``__all__`` is declared there, or is the same object as a declared name
    (``nanwatch.hooks.attach`` is ``nanwatch.attach``: one API, not two)."""
    declared = {id(resolve(d)) for d in NAMES}
    for package in PUBLIC_PACKAGES:
        module = importlib.import_module(package)
        extra = [n for n in module.__all__ if not n.startswith("__") and f"{package}.{n}" not in NAMES
                 and id(getattr(module, n)) not in declared]
        assert extra == [], f"{package}.__all__ exports {extra}: declare them in nanwatch.public_api, or drop them"


def test_nanwatch_help_offers_exactly_the_declared_commands():
    out = subprocess.run([sys.executable, "-m", "nanwatch.cli", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    choices = re.search(r"\{([a-z,]+)\}", out.stdout)
    assert choices is not None, out.stdout
    assert tuple(choices.group(1).split(",")) == COMMANDS
