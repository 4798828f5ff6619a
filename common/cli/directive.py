"""``nanwatch directive set|clear RUN``: issue a run's directive, or go back to mode ``none``, at a collector
(admin token). Standard library only.

Example usage::

    nanwatch directive set grpo-0412 fp32 --apply-at-step 1200 --revert-after 500 --reason "logit growth"
    nanwatch directive clear grpo-0412
"""

from __future__ import annotations

import argparse
import os

from nanwatch.cli.calls import BAD_ANSWER, call, default_url, fail, say
from nanwatch.wire import MODES

__all__ = ["add_parser", "directive_command"]


def add_parser(sub) -> None:
    """The ``directive`` subcommand (with its ``set`` and ``clear``), on the ``nanwatch`` parser's subparsers."""
    s = sub.add_parser("directive", help="set or clear a run's directive (admin token)")
    dsub = s.add_subparsers(dest="action", required=True)
    for name, help_ in (("set", "issue a directive"), ("clear", "go back to mode none")):
        d = dsub.add_parser(name, help=help_)
        d.add_argument("run", help="run id")
        if name == "set":
            d.add_argument("mode", choices=MODES)
            d.add_argument("--apply-at-step", type=int)
            d.add_argument("--revert-after", type=int, help="revert after this many clean steps")
            d.add_argument("--reason")
        d.add_argument("--url", default=default_url())
        d.add_argument("--admin-token", help="default: NANWATCH_ADMIN_TOKEN")
        d.set_defaults(func=directive_command)


def directive_command(args: argparse.Namespace) -> int:
    token = args.admin_token or os.environ.get("NANWATCH_ADMIN_TOKEN")
    url = f"{args.url.rstrip('/')}/v1/directives/{args.run}"
    if args.action == "set":
        spec = {"mode": args.mode, "reason": args.reason or "set from the CLI"}
        if args.apply_at_step is not None:
            spec["apply_at_step"] = args.apply_at_step
        if args.revert_after is not None:
            spec["revert_after_clean_steps"] = args.revert_after
        d = call("PUT", url, token, spec)
    else:
        d = call("DELETE", url, token)
    try:
        line = f"run {d['run_id']}: directive v{d['version']} {d['mode']} from step {d['apply_at_step']}"
    except BAD_ANSWER as e:
        fail(f"nanwatch directive: the collector's answer lacks or mistypes a field: {e!r:.200}")
    say(line)
    return 0
