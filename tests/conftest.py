"""Fixtures shared by every test package. Helpers that are not fixtures live in support.py."""

import pytest
from support import ADMIN, TOKEN, CollectorProcess


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
