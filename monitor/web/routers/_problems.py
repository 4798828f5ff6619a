"""The error answers routes share, as OpenAPI response descriptions (the answers themselves are built in
``nanwatch.monitor.web.exception_handlers``)."""

from nanwatch.monitor.web.schemas import Problem, ValidationProblem

AUTH = {401: {"model": Problem, "description": "missing or invalid bearer token"},
        403: {"model": Problem, "description": "a valid token of the wrong kind"}}
INVALID = {422: {"model": ValidationProblem, "description": "a parameter or field failed validation (the first "
                 "20 errors, and how many there were), or a value the collector cannot store"}}
BODY = {408: {"model": Problem, "description": "the body did not arrive within NANWATCH_BODY_TIMEOUT_S"},
        413: {"model": Problem, "description": "body over NANWATCH_MAX_BODY_BYTES"},
        415: {"model": Problem, "description": "Content-Type is not application/json"}}
NOT_READY = {503: {"model": Problem, "description": "starting, stopping, overloaded or the store refused the "
                   "write (nothing was applied): retry after Retry-After"}}
