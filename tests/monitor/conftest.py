"""Fixtures: real collectors (``nanwatch serve`` under uvicorn) on 127.0.0.1, one per module."""

import pytest

from nanwatch.monitor.testing import CollectorProcess

TOKEN, ADMIN = "ingest-secret", "admin-secret"


@pytest.fixture(scope="module")
def collector(tmp_path_factory):
    """A collector with an ingest token and a named admin token (``alice``), small body limit."""
    db = tmp_path_factory.mktemp("collector") / "nanwatch.db"
    env = {"NANWATCH_TOKEN": TOKEN, "NANWATCH_ADMIN_TOKENS": f'{{"alice": "{ADMIN}"}}',
           "NANWATCH_MAX_BODY_BYTES": str(256 * 1024), "NANWATCH_MAX_INFLIGHT_INGEST": "4"}
    with CollectorProcess(db_path=db, env=env) as c:
        c.token, c.admin_token = TOKEN, ADMIN
        yield c
