"""The error answers routes share, and their OpenAPI descriptions."""

from nanwatch.monitor.atomic import StoreUnavailable, Unstorable
from nanwatch.monitor.deps import Resources
from nanwatch.monitor.ingest import BadBody
from nanwatch.monitor.schemas import Problem, ValidationProblem, WireJSON

AUTH = {401: {"model": Problem, "description": "missing or invalid bearer token"},
        403: {"model": Problem, "description": "a valid token of the wrong kind"}}
INVALID = {422: {"model": ValidationProblem, "description": "a parameter or field failed validation (the first "
                 "20 errors, and how many there were), or a value the collector cannot store"}}
BODY = {408: {"model": Problem, "description": "the body did not arrive within NANWATCH_BODY_TIMEOUT_S"},
        413: {"model": Problem, "description": "body over NANWATCH_MAX_BODY_BYTES"},
        415: {"model": Problem, "description": "Content-Type is not application/json"}}
NOT_READY = {503: {"model": Problem, "description": "starting, stopping, overloaded or the store refused the "
                   "write (nothing was applied): retry after Retry-After"}}


def refused(res: Resources, e: BadBody) -> WireJSON:
    """A body the collector refuses before applying anything (400 or 422), counted by reason."""
    res.state.rejected[e.reason] += 1
    if e.status == 422:
        errors, total = e.detail
        return WireJSON(ValidationProblem(detail=errors, error_count=total), status_code=422)
    return WireJSON(Problem(detail=str(e.detail)), status_code=e.status)


def write_failed(res: Resources, e: StoreUnavailable | Unstorable) -> WireJSON:
    """A write that was rolled back whole: 503 to retry, or 422 for a value that can never be stored."""
    if isinstance(e, Unstorable):
        res.state.rejected["unstorable"] += 1
        return WireJSON(Problem(detail=str(e)), status_code=422)
    res.state.rejected["store_error"] += 1
    return WireJSON(Problem(detail=str(e)), status_code=503, headers={"Retry-After": "1"})
