"""The app's exception handlers: every error is a ``Problem`` (or a ``ValidationProblem``) that says what
was wrong and what to do, and every refusal is counted by reason, here and nowhere else
(``answer_refusal``, which the ingress middleware calls too: it answers before the app's handlers)."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler, request_validation_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.datastructures import State
from starlette.exceptions import HTTPException as StarletteHTTPException

from nanwatch.monitor.data.refusal import Refused
from nanwatch.monitor.web.schemas import ApiJSON, Problem, ValidationProblem
from nanwatch.monitor.write import requests

__all__ = ["answer_refusal", "install_exception_handlers"]


def _count(app_state: State, reason: str) -> None:
    """Count a refused request by reason (``nanwatch_collector_requests_rejected_total``), if the
    collector's resources are open. The one place a rejection is counted."""
    res = getattr(app_state, "resources", None)
    if res is not None:
        requests.rejected(res.state, reason)


def answer_refusal(app_state: State, e: Refused) -> ApiJSON:
    """The answer to a refused request, counted: a ``ValidationProblem`` for field errors, else a
    ``Problem``."""
    _count(app_state, e.reason)
    if isinstance(e.detail, tuple):
        errors, total = e.detail
        return ApiJSON(ValidationProblem(detail=errors, error_count=total), status_code=e.status, headers=e.headers)
    return ApiJSON(Problem(detail=str(e.detail)), status_code=e.status, headers=e.headers)


def install_exception_handlers(app: FastAPI) -> None:
    @app.exception_handler(Refused)
    async def _refused(request: Request, exc: Refused):
        return answer_refusal(request.app.state, exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 405:  # Starlette's Allow names one route's methods; a path has several
            allowed = sorted({m for r in app.routes if isinstance(r, APIRoute)
                              and r.path_regex.match(request.url.path) for m in r.methods})
            exc = StarletteHTTPException(405, f"method {request.method} not allowed here; use {', '.join(allowed)}",
                                         headers={"Allow": ", ".join(allowed)})
        return await http_exception_handler(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        _count(request.app.state, "invalid")
        return await request_validation_exception_handler(request, exc)
