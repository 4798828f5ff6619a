"""Request bodies read strictly, once, from bytes: a report batch or a directive spec.

The body is validated straight from bytes (``model_validate_json``, one pass in Rust) and never parsed a
second time: a failure is told apart by its errors alone -- malformed JSON (400), an unknown schema major
(400, named) or ordinary field errors (422, the first ``MAX_ERRORS`` of them).

Validation cost is bounded by the first bad item, not by the body: every list of the wire models stops at
its first invalid item (``fail_fast``), so a body of a million empty site objects costs a few errors, not
millions (issue #19.4: 233 KB of them held the loop 3 s and 867 MiB building every error).

A body over ``FAST_PATH_BYTES`` is parsed by ``json.loads`` first and validated from Python objects. In JSON
mode pydantic-core copies an error's input (the whole object it is about) for each error, so one 8 MiB
report of 2.8 million empty arrays and a few missing fields took 7 s of the loop and 1.9 GB; from Python
objects an error only points at its input (0.23 s, the parse). Validating bytes directly is ~1.4x faster for
a valid batch, so small bodies (the common case) keep it: their worst case is ~1 ms per KiB. Strict mode
agrees in both (an int is a float, not a bool; ``NaN``/``Infinity`` accepted; the last duplicate key wins;
tested), except that a plain ``str`` would keep a lone UTF-16 surrogate from Python: a body with a
surrogate escape is validated from bytes, which refuses a lone one.
"""

from __future__ import annotations

import json
import re
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from nanwatch.monitor.data.refusal import BadBody
from nanwatch.wire import SCHEMA_MAJOR, DirectiveSpec, ReportBatch

__all__ = ["FAST_PATH_BYTES", "MAX_ERRORS", "parse_batch", "parse_spec", "parse_strict"]

M = TypeVar("M", bound=BaseModel)

#: errors a 422 lists (with how many validation found before it stopped): a short answer whatever the body
MAX_ERRORS = 20
#: bodies up to this size are validated straight from bytes; larger ones from ``json.loads`` (see above)
FAST_PATH_BYTES = 128 * 1024
#: a JSON escape of a UTF-16 surrogate (``\ud800``-``\udfff``)
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _validate(model: type[M], raw: bytes) -> M:
    """``raw`` validated in strict mode, from bytes or from ``json.loads`` by its size (module docstring)."""
    if len(raw) <= FAST_PATH_BYTES or _SURROGATE_ESCAPE.search(raw):
        return model.model_validate_json(raw, strict=True)
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, nesting
        raise BadBody(400, "malformed_json", f"request body is not valid JSON: {e}") from None
    try:
        return model.model_validate(doc, strict=True)
    except RecursionError:
        raise BadBody(400, "malformed_json", "request body is nested too deeply") from None


def _refusal(e: ValidationError) -> BadBody:
    """The answer to a body that failed validation: 400 for malformed JSON, else 422 with the errors."""
    errors = e.errors(include_url=False, include_context=False, include_input=False)
    for err in errors:
        if err["type"] == "json_invalid":
            return BadBody(400, "malformed_json", f"request body is not valid JSON: {err['msg']}")
    return BadBody(422, "invalid", (errors[:MAX_ERRORS], e.error_count()))


def parse_strict(model: type[M], raw: bytes) -> M:
    """Validate JSON bytes in strict mode (JSON types exactly: ``false`` is not 0, ``"5"`` not 5). A 422's
    detail is ``(the first MAX_ERRORS errors, how many validation found)``."""
    try:
        return _validate(model, raw)
    except ValidationError as e:
        raise _refusal(e) from None


def parse_spec(raw: bytes) -> DirectiveSpec:
    return parse_strict(DirectiveSpec, raw)


def parse_batch(raw: bytes) -> ReportBatch:
    """A report batch; a report of another schema major gets a 400 naming its version (it is the first invalid
    report that validation reaches: a newer sender's reports are all of its version)."""
    try:
        return _validate(ReportBatch, raw)
    except ValidationError as e:
        refusal = _refusal(e)
        # never include_input: an error's input is the object it is about, converted afresh for each error
        for err in e.errors(include_url=False, include_context=False, include_input=False):
            loc = err["loc"]
            if len(loc) == 3 and loc[0] == "reports" and loc[2] == "v" and err["type"] == "value_error":
                why = err["msg"].removeprefix("Value error, ").split(":")[0]
                raise BadBody(400, "unsupported_version",
                              f"reports[{loc[1]}].v: {why}; this collector speaks {SCHEMA_MAJOR}.x") from None
        raise refusal from None
