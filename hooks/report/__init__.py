"""Report: a step's stats turned into a report (build, the job reduction), and where reports go (the
reporter thread, the HTTP transport, the local log). Imports every group below it; nothing above it.
"""

__all__ = ["build", "flow", "handover", "job", "job_stats", "local_log", "reporter", "transport"]


def __getattr__(name: str):
    """``nanwatch.hooks.report`` was the module that is now ``report.build``: its names still resolve here,
    with a DeprecationWarning (the old path is this package's own name, so the alias finder cannot serve it)."""
    import importlib
    import warnings

    build = importlib.import_module(f"{__name__}.build")
    if name.startswith("__") or not hasattr(build, name):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"{__name__}.{name} moved to {__name__}.build.{name}", DeprecationWarning, stacklevel=2)
    return getattr(build, name)
