"""The CLI's calls to a collector, and how the commands that read them fail: every answer is hostile until
read (#27). An answer is read within a size (``MAX_ANSWER_MIB``) and a time (``CALL_TIMEOUT_S``), must be a
JSON object, and every failure is one printable line on stderr and exit 2, never a traceback. Standard
library only: ``nanwatch status`` and ``nanwatch directive`` start fast anywhere.
"""

from __future__ import annotations

import http.client
import json
import os
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from typing import NoReturn

from nanwatch.readable import printable

__all__ = ["BAD_ANSWER", "CALL_TIMEOUT_S", "MAX_ANSWER_MIB", "MAX_PAGES", "call", "default_url", "fail",
           "parse_answer", "read_bounded", "runs", "say"]

_DEFAULT_URL = "http://127.0.0.1:8000"

#: the most of one collector answer the CLI reads, in MiB; a longer answer is refused in one line (exit 2)
MAX_ANSWER_MIB = 64
#: the most ``GET /v1/runs`` pages ``nanwatch status`` follows (1000 runs each)
MAX_PAGES = 1000
#: one call's time limit in seconds, connect to the answer's last byte
CALL_TIMEOUT_S = 30.0
#: what a collector's answer may do to the renderers: each is a bad answer, said in one line, never a traceback
BAD_ANSWER = (KeyError, TypeError, ValueError, AttributeError, IndexError, ArithmeticError, RecursionError)


def default_url() -> str:
    """``--url``'s default: ``NANWATCH_URL``, else the collector's own default address."""
    return os.environ.get("NANWATCH_URL", _DEFAULT_URL)


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


def call(method: str, url: str, token: str | None, body: dict | None = None) -> dict:
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


def runs(base: str, token: str | None) -> Iterator[dict]:
    """Every run the token may read, following ``GET /v1/runs`` pages (``next_after``) to the last: at most
    ``MAX_PAGES``, each cursor past the one before (the collector pages by run id, ascending)."""
    after = ""
    for _ in range(MAX_PAGES):
        page = call("GET", f"{base}/v1/runs?{urllib.parse.urlencode({'limit': 1000, 'after': after})}", token)
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


def say(line: str) -> None:
    """Print one line of a view: every field in it passes the printable filter (a newline, an escape, a bidi
    override sent by a trainer or a collector is shown as ``\\uXXXX``, never obeyed)."""
    print(printable(line), flush=True)
