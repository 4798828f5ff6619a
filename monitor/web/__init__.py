"""Web: HTTP in front of the collector (routers, dependencies, the body limits, middleware, the uvicorn
protocol, error handlers and response schemas). Imports ``data``, ``write``, ``read`` and the settings.
"""

__all__ = ["body", "deps", "exception_handlers", "middleware", "openapi", "protocol", "schemas", "routers"]
