"""Fixtures shared by every test package. Helpers that are not fixtures live in support.py."""

import os

import pytest
from support import ADMIN, TOKEN, CollectorProcess


@pytest.fixture(autouse=True, scope="session")
def _capsules_out_of_the_checkout(tmp_path_factory):
    """Incident capsules are on by default (``./nanwatch-capsules``): every test run that provokes an
    incident would write into the checkout. They go to a temporary folder unless a test says otherwise."""
    os.environ.setdefault("NANWATCH_CAPSULE_DIR", str(tmp_path_factory.mktemp("capsules")))


@pytest.fixture(scope="module")
def collector(tmp_path_factory):
    """``nanwatch serve`` on 127.0.0.1, one per test module: an ingest token and a named admin token
    (``alice``), a small body limit, and room for about one and a half such bodies being received at once."""
    db = tmp_path_factory.mktemp("collector") / "nanwatch.db"
    env = {"NANWATCH_TOKEN": TOKEN, "NANWATCH_ADMIN_TOKENS": f'{{"alice": "{ADMIN}"}}',
           "NANWATCH_MAX_BODY_BYTES": str(256 * 1024), "NANWATCH_MAX_BUFFERED_BYTES": str(384 * 1024)}
    with CollectorProcess(db_path=db, env=env) as c:
        c.token, c.admin_token = TOKEN, ADMIN
        yield c


@pytest.fixture(scope="session")
def pg_cluster():
    """A private PostgreSQL server (the bench's, ``nanwatch.bench.pg_server``, without fsync: the tests kill
    collectors, never it), one per test process, started by the first test that asks for it; skipped
    without the server binaries unless NANWATCH_REQUIRE_TOOLS=1 (as CI runs)."""
    pytest.importorskip("psycopg")
    from nanwatch.bench.pg_server import PrivateServer, server_binary

    if server_binary("initdb") is None or server_binary("pg_ctl") is None:
        msg = "PostgreSQL's server binaries are not installed (apt-get install postgresql)"
        if os.environ.get("NANWATCH_REQUIRE_TOOLS") == "1":
            pytest.fail(f"{msg} and NANWATCH_REQUIRE_TOOLS=1")
        pytest.skip(msg)
    with PrivateServer.start(durable=False) as pg:
        yield pg


@pytest.fixture
def pg_url(pg_cluster) -> str:
    """A fresh, empty database on the private cluster: its URL."""
    return pg_cluster.create_database()
