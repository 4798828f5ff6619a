"""The PostgreSQL store against a private cluster: the SQLite store's semantics method for method, the
schema it creates, upgrades and refuses, and the revision check that keeps replicas from overwriting each
other."""

import psycopg
import pytest

from nanwatch.monitor.data.state import CollectorState
from nanwatch.monitor.data.store import EventRow
from nanwatch.monitor.pg import PG_SCHEMA_VERSION, PgStore, SchemaRefused, StaleRun, StoreError, redact
from nanwatch.monitor.write.lifetimes import restore
from nanwatch.wire import Directive


def directive(run_id: str, version: int, mode: str = "fp32") -> Directive:
    return Directive(run_id=run_id, version=version, mode=mode, apply_at_step=0)


def test_writes_commit_together_and_read_back(pg_url):
    store = PgStore(pg_url)
    woken = []
    with store.transaction():
        store.put_hwm([("r", 0, "inc", 7, 3)])
        store.put_counters([("r", "nonfinite", ("forward", "nan"), 2**70 + 1)])  # past int64: exact
        assert store.add_event(EventRow("r", 1.5, "first_nonfinite", "first", 0, 3, "attn", detail={"x": float("nan")}))
        assert not store.add_event(EventRow("r", 1.6, "first_nonfinite", "first"))  # its dedupe key again
        store.put_directive(directive("r", 1))
        store.touch({"r"}, 100.0)
        store.after_commit(lambda: woken.append("r"))
        assert woken == []  # not before COMMIT
    assert woken == ["r"]
    loaded = PgStore(pg_url).load()
    assert loaded.hwm == {("r", 0, "inc"): 7} and loaded.latest_step == {"r": 3}
    assert loaded.counters == [("r", "nonfinite", ("forward", "nan"), 2**70 + 1)]
    assert loaded.directives["r"].version == 1 and loaded.event_counts == {("r", "first_nonfinite"): 1}
    assert loaded.first_offenders["r"].site == "attn" and loaded.first_offenders["r"].detail["x"] != 0  # NaN kept
    assert store.has_event("r", "first") and not store.has_event("r", "other")
    assert [e.dedupe for e in store.events("r", limit=5)] == ["first"]
    assert store.probe() is None and store.schema_problem() is None
    store.close()


def test_a_failed_transaction_leaves_nothing_and_runs_nothing(pg_url):
    store = PgStore(pg_url)
    woken = []
    with pytest.raises(RuntimeError), store.transaction():
        store.put_hwm([("r", 0, "inc", 1, 1)])
        store.after_commit(lambda: woken.append(1))
        raise RuntimeError("boom")
    assert woken == [] and store.load().hwm == {}
    with store.transaction():
        store.put_directive(directive("r", 1))
    with pytest.raises(StoreError), store.transaction():  # a version issued twice: the primary key refuses
        store.put_directive(directive("r", 1, "fused"))
    assert store.load().directives["r"].mode == "fp32"


def test_forgetting_runs_raises_the_directive_floor(pg_url):
    store = PgStore(pg_url)
    with store.transaction():
        store.put_directive(directive("a", 5))
        store.add_event(EventRow("a", 1.0, "x", "k"))
        store.touch({"a"}, 1.0)
    with store.transaction():
        assert store.delete_events("a") == 1
        store.delete_runs(["a"])
    state = CollectorState(ttl_s=60.0, series_cap=100)
    restore(state, store.load())  # every run something is read back for becomes a run in memory
    assert store.directive_floor() == 5 and state.runs == {}


def test_a_replica_with_an_older_memory_of_a_run_is_refused_until_it_rereads(pg_url):
    one, two = PgStore(pg_url), PgStore(pg_url)
    one.load(), two.load()
    with one.transaction():
        one.put_counters([("r", "c", (), 5)])
        one.touch({"r"}, 1.0)
    assert two.changed_runs() == {"r"} and one.changed_runs() == set()
    with pytest.raises(StaleRun), two.transaction():  # two never saw the 5: its total would overwrite it
        two.put_counters([("r", "c", (), 1)])
        two.touch({"r"}, 2.0)
    assert two.load({"r"}).counters == [("r", "c", (), 5)]  # re-read: two now knows revision 1
    with two.transaction():
        two.put_counters([("r", "c", (), 6)])
        two.touch({"r"}, 2.0)
    assert one.changed_runs() == {"r"} and one.load({"r"}).counters == [("r", "c", (), 6)]


