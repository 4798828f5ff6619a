"""Request bodies read strictly, once, from bytes: a report batch or a directive spec.

The body is validated straight from bytes (``model_validate_json``, one pass in Rust). Only when that fails
is it parsed again, to tell malformed JSON (400) and an unknown schema major (400, named) from ordinary
field errors (422) -- so a bad version gets a 400 naming it, not pydantic's 422.
"""

from __future__ import annotations

import json
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from nanwatch.monitor.refusal import BadBody
from nanwatch.wire import SCHEMA_MAJOR, DirectiveSpec, ReportBatch, schema_major

__all__ = ["MAX_ERRORS", "parse_batch", "parse_spec", "parse_strict"]

M = TypeVar("M", bound=BaseModel)

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
