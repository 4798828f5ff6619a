"""OpenAPI descriptions of the error responses routes share."""

from nanwatch.monitor.schemas import Problem, ValidationProblem

AUTH = {401: {"model": Problem, "description": "missing or invalid bearer token"},
        403: {"model": Problem, "description": "a valid token of the wrong kind"}}
INVALID = {422: {"model": ValidationProblem, "description": "a parameter or field failed validation"}}
NOT_READY = {503: {"model": Problem, "description": "starting, stopping or overloaded: retry after Retry-After"}}
