"""The store behind its interface: ``Store`` (SQLite) and ``PgStore`` (PostgreSQL, #40) have every operation
``DurableStore`` names, with the same parameters, and keep the same contract, and the ledger reaches the
store through the interface alone, so that nothing above ``data/`` knows which store it writes to."""

from __future__ import annotations

import ast
import inspect
from collections.abc import Iterator
from pathlib import Path

import pytest

from nanwatch.monitor.data import durable
from nanwatch.monitor.data.durable import DurableStore
from nanwatch.monitor.data.store import EventRow, Store

_MEMBERS = sorted(n for n, v in vars(DurableStore).items() if inspect.isfunction(v) and not n.startswith("_"))


def _store_class(engine: str) -> type:
    if engine == "sqlite":
        return Store
    return pytest.importorskip("nanwatch.monitor.pg").PgStore  # the postgres extra (psycopg) is optional


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request) -> Iterator[DurableStore]:
    """An empty store of each engine (PostgreSQL: a fresh database on the private test cluster)."""
    if request.param == "sqlite":
        made = Store(":memory:")
    else:
        made = _store_class("postgresql")(request.getfixturevalue("pg_url"))
    yield made
    made.close()


@pytest.mark.parametrize("engine", ["sqlite", "postgresql"])
@pytest.mark.parametrize("name", _MEMBERS)
def test_each_store_has_each_operation_with_its_parameters(engine, name):
    want = inspect.signature(getattr(DurableStore, name))
    got = inspect.signature(getattr(_store_class(engine), name))
    assert [(p.name, p.kind) for p in got.parameters.values()] == [(p.name, p.kind) for p in want.parameters.values()]


@pytest.mark.parametrize("engine", ["sqlite", "postgresql"])
def test_each_store_names_its_failures(engine):
    """What the ledger catches as the store's failure (503) is a non-empty tuple of exception types."""
    failures = _store_class(engine).failures
    assert isinstance(failures, tuple) and failures
    assert all(isinstance(f, type) and issubclass(f, BaseException) for f in failures)


def test_the_interface_names_what_the_collector_calls_on_its_store():
    """Every ``store.<op>(`` the collector's code makes is an operation of the interface (a call the
    interface lacks would be one a second store could not answer). The stores' own code is not the
    collector's: ``data/store.py``, and ``pg/``, whose replica follower asks the PostgreSQL store alone what
    other replicas wrote (``PgStore.changed_runs``)."""
    root = Path(durable.__file__).parents[1]
    called = set()
    for path in root.rglob("*.py"):
        if path.name == "store.py" or path.relative_to(root).parts[0] == "pg":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Attribute | ast.Name)
                    and getattr(node.func.value, "attr", getattr(node.func.value, "id", "")) in ("store", "_store")):
                called.add(node.func.attr)
    assert called, "the scan found no store call: it is broken"
    assert called - set(_MEMBERS) == set()


def test_an_event_is_added_once_and_a_rolled_back_transaction_queues_nothing(store):
    """Two points of the contract, on each store: ``add_event`` is idempotent by dedupe key, and what
    ``after_commit`` queued in a transaction that fails never runs."""
    ev = EventRow("run-1", 1.0, "first_nonfinite", "first_nonfinite")
    ran = []
    with store.transaction():
        assert store.add_event(ev) is True
        assert store.add_event(ev) is False
    with pytest.raises(RuntimeError), store.transaction():
        store.after_commit(lambda: ran.append(1))
        raise RuntimeError("refused")
    assert ran == []
    assert [e.dedupe for e in store.events("run-1", limit=10)] == ["first_nonfinite"]


def test_weight_rows_are_upserted_by_their_key_and_go_with_their_run(store):
    """The weight-sync rows (#40) on each store: one row per (run, kind, key), a second put replaces it, a
    delete of what is gone is a no-op, and forgetting the run deletes them with its other rows."""
    with store.transaction():
        store.put_weights([("r", "worker", "w", "{}"), ("r", "set", "1:trainer:", "{}"), ("s", "trainer", "", '"i"')])
        store.put_weights([("r", "worker", "w", '{"x": 1}')])
        store.touch({"r", "s"}, 1.0)
    assert sorted(store.load().weights["r"]) == [("set", "1:trainer:", "{}"), ("worker", "w", '{"x": 1}')]
    with store.transaction():
        store.delete_weights([("r", "set", "1:trainer:"), ("r", "set", "9:trainer:")])
        store.touch({"r"}, 2.0)
    assert store.load().weights["r"] == [("worker", "w", '{"x": 1}')]  # (of every run: rows whole)
    with store.transaction():
        store.delete_runs(["r"])
    assert store.load().weights == {"s": [("trainer", "", '"i"')]}
