"""The app's exception handlers: every error is a ``Problem`` (or a ``ValidationProblem``) that says what
was wrong and what to do, and every refusal is counted by reason."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler, request_validation_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from nanwatch.monitor.middleware import count_rejection

__all__ = ["install_error_handlers"]


def install_error_handlers(app: FastAPI) -> None:
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
        count_rejection(request.app.state, "invalid")
        return await request_validation_exception_handler(request, exc)
