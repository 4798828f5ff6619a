"""The private cluster the PostgreSQL tests run against: it starts (as root too, through an unprivileged
user), listens on loopback only, and gives each test its own empty database."""

import psycopg


def test_each_test_gets_an_empty_database_on_loopback(pg_cluster, pg_url):
    assert pg_url.startswith(f"postgresql://postgres@127.0.0.1:{pg_cluster.port}/")
    with psycopg.connect(pg_url) as conn:
        assert conn.execute("SELECT count(*) FROM pg_tables WHERE schemaname='public'").fetchone()[0] == 0
        assert conn.execute("SHOW listen_addresses").fetchone()[0] == "127.0.0.1"
        assert conn.execute("SELECT current_user").fetchone()[0] == "postgres"
    assert pg_cluster.create_database() != pg_url
