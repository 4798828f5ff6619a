"""A run's weight syncs (``nanwatch.monitor.data.weight_syncs.RunSyncs``) as store rows, and back: what a write
changed (``changes``: the rows to upsert, the keys to delete, from a copy of the run taken before the write) and
a run rebuilt from its rows (``decode``), so that a restarted collector, or another replica of a shared
PostgreSQL database, holds the same versions, sets, verdicts and workers.

One row per (run_id, kind, key), a unique key in both stores; the body is JSON:

========== ============================ =========================================================
kind       key                          body
========== ============================ =========================================================
version    ``<version>``                when it was received and published
set        ``<version>:<role>:<name>``  a kept set (``SideSet``); role ``trainer`` (bound, name
                                        empty), ``candidate`` (name: incarnation) or ``waiting``
                                        (a rollout set waiting for the trainer's; name: worker)
verdict    ``<version>:<worker>``       the worker's last compared set's digest and its verdict
worker     ``<worker>``                 ``WorkerSync``
published  ``<version>``                when the version was bound (the lag counts them)
trainer    (empty)                      the incarnation the latest set was bound to
========== ============================ =========================================================

Rows are the run's state, not a log: a write upserts the rows it changed and deletes the ones it dropped, so
a resend, or a second try after another replica wrote the run, rewrites a row and never adds one. They are
bounded as the memory is (``WeightSyncs``: versions a run, sets and verdicts a version, workers, published
versions, bytes a namespace), and deleted with the run.

Example usage::

    before = syncs.save(run_id)
    ...                                          # the write changes syncs.runs[run_id]
    puts, gone = changes(run_id, before, syncs.runs.get(run_id))
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import asdict, astuple
from typing import Any

from nanwatch.monitor.data.weight_syncs import RunSyncs, VersionSyncs, WorkerSync
from nanwatch.monitor.data.weight_verdicts import SideSet, Verdict

__all__ = ["WeightKey", "WeightRow", "changes", "decode", "decode_all"]

#: (run_id, kind, key, body): a row the store upserts
WeightRow = tuple[str, str, str, str]
#: (run_id, kind, key): a row the store deletes
WeightKey = tuple[str, str, str]


def _index(run: RunSyncs | None) -> dict[tuple[str, str], tuple[Any, Any]]:
    """Each row's (kind, key) -> (what decides whether it changed, the object its body is made of). A set is
    compared by its digest, not its (large) maps."""
    if run is None:
        return {}
    out: dict[tuple[str, str], tuple[Any, Any]] = {}
    for version, v in run.versions.items():
        out["version", str(version)] = ((v.received, v.published), v)
        if v.trainer is not None:
            out["set", f"{version}:trainer:"] = (v.trainer.digest, v.trainer)
        for role, sets in (("candidate", v.candidates), ("waiting", v.waiting)):
            for name, s in sets.items():
                out["set", f"{version}:{role}:{name}"] = (s.digest, s)
        for worker, (digest, verdict) in v.verdicts.items():
            out["verdict", f"{version}:{worker}"] = ((digest, verdict), (digest, verdict))
    for name, w in run.workers.items():
        out["worker", name] = (astuple(w), w)
    for version, t in run.published.items():
        out["published", str(version)] = (t, t)
    if run.trainer is not None:
        out["trainer", ""] = (run.trainer, run.trainer)
    return out


def _body(kind: str, obj: Any) -> str:
    if kind == "version":
        return json.dumps({"received": obj.received, "published": obj.published})
    if kind == "set":
        return json.dumps({"digest": obj.digest.hex(), "fingerprints": obj.fingerprints, "dtypes": obj.dtypes,
                           "shapes": obj.shapes, "casts": obj.casts})
    if kind == "verdict":
        digest, verdict = obj
        return json.dumps({"digest": digest.hex(), "verdict": asdict(verdict)})
    if kind == "worker":
        return json.dumps(asdict(obj))
    return json.dumps(obj)  # published: a time; trainer: an incarnation


def changes(run_id: str, before: RunSyncs | None, after: RunSyncs | None) -> tuple[list[WeightRow], list[WeightKey]]:
    """The rows a write changed or added, and the keys of those it dropped: ``before`` is the run as it was
    (``WeightSyncs.save``), ``after`` as it is now (None: no weight syncs)."""
    old, new = _index(before), _index(after)
    puts = [(run_id, kind, key, _body(kind, obj)) for (kind, key), (token, obj) in new.items()
            if (kind, key) not in old or old[kind, key][0] != token]
    gone = [(run_id, kind, key) for kind, key in old if (kind, key) not in new]
    return puts, gone


def _side(body: dict[str, Any]) -> SideSet:
    return SideSet(body["fingerprints"], body["dtypes"], body["shapes"], body["casts"], bytes.fromhex(body["digest"]))


def decode(rows: list[tuple[str, str, str]]) -> RunSyncs:
    """A run's weight syncs from its (kind, key, body) rows, in any order: versions in the order they were
    received, published versions in the order they were bound."""
    run = RunSyncs()
    versions: dict[int, VersionSyncs] = {}
    published: list[tuple[float, int]] = []
    for kind, key, text in sorted(rows, key=lambda r: r[0] != "version"):  # versions first: sets hang on them
        body = json.loads(text)
        if kind == "version":
            versions[int(key)] = VersionSyncs(received=body["received"], published=body["published"])
        elif kind == "set":
            version, role, name = key.split(":", 2)
            v = versions.setdefault(int(version), VersionSyncs())
            if role == "trainer":
                v.trainer = _side(body)
            else:
                (v.candidates if role == "candidate" else v.waiting)[name] = _side(body)
        elif kind == "verdict":
            version, worker = key.split(":", 1)
            fields = {k: tuple(x) if isinstance(x, list) else x for k, x in body["verdict"].items()}
            versions.setdefault(int(version), VersionSyncs()).verdicts[worker] = (bytes.fromhex(body["digest"]),
                                                                                   Verdict(**fields))
        elif kind == "worker":
            run.workers[key] = WorkerSync(**body)
        elif kind == "published":
            published.append((body, int(key)))
        elif kind == "trainer":
            run.trainer = body
    run.versions = OrderedDict(sorted(versions.items(), key=lambda kv: (kv[1].received, kv[0])))
    run.published = OrderedDict((version, t) for t, version in sorted(published))
    return run


def decode_all(rows: dict[str, list[tuple[str, str, str]]]) -> dict[str, RunSyncs]:
    """Each run's weight syncs from the rows the store read back (``Loaded.weights``)."""
    return {run_id: decode(run_rows) for run_id, run_rows in rows.items()}