def test_the_schema_is_upgraded_from_an_older_version_keeping_its_rows(pg_url):
    old = PgStore(pg_url, schema_upto=1)  # as a collector of schema 1 left it
    with old._pool.connection() as conn:
        conn.execute("INSERT INTO runs VALUES ('r', 1.0)")
        conn.execute("INSERT INTO hwm VALUES ('r', 0, 'inc', 4, 2)")
    old.close()
    new = PgStore(pg_url)
    assert new.schema_found == 1 and new.schema_problem() is None
    assert new.load().hwm == {("r", 0, "inc"): 4}
    with psycopg.connect(pg_url) as conn:
        assert [r[0] for r in conn.execute("SELECT version FROM nanwatch_schema ORDER BY 1")] == \
            list(range(1, PG_SCHEMA_VERSION + 1))
    assert PgStore(pg_url).schema_found == PG_SCHEMA_VERSION  # and then left alone


def test_schema_2_gains_the_weight_syncs_and_keeps_its_rows(pg_url):
    """The weight-sync migration (the runs' weight syncs and their revision) on a database a collector of
    schema 2 left (before any later migration)."""
    old = PgStore(pg_url, schema_upto=2)
    with old._pool.connection() as conn:
        conn.execute("INSERT INTO runs VALUES ('r', 1.0, 7)")
        conn.execute("INSERT INTO hwm VALUES ('r', 0, 'inc', 4, 2)")
        conn.execute("INSERT INTO directives VALUES ('r', 3, %s)", (directive("r", 3).model_dump_json(),))
    old.close()
    new = PgStore(pg_url)
    assert new.schema_found == 2 and new.schema_problem() is None
    loaded = new.load()
    assert loaded.hwm == {("r", 0, "inc"): 4} and loaded.directives["r"].version == 3 and loaded.weights == {}
    with new.transaction():
        new.put_weights([("r", "trainer", "", '"inc"')])
        new.touch({"r"}, 2.0)
    assert PgStore(pg_url).load().weights == {"r": [("trainer", "", '"inc"')]}


def test_a_replica_rereads_a_runs_weight_rows_only_when_they_changed(pg_url):
    """A write of another replica that leaves a run's weight rows alone (its reports) costs a re-read without
    them (they can be megabytes): memory keeps its own; one that changed them, or a failed write of this
    replica (memory may hold what no row does), reads them whole."""
    one, two = PgStore(pg_url), PgStore(pg_url)
    with one.transaction():
        one.put_weights([("r", "worker", "w", "{}")])
        one.touch({"r"}, 1.0)
    assert two.load({"r"}).weights == {"r": [("worker", "w", "{}")]}
    with one.transaction():  # a report: no weight row
        one.put_counters([("r", "c", (), 1)])
        one.touch({"r"}, 2.0)
    assert two.changed_runs() == {"r"}
    loaded = two.load({"r"})
    assert loaded.weights == {} and loaded.weights_kept == {"r"} and loaded.counters == [("r", "c", (), 1)]
    with one.transaction():
        one.put_weights([("r", "worker", "w", '{"x": 1}')])
        one.touch({"r"}, 3.0)
    loaded = two.load({"r"})
    assert loaded.weights == {"r": [("worker", "w", '{"x": 1}')]} and loaded.weights_kept == set()
    assert two.load({"r"}).weights_kept == {"r"}  # nothing moved since
    with one.transaction():
        one.touch({"r"}, 4.0)
    with pytest.raises(StaleRun), two.transaction():  # a failed write of two's own: read whole next time
        two.put_weights([("r", "worker", "w", "{}")])
        two.touch({"r"}, 5.0)
    assert two.load({"r"}).weights == {"r": [("worker", "w", '{"x": 1}')]}
    with two.transaction():  # its own write of the rows: known, as written
        two.put_weights([("r", "worker", "v", "{}")])
        two.touch({"r"}, 6.0)
    one.load({"r"})
    with one.transaction():
        one.touch({"r"}, 7.0)
    assert two.load({"r"}).weights_kept == {"r"}


def test_a_foreign_or_newer_database_is_refused(pg_cluster, pg_url):
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute("CREATE TABLE events (id int)")
    with pytest.raises(SchemaRefused, match="not a nanwatch collector database"):
        PgStore(pg_url)
    newer = pg_cluster.create_database()
    PgStore(newer).close()
    with psycopg.connect(newer, autocommit=True) as conn:
        conn.execute("INSERT INTO nanwatch_schema (version) VALUES (%s)", (PG_SCHEMA_VERSION + 1,))
    with pytest.raises(SchemaRefused, match="newer than this collector"):
        PgStore(newer)


def test_an_unreachable_database_names_its_url_without_the_password(pg_cluster):
    from nanwatch.bench.serve import free_port

    url = f"postgresql://nanwatch:hunter2@127.0.0.1:{free_port()}/nanwatch"
    with pytest.raises(ValueError, match="cannot reach the database") as e:
        PgStore(url, connect_timeout_s=2)
    assert "hunter2" not in str(e.value) and "nanwatch:***@127.0.0.1" in str(e.value)
    assert redact("postgresql://u@h/db") == "postgresql://u@h/db"
