"""Two real ``nanwatch serve`` replicas on loopback sharing one PostgreSQL database (docs/replicas.md): a
run written through both, a resend across them a duplicate, concurrent directive changes through both one
sequence of versions, a long-poll on one woken by a change through the other; an unreachable database
stops ``nanwatch serve`` with exit 2; SQLite stays the default."""

import subprocess
import sys
import threading
import time

import httpx
import pytest
from support import JSON, CollectorProcess, scrape, step_report, wait_until

from nanwatch.bench.serve import free_port
from nanwatch.wire import ReportBatch

pytestmark = pytest.mark.slow
SITE = "model.layers.1.self_attn"



def _until_answered(call):
    """``call()`` until it is not a 503, as the trainer's sender retries one (a replica whose memory of
    the run was older than the database's re-reads it and asks for the retry)."""
    for _ in range(200):
        resp = call()
        if resp.status_code != 503:
            return resp
        time.sleep(0.02)
    raise AssertionError(f"still 503: {resp.text}")


def _post(url: str, *reports) -> dict:
    body = ReportBatch(reports=list(reports)).model_dump_json()
    resp = _until_answered(lambda: httpx.post(f"{url}/v1/reports", content=body, headers=JSON))
    assert resp.status_code == 200, resp.text
    return resp.json()


def _site_total(url: str, run_id: str) -> float:
    return scrape(url).get(("nanwatch_site_nonfinite_calls_total",
                            frozenset({("run_id", run_id), ("site", SITE), ("pass", "forward")})), 0.0)


@pytest.fixture
def replicas(pg_url, tmp_path):
    env = {"NANWATCH_DATABASE_URL": pg_url, "NANWATCH_DATABASE_REFRESH_S": "0.2"}
    with CollectorProcess(db_path=tmp_path / "unused-a.db", env=env) as a, \
            CollectorProcess(db_path=tmp_path / "unused-b.db", env=env) as b:
        yield a, b
    assert not (tmp_path / "unused-a.db").exists()  # the database URL wins: no SQLite file was made


def _report(seq: int, run_id: str = "shared"):
    return step_report(run_id=run_id, rank=0, seq=seq, step=seq, nan_at=SITE, nan=1, dtype="float32")


def test_a_run_written_through_both_replicas_adds_up_and_a_resend_is_a_duplicate(replicas):
    a, b = replicas
    for seq in range(10):  # alternate: each replica's memory of the run is older than the database's
        assert _post((a, b)[seq % 2].url, _report(seq)) == {"accepted": 1, "duplicates": 0}
    for seq in range(10):  # every report again, to the replica that did not take it
        assert _post((b, a)[seq % 2].url, _report(seq)) == {"accepted": 0, "duplicates": 1}
    def seen(url: str) -> tuple:
        run = httpx.get(f"{url}/v1/runs/shared").json()
        # (the run's latest step and ranks are each replica's own views: docs/replicas.md)
        return run["nonfinite_total"], [e["kind"] for e in run["events"]].count("first_nonfinite")

    wait_until(lambda: seen(a.url) == seen(b.url) == (10, 1), "both replicas to show the ten reports, each once")
    # the run is live on both: one replica (its lease holder) exports its totals, the database's, so the
    # sum over replicas is the true count
    assert _post(b.url, _report(10)) == {"accepted": 1, "duplicates": 0}
    wait_until(lambda: sorted((_site_total(a.url, "shared"), _site_total(b.url, "shared"))) == [0, 11],
          "one replica to export the run's eleven")


def test_concurrent_directive_changes_get_one_increasing_sequence(replicas):
    a, b = replicas
    versions: list[int] = []
    lock = threading.Lock()

    def change(url: str, n: int) -> None:
        for i in range(n):
            body = {"mode": "fp32" if i % 2 else "fused"}
            resp = _until_answered(lambda body=body: httpx.put(f"{url}/v1/directives/dir", json=body))
            assert resp.status_code == 200, resp.text
            with lock:
                versions.append(resp.json()["version"])

    threads = [threading.Thread(target=change, args=(r.url, 8)) for r in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(versions) == list(range(1, 17))  # distinct, none skipped, none issued twice
    wait_until(lambda: all(httpx.get(f"{r.url}/v1/directives/dir").json()["version"] == 16 for r in (a, b)),
          "both replicas to serve the latest version")


def test_a_long_poll_on_one_replica_is_answered_by_a_change_through_the_other(replicas):
    a, b = replicas
    assert httpx.put(f"{a.url}/v1/directives/poll", json={"mode": "fused"}).json()["version"] == 1
    wait_until(lambda: httpx.get(f"{b.url}/v1/directives/poll").json()["version"] == 1, "b to see version 1")
    got = {}

    def poll() -> None:
        got["d"] = httpx.get(f"{b.url}/v1/directives/poll", params={"index": 1, "wait": 20}, timeout=30).json()

    t = threading.Thread(target=poll)
    t.start()
    time.sleep(0.5)  # the poll is waiting on b (not a timing assertion: only a head start)
    assert _until_answered(lambda: httpx.put(f"{a.url}/v1/directives/poll", json={"mode": "fp32"})).json()["version"] == 2
    t.join()
    assert (got["d"]["version"], got["d"]["mode"]) == (2, "fp32")  # woken, not timed out at version 1


def test_an_unreachable_database_stops_serve_with_its_url_and_no_password():
    url = f"postgresql://nanwatch:hunter2@127.0.0.1:{free_port()}/nanwatch"
    done = subprocess.run([sys.executable, "-m", "nanwatch.cli", "serve", "--port", str(free_port()),
                           "--database-url", url], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "cannot reach the database postgresql://nanwatch:***@127.0.0.1" in done.stderr
    assert "hunter2" not in done.stderr + done.stdout


def test_sqlite_stays_the_default_and_never_imports_the_postgres_store(tmp_path):
    code = ("import sys; from nanwatch.monitor import Settings; from nanwatch.monitor.app import create_app; "
            "s = Settings(db_path=sys.argv[1]); assert s.database_url is None; create_app(s); "
            "assert 'nanwatch.monitor.pg' not in sys.modules and 'psycopg' not in sys.modules; print('ok')")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "n.db")], capture_output=True, text=True,
                          timeout=60, env={"PATH": "/usr/bin:/bin"})
    assert done.stdout.strip() == "ok", done.stderr


def test_the_database_url_comes_from_a_file_as_a_mounted_secret(tmp_path):
    from nanwatch.monitor.settings import Settings, database_url_of

    assert database_url_of(Settings()) is None
    (tmp_path / "url").write_text("postgresql://u:p@db/nanwatch\n")
    assert database_url_of(Settings(database_url_file=tmp_path / "url")) == "postgresql://u:p@db/nanwatch"
    (tmp_path / "empty").write_text("")
    with pytest.raises(ValueError, match="is empty"):
        database_url_of(Settings(database_url_file=tmp_path / "empty"))
