"""One APIRouter per concern."""

from nanwatch.monitor.routers import directives, health, metrics, reports, runs

__all__ = ["directives", "health", "metrics", "reports", "runs"]
