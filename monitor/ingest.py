"""The ingest path: parse a raw body once, drop replays, fold new reports into the state, apply the
policy, and persist it all in one transaction before acknowledging.

The body is validated straight from bytes (``model_validate_json``, one pass in Rust). Only when that fails
is it parsed again, to tell malformed JSON (400) and an unknown schema major (400, named) from ordinary
field errors (422) -- so a bad version gets a 400 naming it, not pydantic's 422.
"""

from __future__ import annotations

import json
import time
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from nanwatch.monitor.atomic import atomically
from nanwatch.monitor.directive_log import DirectiveLog
from nanwatch.monitor.rules import Policy
from nanwatch.monitor.state import CollectorState
from nanwatch.monitor.store import Store
from nanwatch.wire import SCHEMA_MAJOR, DirectiveSpec, ReportBatch, schema_major

__all__ = ["BadBody", "IngestResult", "ingest", "parse_batch", "parse_spec", "parse_strict"]

M = TypeVar("M", bound=BaseModel)


class IngestResult(BaseModel):
    """What the collector did with a batch. Replays are acknowledged too: they are ``duplicates``."""

    accepted: int
    duplicates: int


class BadBody(Exception):
    """A request body the collector refuses (a report batch or a directive spec): ``status`` 400 or 422,
    ``reason`` for the rejection counter."""

    def __init__(self, status: int, reason: str, detail: object) -> None:
        super().__init__(detail)
        self.status, self.reason, self.detail = status, reason, detail


#: errors a 422 lists (with the total): a body of thousands of bad items gets a short answer
MAX_ERRORS = 20


def parse_strict(model: type[M], raw: bytes) -> M:
    """Validate JSON bytes in strict mode (JSON types exactly: ``false`` is not 0, ``"5"`` not 5). A 422's
    detail is ``(the first MAX_ERRORS errors, how many in all)``."""
    try:
        return model.model_validate_json(raw, strict=True)
    except ValidationError as e:
        errors = (e.errors(include_url=False, include_context=False, include_input=False)[:MAX_ERRORS],
                  e.error_count())
    try:
        json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise BadBody(400, "malformed_json", f"request body is not valid JSON: {e}") from None
    raise BadBody(422, "invalid", errors)


def parse_spec(raw: bytes) -> DirectiveSpec:
    return parse_strict(DirectiveSpec, raw)


def parse_batch(raw: bytes) -> ReportBatch:
    try:
        return parse_strict(ReportBatch, raw)
    except BadBody as e:
        if e.status != 422:
            raise
        errors = e.detail
    doc = json.loads(raw)
    reports = doc.get("reports") if isinstance(doc, dict) else None
    for i, r in enumerate(reports if isinstance(reports, list) else ()):
        v = r.get("v") if isinstance(r, dict) else None
        if isinstance(v, str) and schema_major(v) != SCHEMA_MAJOR:
            raise BadBody(400, "unsupported_version",
                           f"reports[{i}].v: unsupported schema version {v!r}; this collector speaks "
                           f"{SCHEMA_MAJOR}.x")
    raise BadBody(422, "invalid", errors)


def ingest(batch: ReportBatch, *, state: CollectorState, directives: DirectiveLog, policy: Policy,
           store: Store) -> IngestResult:
    """Apply the batch all or nothing (``nanwatch.monitor.atomic``); raises ``BadBody`` (429: a cap),
    ``StoreUnavailable`` (retry) or ``Unstorable`` (a value that can never be stored)."""
    over = state.over_caps({(r.run_id, r.rank, r.incarnation) for r in batch.reports},
                           {r.run_id for r in batch.reports})
    if over is not None:
        raise BadBody(429, "cap", over)
    accepted, dupes = atomically(store, state, directives, {r.run_id for r in batch.reports},
                                 lambda: _apply(batch, state=state, policy=policy, store=store))
    state.accepted += accepted
    state.duplicates += dupes
    return IngestResult(accepted=accepted, duplicates=dupes)


def _apply(batch: ReportBatch, *, state: CollectorState, policy: Policy, store: Store) -> tuple[int, int]:
    """Fold the new reports into memory and write them (inside the caller's transaction)."""
    now, mono = time.time(), time.monotonic()
    accepted = dupes = 0
    hwm_rows: list[tuple[str, int, str, int, int]] = []
    counter_rows: dict[tuple[str, str, tuple], float] = {}
    for r in batch.reports:
        if not state.is_new(r):
            dupes += 1
            continue
        rank, previous_mode, changed = state.apply(r, received=now, seen=mono)
        for fam, labels, value in changed:
            counter_rows[(r.run_id, fam, labels)] = value
        hwm_rows.append((r.run_id, r.rank, r.incarnation, r.seq, r.step))
        policy.observe(r, rank, previous_mode, now)
        accepted += 1
    store.put_hwm(hwm_rows)
    store.put_counters([(*k, v) for k, v in counter_rows.items()])
    store.touch({r.run_id for r in batch.reports}, now)
    return accepted, dupes
