"""Report: a step's stats turned into a report (build, the job reduction), and where reports go (the
reporter thread, the HTTP transport, the local log). Imports every group below it; nothing above it.
"""

__all__ = ["build", "flow", "handover", "job", "job_stats", "local_log", "reporter", "step_context",
           "transport"]

