"""A run's status, decided here alone: the collector's run view (``GET /v1/runs``: ``status``) and
``nanwatch status`` (from the collector's JSON or a trainer's local record) both ask ``run_status``, so the
two never say different things of one run. Pure, and imports nothing: the CLI must start fast.

The words, most urgent first:

* ``crashed``: a rank's step raised (the run ends crashed, whatever its other ranks do);
* ``silent``: a rank is late -- hung, or gone without a word (judged only where rank views are at hand:
  ``nanwatch status``; the collector's run list does not judge it, and says ``live`` or ``idle``);
* ``live``: ranks reported recently;
* ``ended``: every rank sent its final report (the run ended normally);
* ``idle``: none of these (no rank reported recently, and the run did not say it ended).
"""

from __future__ import annotations

from typing import Literal

__all__ = ["CRASHED", "ENDED", "IDLE", "LIVE", "SILENT", "RunStatus", "run_status"]

RunStatus = Literal["crashed", "silent", "live", "ended", "idle"]
CRASHED: RunStatus = "crashed"
SILENT: RunStatus = "silent"
LIVE: RunStatus = "live"
ENDED: RunStatus = "ended"
IDLE: RunStatus = "idle"


def run_status(*, crashed: bool, live: bool, ended: bool, silent: bool = False) -> RunStatus:
    """The run's status from what is known of its ranks: any crashed, any late (``silent``), any live, all
    ended. The first that holds wins, in the order of the module's list."""
    if crashed:
        return CRASHED
    if silent:
        return SILENT
    if live:
        return LIVE
    return ENDED if ended else IDLE
