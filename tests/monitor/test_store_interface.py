"""The store behind its interface: ``Store`` (SQLite) has every operation ``DurableStore`` names, with the
same parameters, and the ledger reaches the store through the interface alone, so that a second store
(PostgreSQL, #40) is one class that passes this test and nothing above ``data/`` changes."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from nanwatch.monitor.data import durable
from nanwatch.monitor.data.durable import DurableStore
from nanwatch.monitor.data.store import EventRow, Store

_MEMBERS = sorted(n for n, v in vars(DurableStore).items() if inspect.isfunction(v) and not n.startswith("_"))


@pytest.mark.parametrize("name", _MEMBERS)
def test_the_sqlite_store_has_each_operation_with_its_parameters(name):
    want = inspect.signature(getattr(DurableStore, name))
    got = inspect.signature(getattr(Store, name))
    assert [(p.name, p.kind) for p in got.parameters.values()] == [(p.name, p.kind) for p in want.parameters.values()]


def test_the_interface_names_what_the_collector_calls_on_its_store():
    """Every ``store.<op>(`` the collector's code makes is an operation of the interface (a call the
    interface lacks would be one a second store could not answer)."""
    root = Path(durable.__file__).parents[1]
    called = set()
    for path in root.rglob("*.py"):
        if path.name == "store.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Attribute | ast.Name)
                    and getattr(node.func.value, "attr", getattr(node.func.value, "id", "")) in ("store", "_store")):
                called.add(node.func.attr)
    assert called, "the scan found no store call: it is broken"
    assert called - set(_MEMBERS) == set()


def test_an_event_is_added_once_and_a_rolled_back_transaction_queues_nothing():
    """Two points of the contract, on the SQLite store: ``add_event`` is idempotent by dedupe key, and what
    ``after_commit`` queued in a transaction that fails never runs."""
    store: DurableStore = Store(":memory:")
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
    assert isinstance(store.failures, tuple) and store.failures
    store.close()
