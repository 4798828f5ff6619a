"""The ``nanwatch`` command. Imports nothing heavy at import time: torch, fastapi and uvicorn are imported
inside the subcommand that needs them (through nanwatch.monitor.server, nanwatch.cli.demo, nanwatch.bench),
so ``nanwatch status`` starts fast anywhere.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Sequence

from nanwatch.tokens import token_from_env
from nanwatch.wire import MODES

__all__ = ["main"]

_DEFAULT_URL = "http://127.0.0.1:8000"


def _serve(args: argparse.Namespace) -> int:
    from nanwatch.monitor import Settings
    from nanwatch.monitor.server import serve

    given = (("host", args.host), ("port", args.port), ("db_path", args.db), ("tls_cert_file", args.tls_cert),
             ("tls_key_file", args.tls_key))
    overrides = {k: v for k, v in given if v is not None}
    try:
        settings = Settings(**overrides)
        serve(settings)
    except ValueError as e:
        print(f"nanwatch serve: {e}", file=sys.stderr)
        return 2
    return 0


def _call(method: str, url: str, token: str | None, body: dict | None = None) -> dict:
    req = urllib.request.Request(url, method=method, data=None if body is None else json.dumps(body).encode())
    req.add_header("Content-Type", "application/json")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as e:
        detail = e.read().decode("utf-8", "replace")
        raise SystemExit(f"nanwatch: {method} {url} -> HTTP {e.code}: {detail}") from None
    except OSError as e:
        raise SystemExit(f"nanwatch: cannot reach the collector at {url}: {e}") from None


def _runs(base: str, token: str | None) -> Iterator[dict]:
    """Every run the token may read, following ``GET /v1/runs`` pages (``next_after``) to the last."""
    after = ""
    while True:
        page = _call("GET", f"{base}/v1/runs?{urllib.parse.urlencode({'limit': 1000, 'after': after})}", token)
        yield from page["runs"]
        after = page.get("next_after")
        if not after:
            return


def _status(args: argparse.Namespace) -> int:
    from nanwatch.cli import status_view

    if args.file is not None:
        return _status_file(args)
    try:
        token = args.token or token_from_env("NANWATCH_TOKEN") or token_from_env("NANWATCH_ADMIN_TOKEN")
    except ValueError as e:
        print(f"nanwatch status: {e}", file=sys.stderr)
        return 2
    base = args.url.rstrip("/")
    if args.run is None:
        shown = 0
        for r in _runs(base, token):
            print(status_view.render_summary(r), flush=True)
            shown += 1
        if not shown:
            print("no runs yet")
        return 0
    r = _call("GET", f"{base}/v1/runs/{args.run}", token)
    print("\n".join(status_view.render_detail(r, events=args.events)))
    return 0


def _status_file(args: argparse.Namespace) -> int:
    """``nanwatch status --file PATH``: a trainer's local JSONL record (a file, its backups or a folder)."""
    from nanwatch.cli import status_view

    if not os.path.exists(args.file):
        print(f"nanwatch status: no such file or folder: {args.file}", file=sys.stderr)
        return 2
    try:
        runs = status_view.fold(status_view.read_records(args.file), late_s=args.late_after)
    except OSError as e:
        print(f"nanwatch status: cannot read {args.file}: {e}", file=sys.stderr)
        return 2
    if args.run is not None:
        runs = [r for r in runs if r["run_id"] == args.run]
    if not runs:
        print(f"no reports{f' of run {args.run}' if args.run else ''} in {args.file}")
        return 1 if args.run else 0
    for r in runs:
        print("\n".join(status_view.render_detail(r, events=args.events)))
    return 0


def _directive(args: argparse.Namespace) -> int:
    token = args.admin_token or os.environ.get("NANWATCH_ADMIN_TOKEN")
    url = f"{args.url.rstrip('/')}/v1/directives/{args.run}"
    if args.action == "set":
        spec = {"mode": args.mode, "reason": args.reason or "set from the CLI"}
        if args.apply_at_step is not None:
            spec["apply_at_step"] = args.apply_at_step
        if args.revert_after is not None:
            spec["revert_after_clean_steps"] = args.revert_after
        d = _call("PUT", url, token, spec)
    else:
        d = _call("DELETE", url, token)
    print(f"run {d['run_id']}: directive v{d['version']} {d['mode']} from step {d['apply_at_step']}")
    return 0


#: subcommands owned by the trainer side: ``main(argv)`` gets the arguments after the subcommand name
_DELEGATES = {"demo": ("nanwatch.cli.demo", "train a tiny model into a NaN and back through a directive"),
              "bench": ("nanwatch.bench", "measure the hooks' overhead, or load a collector ('bench collector')"),
              "replay": ("nanwatch.hooks.remedies.replay", "re-run an incident capsule's birth module under several "
                         "settings: does the NaN reproduce here, and is it precision or data")}


def _delegate(name: str, argv: list[str]) -> int:
    import importlib

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

    s = sub.add_parser("serve", help="run the collector (settings also from NANWATCH_* env)")
    s.add_argument("--host", help="listen address (default 127.0.0.1; beyond loopback tokens are required)")
    s.add_argument("--port", type=int, help="listen port (default 8000)")
    s.add_argument("--db", help="SQLite file for events, directives and counters (default nanwatch.db)")
    s.add_argument("--tls-cert", metavar="PATH", help="serve HTTPS with this PEM certificate (chain); with --tls-key")
    s.add_argument("--tls-key", metavar="PATH", help="the certificate's PEM private key")
    s.set_defaults(func=_serve)

    s = sub.add_parser("status", help="summarise runs, or one run (from a collector, or a local file: --file)")
    s.add_argument("run", nargs="?", help="run id (omit to list runs)")
    s.add_argument("--url", default=os.environ.get("NANWATCH_URL", _DEFAULT_URL))
    s.add_argument("--token", help="ingest or admin token (default: NANWATCH_TOKEN or NANWATCH_TOKEN_FILE, "
                                  "else NANWATCH_ADMIN_TOKEN or NANWATCH_ADMIN_TOKEN_FILE)")
    s.add_argument("--events", type=int, default=20, help="how many recent events to show")
    s.add_argument("--file", help="read a trainer's local JSONL record instead of a collector: a file, a rotated "
                                 "backup, or a folder of them (MonitorConfig.log_dir / NANWATCH_LOG_DIR)")
    s.add_argument("--late-after", type=float, default=90.0,
                   help="with --file: a rank whose latest report is older than this many seconds (and that "
                        "neither ended nor crashed) is shown as silent (default 90, the collector's)")
    s.set_defaults(func=_status)

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
        d.add_argument("--url", default=os.environ.get("NANWATCH_URL", _DEFAULT_URL))
        d.add_argument("--admin-token", help="default: NANWATCH_ADMIN_TOKEN")
        d.set_defaults(func=_directive)

    from nanwatch.cli.push import add_parser as add_push

    add_push(sub)

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
