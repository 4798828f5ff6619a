"""Why the collector refuses a request, as exceptions raised where the reason is known (the body parser,
the token check, the ledger) and answered in one place (``nanwatch.monitor.web.exception_handlers``), which
also counts each by ``reason`` (``nanwatch_collector_requests_rejected_total``).

Web-free on purpose: the write path (``nanwatch.monitor.write.ledger``) raises these without knowing HTTP beyond
a status code.
"""

from __future__ import annotations

__all__ = ["BadBody", "CapReached", "Refused", "StoreUnavailable", "Unstorable"]


class Refused(Exception):
    """A refused request: ``status`` (4xx or 503), ``reason`` (the rejection counter's label), ``detail``
    (a sentence saying what was wrong and what to do; for a 422 of field errors, ``(errors, how many)``)
    and the response ``headers``."""

    status = 400
    reason = "refused"

    def __init__(self, detail: object, *, status: int | None = None, reason: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(detail)
        self.detail = detail
        if status is not None:
            self.status = status
        if reason is not None:
            self.reason = reason
        self.headers = headers


class BadBody(Refused):
    """A request body the collector refuses (a report batch or a directive spec): 400 or 422."""

    def __init__(self, status: int, reason: str, detail: object) -> None:
        super().__init__(detail, status=status, reason=reason)


class CapReached(Refused):
    """The request would add a run or an incarnation beyond a cap: nothing was applied (429)."""

    status, reason = 429, "cap"


class StoreUnavailable(Refused):
    """Nothing was applied: the store refused the write. The client should retry (503)."""

    status, reason = 503, "store_error"

    def __init__(self, detail: str) -> None:
        super().__init__(detail, headers={"Retry-After": "1"})


class Unstorable(Refused):
    """Nothing was applied: the request holds a value the store cannot keep (422)."""

    status, reason = 422, "unstorable"
