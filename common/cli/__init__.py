"""The ``nanwatch`` command. This module only dispatches: each command is a module of its own (the two
tables below name them), imported when the parser is built or the command runs, and imports nothing
heavy at import time: torch, fastapi and uvicorn are imported inside the command that needs them, so
``nanwatch status`` starts fast anywhere and the trainer-side commands never load the web stack.

Two kinds of command. ``serve``, ``status``, ``directive`` and ``push`` are read by this parser: their
module's ``add_parser(sub)`` adds them. ``demo``, ``bench`` and ``replay`` own their parser: their module's
``main(argv)`` gets the arguments after the command's name, ``--help`` included. Which commands exist is
declared in ``nanwatch.public_api`` (tests/test_public_api.py holds ``nanwatch --help`` to it).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

__all__ = ["main"]

#: commands read by this parser: each module's ``add_parser(sub)`` adds its command
_PARSED = {"serve": "nanwatch.cli.serve_collector", "status": "nanwatch.cli.status",
           "directive": "nanwatch.cli.directive", "push": "nanwatch.cli.push"}

#: commands that own their parser: ``main(argv)`` gets the arguments after the command's name
_DELEGATES = {"demo": ("nanwatch.cli.demo", "train a tiny model into a NaN and back through a directive"),
              "bench": ("nanwatch.bench", "measure the hooks' overhead, or load a collector ('bench collector')"),
              "replay": ("nanwatch.cli.replay_verdict", "re-run an incident capsule's birth module under several "
                         "settings: does the NaN reproduce here, and is it precision or data")}


def _delegate(name: str, argv: list[str]) -> int:
    module = _DELEGATES[name][0]
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:
            raise
        print(f"nanwatch {name}: {module} is not available in this build", file=sys.stderr)
        return 2
    return int(mod.main(argv) or 0)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nanwatch", description="Numerical-health monitoring for PyTorch training.")
    sub = p.add_subparsers(dest="command", required=True)
    for module in _PARSED.values():
        importlib.import_module(module).add_parser(sub)
    for name, (_, help_) in _DELEGATES.items():
        sub.add_parser(name, help=f"{help_} (arguments are passed on: nanwatch {name} --help)", add_help=False)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _DELEGATES:  # their own parser handles the rest, --help included
        return _delegate(argv[0], argv[1:])
    args = _parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
