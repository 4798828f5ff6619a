"""One database, one collector: a second ``nanwatch serve`` on the same SQLite file refuses to start
(two writers each kept their own totals of one run), and the lock dies with its holder."""

from __future__ import annotations

import subprocess
import sys
import urllib.request

from support import CollectorProcess, free_port


def _serve(db) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nanwatch.cli", "serve", "--host", "127.0.0.1", "--port",
                           str(free_port()), "--db", str(db)], capture_output=True, text=True, timeout=60)


def _ready(c: CollectorProcess) -> bool:
    with urllib.request.urlopen(c.url + "/readyz", timeout=5) as r:
        return r.status == 200


def test_a_second_collector_on_the_same_file_exits_with_a_clear_error(tmp_path):
    db = tmp_path / "c.db"
    with CollectorProcess(db_path=str(db)) as first:
        second = _serve(db)
        assert second.returncode == 2, (second.returncode, second.stderr)
        assert "in use by another nanwatch collector" in second.stderr, second.stderr
        assert _ready(first), "the first collector must be untouched"


def test_the_lock_dies_with_its_holder(tmp_path):
    db = tmp_path / "c.db"
    CollectorProcess(db_path=str(db)).start().kill()  # SIGKILL: no shutdown, no unlock of its own
    with CollectorProcess(db_path=str(db)) as second:
        assert _ready(second)
