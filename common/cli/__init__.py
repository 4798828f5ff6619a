"""The ``nanwatch`` command. Imports nothing heavy at import time: torch, fastapi and uvicorn are imported
inside the subcommand that needs them (through nanwatch.monitor.server, nanwatch.cli.demo, nanwatch.bench),
so ``nanwatch status`` starts fast anywhere.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Sequence
from typing import NoReturn

from nanwatch.readable import printable
from nanwatch.tokens import token_from_env
from nanwatch.wire import MODES

__all__ = ["main"]

_DEFAULT_URL = "http://127.0.0.1:8000"


def _serve(args: argparse.Namespace) -> int:
    from nanwatch.monitor import Settings
    from nanwatch.monitor.server import serve

    given = (("host", args.host), ("port", args.port), ("db_path", args.db), ("database_url", args.database_url),
             ("tls_cert_file", args.tls_cert), ("tls_key_file", args.tls_key))
    overrides = {k: v for k, v in given if v is not None}
    try:
        settings = Settings(**overrides)
        serve(settings)
    except ValueError as e:
        print(f"nanwatch serve: {e}", file=sys.stderr)
        return 2
    return 0


#: the most of one collector answer the CLI reads, in MiB; a longer answer is refused in one line (exit 2)
MAX_ANSWER_MIB = 64
#: the most ``GET /v1/runs`` pages ``nanwatch status`` follows (1000 runs each)
MAX_PAGES = 1000
#: one call's time limit in seconds, connect to the answer's last byte
CALL_TIMEOUT_S = 30.0
#: what a collector's answer may do to the renderers: each is a bad answer, said in one line, never a traceback
BAD_ANSWER = (KeyError, TypeError, ValueError, AttributeError, IndexError, ArithmeticError, RecursionError)


def fail(message: str) -> NoReturn:
    """Say ``message`` in one printable line on stderr and exit 2 (a bad answer, a bad file, bad use)."""
    print(printable(message), file=sys.stderr, flush=True)
    raise SystemExit(2)


def read_bounded(resp, *, limit: int, deadline: float, what: str, cut: bool = False) -> bytes:
    """At most ``limit`` bytes of ``resp`` before ``deadline`` (``time.monotonic()``); beyond either, refused
    (``cut``: the first ``limit`` bytes are kept instead, for an error's detail)."""
    parts, held = [], 0
    while True:
        chunk = resp.read(min(65536, limit + 1 - held))
        if not chunk:
            return b"".join(parts)
        parts.append(chunk)
        held += len(chunk)
        if held > limit:
            if cut:
                return b"".join(parts)[:limit]
            fail(f"nanwatch: {what}: the answer is over {limit // 2**20} MiB (MAX_ANSWER_MIB); refused")
        if time.monotonic() > deadline:
            if cut:
                return b"".join(parts)
            fail(f"nanwatch: {what}: no full answer within {CALL_TIMEOUT_S:g} s; refused")


def parse_answer(data: bytes, what: str) -> dict:
    """A JSON object, or one line and exit 2 (invalid JSON, nesting too deep, not an object)."""
    try:
        answer = json.loads(data)
    except (ValueError, RecursionError) as e:
        fail(f"nanwatch: {what}: the answer is not JSON ({type(e).__name__}: {str(e)[:120]})")
    if not isinstance(answer, dict):
        fail(f"nanwatch: {what}: the answer is a JSON {type(answer).__name__}, not an object")
    return answer


def _call(method: str, url: str, token: str | None, body: dict | None = None) -> dict:
    req = urllib.request.Request(url, method=method, data=None if body is None else json.dumps(body).encode())
    req.add_header("Content-Type", "application/json")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    what, deadline = f"{method} {url}", time.monotonic() + CALL_TIMEOUT_S
    try:
        with urllib.request.urlopen(req, timeout=CALL_TIMEOUT_S) as resp:
            data = read_bounded(resp, limit=MAX_ANSWER_MIB * 2**20, deadline=deadline, what=what)
    except urllib.error.HTTPError as e:
        try:
            detail = read_bounded(e, limit=300, deadline=deadline, what=what, cut=True).decode("utf-8", "replace")
        except OSError:
            detail = ""
        fail(f"nanwatch: {what} -> HTTP {e.code}: {detail}")
    except (OSError, ValueError, http.client.HTTPException) as e:
        fail(f"nanwatch: cannot reach the collector at {url}: {e}")
    return parse_answer(data, what)


def _runs(base: str, token: str | None) -> Iterator[dict]:
    """Every run the token may read, following ``GET /v1/runs`` pages (``next_after``) to the last: at most
    ``MAX_PAGES``, each cursor past the one before (the collector pages by run id, ascending)."""
    after = ""
    for _ in range(MAX_PAGES):
        page = _call("GET", f"{base}/v1/runs?{urllib.parse.urlencode({'limit': 1000, 'after': after})}", token)
        runs, nxt = page.get("runs"), page.get("next_after")
        if not isinstance(runs, list) or not all(isinstance(r, dict) for r in runs):
            fail(f"nanwatch: GET {base}/v1/runs: the answer has no list of runs")
        yield from runs
        if not nxt:
            return
        if not isinstance(nxt, str) or nxt <= after:
            fail(f"nanwatch: GET {base}/v1/runs: next_after {str(nxt)[:80]!r} does not move past {after[:80]!r}; "
                 "refused")
        after = nxt
    fail(f"nanwatch: GET {base}/v1/runs: more than {MAX_PAGES} pages (MAX_PAGES); refused")


def _say(line: str) -> None:
    """Print one line of a view: every field in it passes the printable filter (a newline, an escape, a bidi
    override sent by a trainer or a collector is shown as ``\\uXXXX``, never obeyed)."""
    print(printable(line), flush=True)


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
            try:
                line = status_view.render_summary(r)
            except BAD_ANSWER as e:
                fail(f"nanwatch status: a run in the collector's list lacks or mistypes a field: {e!r:.200}")
            _say(line)
            shown += 1
        if not shown:
            print("no runs yet")
        return 0
    r = _call("GET", f"{base}/v1/runs/{urllib.parse.quote(args.run, safe='')}", token)
    try:
        lines = status_view.render_detail(r, events=args.events)
    except BAD_ANSWER as e:
        fail(f"nanwatch status: the collector's view of run {args.run} lacks or mistypes a field: {e!r:.200}")
    for line in lines:
        _say(line)
    return 0


def _status_file(args: argparse.Namespace) -> int:
    """``nanwatch status --file PATH``: a trainer's local JSONL record (a file, its backups or a folder)."""
    from nanwatch.cli import status_view

    if not os.path.exists(args.file):
        print(printable(f"nanwatch status: no such file or folder: {args.file}"), file=sys.stderr)
        return 2
    skipped: list[str] = []
    try:
        runs = status_view.fold(status_view.read_records(args.file, skipped=skipped), late_s=args.late_after)
        if args.run is not None:
            runs = [r for r in runs if r["run_id"] == args.run]
        views = [status_view.render_detail(r, events=args.events) for r in runs]
    except OSError as e:
        fail(f"nanwatch status: cannot read {args.file}: {e}")
    except BAD_ANSWER as e:
        fail(f"nanwatch status: a record in {args.file} lacks or mistypes a field: {e!r:.200}")
    if skipped:
        print(printable(f"nanwatch status: skipped {len(skipped)} unreadable line(s), first: {skipped[0]}"),
              file=sys.stderr)
    if not runs:
        _say(f"no reports{f' of run {args.run}' if args.run else ''} in {args.file}")
        return 1 if args.run else 0
    for lines in views:
        for line in lines:
            _say(line)
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
    try:
        line = f"run {d['run_id']}: directive v{d['version']} {d['mode']} from step {d['apply_at_step']}"
    except BAD_ANSWER as e:
        fail(f"nanwatch directive: the collector's answer lacks or mistypes a field: {e!r:.200}")
    _say(line)
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
    s.add_argument("--database-url", metavar="URL",
                   help="postgresql://... : keep that state in PostgreSQL instead, shared by collector replicas "
                        "(default: NANWATCH_DATABASE_URL, else SQLite)")
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
