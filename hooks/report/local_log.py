"""nanwatch where people already look, with no collector: a line in the training log when something happens,
and a JSONL record of every report on local disk (``nanwatch status --file`` reads it).

Both are fed by the report flow (``ReportFlow``), on the reporter thread, with exactly what a collector
would receive; nothing here runs on the training thread, and nothing here raises into it.

**Log lines** (``logging.getLogger("nanwatch")``, WARNING, one line each, HF's ``logger.warning`` style),
from ``rank`` and ``job`` reports (in job scope rank 0 speaks for the job):
a non-finite *episode* starting (the first non-finite step after clean ones, not every NaN step of a NaN
run), an incident classified, a spike (a site's value ``spike_factor``× over its running baseline, before
any overflow: ``nanwatch.hooks.measure.spikes``), the step raising, the attention mode changing, and the values turning
finite again. ``log_every`` (``MonitorConfig.log.every``) adds an INFO summary every N training steps. A loss-scale overflow
that a GradScaler handled (``scaler_overflow``) is no episode: one quieter INFO line ("loss scale overflow at
step k; scale 65536 -> 32768"), and a WARNING when the scale falls below 1 (fp16 gradients underflow then).

**The JSONL file**: one report per line (``StepReport.model_dump_json()``: NaN and Inf stay the JSON
constants ``NaN``/``Infinity``, as on the wire). The end of a file says how its incarnation ended: a
normal close's last line is the final report (``"final": true``, as sent to the collector); any other close
(a step raised, the interpreter went down on an exception) writes a closing record
``{"nanwatch_log": "closed", ...}`` instead, so that a reader tells a run that ended from one that went
silent, and never finds both. ``Monitor.publish_weights`` adds ``{"nanwatch_log": "weights_published",
"version": ..., "dtypes": [...]}`` lines (the training thread writes them, under the writer's lock), which
``nanwatch status --file`` shows as the latest published weight version. One file per
run, rank and incarnation, ``<log_dir>/<run_id>.rank<rank>.<incarnation>.jsonl``, size-rotated by the
standard library's ``RotatingFileHandler`` (``.1`` is the newest backup). A folder that cannot be written
is warned about once and the run carries on without the file.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from logging.handlers import RotatingFileHandler

from nanwatch import readable
from nanwatch.hooks.config import LocalLogConfig
from nanwatch.hooks.failsafe import WarnOnce
from nanwatch.wire import StepReport

__all__ = ["LocalLog", "log_path"]

log = logging.getLogger("nanwatch")


def log_path(log_dir: str, *, run_id: str, rank: int, incarnation: str) -> str:
    """Where one Monitor's JSONL goes (run ids hold no path separator: the wire's alphabet)."""
    return os.path.join(log_dir, f"{run_id}.rank{rank}.{incarnation}.jsonl")


class _Lines:
    """Decides which reports deserve a line, and words it. Reporter thread only."""

    def __init__(self, *, incidents: bool, every: int | None) -> None:
        self._incidents, self._every = incidents, every
        self._episode: dict[str, tuple[int, int]] = {}  # stage -> (first non-finite step, steps so far)
        self._mode = "none"
        self._classified: set[tuple[int, int]] = set()  # (rank, step) of incidents already told
        self._nonfinite_steps = self._skipped = self._overflows = 0
        self._last_scale: float | None = None  # the last loss scale reported

    def observe(self, r: StepReport) -> None:
        # a job report speaks for every rank's step (its first offender names the rank); a detail or a
        # heartbeat would tell the same step again, from each rank that posts one
        if r.scope not in ("rank", "job"):
            return
        if r.final:
            return
        where = f"nanwatch: step {r.step} ({r.stage})"
        self._nonfinite_steps += r.first_offender is not None and r.stage == "train" and not r.scaler_overflow
        self._skipped += bool(r.step_skipped)
        self._overflows += bool(r.scaler_overflow)
        if self._incidents:
            self._loss_scale(r)
            for line in self._events(r, where):
                log.warning("%s", line)
        if self._every and r.stage == "train" and r.step % self._every == 0:
            log.info("%s", self._summary(r, where))

    def _loss_scale(self, r: StepReport) -> None:
        """The GradScaler's work, quietly: an overflow it handled is INFO; a scale under 1 is a WARNING (its
        fp16 gradients underflow: scaling no longer helps), told when the scale crosses under 1."""
        scale, before = r.loss_scale, self._last_scale
        if scale is None:
            return
        self._last_scale = scale
        now = f"{scale:g}"
        was = f"{before:g} -> " if before is not None else "now "
        if r.scaler_overflow:
            log.info("nanwatch: loss scale overflow at step %d; scale %s%s (GradScaler skipped the update)",
                     r.step, was, now)
        if scale < 1.0 and (before is None or before >= 1.0):
            log.warning("nanwatch: step %d: loss scale fell below 1 (%s%s): fp16 gradients underflow; the values "
                        "overflow even unscaled, and the scaler keeps skipping steps", r.step, was, now)

    def _events(self, r: StepReport, where: str) -> list[str]:
        lines = []
        rank = r.first_offender_rank if r.first_offender_rank is not None else r.rank
        episode = self._episode.get(r.stage)
        if r.scaler_overflow:  # dynamic loss scaling at work: no episode starts, none ends
            pass
        elif r.first_offender is not None:
            if episode is None:
                self._episode[r.stage] = (r.step, 1)
                n = sum(s.nan + s.inf for s in r.sites)
                msg = (f"{where}: non-finite at {r.first_offender} ({r.first_offender_phase or '?'}, rank {rank}); "
                       f"{readable.visits(n)}")
                inc = r.incident
                if inc is not None and (r.rank, inc.step) not in self._classified:
                    self._classified.add((r.rank, inc.step))
                    msg += "; " + readable.incident(inc.model_dump(mode="json"))
                if r.step_skipped:
                    msg += "; step skipped (weights not updated)"
                lines.append(msg)
            else:
                self._episode[r.stage] = (episode[0], episode[1] + 1)
        elif episode is not None:
            del self._episode[r.stage]
            first, n = episode
            lines.append(f"{where}: finite again after {n} non-finite step{'s' if n != 1 else ''} "
                         f"(from step {first})")
        inc = r.incident
        if inc is not None and (r.rank, inc.step) not in self._classified:
            self._classified.add((r.rank, inc.step))
            what = readable.incident(inc.model_dump(mode="json"))
            lines.append(f"nanwatch: step {inc.step} ({r.stage}) classified: {what}")
        if r.spikes and r.stage == "train":
            skipped = "; step skipped (spike_action='skip')" if r.step_skipped and r.first_offender is None else ""
            lines.append(f"nanwatch: step {r.step}: {readable.spikes([s.model_dump(mode='json') for s in r.spikes])}"
                         f"{skipped}")
        if r.raised:
            lines.append(f"{where}: the step raised {r.raised}: rank {r.rank} crashed")
        if r.attention_mode != self._mode:
            lines.append(f"{where}: attention mode {self._mode} -> {r.attention_mode} "
                         f"(directive v{r.directive_version}, rank {r.rank})")
            self._mode = r.attention_mode
        return lines

    def _summary(self, r: StepReport, where: str) -> str:
        bounds = [lg.bound for lg in r.logits]
        heads = [s.headroom for s in r.sites if s.stage == "train" and not math.isnan(s.headroom)]
        parts = [f"{self._nonfinite_steps} non-finite steps so far", f"{self._skipped} skipped",
                 *([f"{self._overflows} loss-scale overflows, scale {readable.figure(self._last_scale)}"]
                   if self._last_scale is not None else []),
                 f"mode {r.attention_mode}",
                 f"logit max {readable.figure(max(bounds)) if bounds else '-'}",
                 f"headroom {readable.headroom(max(heads)) if heads else '-'}"]
        if r.rlhf is not None:
            parts.append("rlhf " + readable.rlhf(r.rlhf.model_dump(mode="json")))
        return f"{where}: " + "; ".join(parts)


class _Jsonl:
    """The JSONL file. Opened on the first report (on the reporter thread); any OSError is one warning, then
    the file is given up for the rest of the run."""

    def __init__(self, path: str, *, max_bytes: int, backups: int, warn: WarnOnce) -> None:
        self.path, self._max, self._backups, self._warn = path, max_bytes, backups, warn
        self._handler: RotatingFileHandler | None = None
        self._failed = False
        self._lock = threading.Lock()  # the reporter thread writes reports, the training thread its publishes

    def write(self, line: str) -> None:
        with self._lock:
            self._write(line)

    def _write(self, line: str) -> None:
        if self._failed:
            return
        if self._handler is None:
            try:
                os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
                handler = RotatingFileHandler(self.path, maxBytes=self._max, backupCount=self._backups,
                                              encoding="utf-8")
            except OSError as e:
                return self._give_up(e)
            handler.setFormatter(logging.Formatter("%(message)s"))
            handler.handleError = lambda record: self._give_up(None)  # a write that failed: no traceback spam
            self._handler = handler
        self._handler.emit(logging.makeLogRecord({"msg": line, "args": None}))

    def _give_up(self, exc: OSError | None) -> None:
        self._failed = True
        why = f"{exc}" if exc is not None else "a write failed"
        self._warn(f"local log: cannot write {self.path} ({why}); the run goes on without the JSONL file")
        if self._handler is not None:
            self._handler.close()

    def close(self) -> None:
        if self._handler is not None:
            self._handler.close()


class LocalLog:
    """The log lines and the JSONL file of one Monitor. ``observe`` and ``close`` run on the reporter
    thread's side (``close`` after the reporter has delivered its last report).

    Example usage::

        local = LocalLog(config.log, run_id="r1", rank=0, incarnation="ab12", warn=WarnOnce())
        local.observe(report)   # each report the flow delivers
        local.close()
    """

    def __init__(self, config: LocalLogConfig, *, run_id: str, rank: int, incarnation: str, warn: WarnOnce) -> None:
        self._who = {"run_id": run_id, "rank": rank, "incarnation": incarnation}
        self._lines = (_Lines(incidents=config.incidents, every=config.every)
                       if config.incidents or config.every else None)
        self._file = None
        if config.dir:
            self._file = _Jsonl(log_path(config.dir, run_id=run_id, rank=rank, incarnation=incarnation),
                                max_bytes=config.max_bytes, backups=config.backups, warn=warn)
        self._last_step: int | None = None
        self._final = False  # the final report was written: it ends the file (no closing record)
        if config.every and not (log.isEnabledFor(logging.INFO) and log.hasHandlers()):
            warn(f"log_every={config.every}: the summary lines are logged at INFO, which the 'nanwatch' "
                 "logger does not show now (e.g. logging.basicConfig(level=logging.INFO))")

    @property
    def path(self) -> str | None:
        """The JSONL file's path (None: no file)."""
        return None if self._file is None else self._file.path

    def observe(self, report: StepReport) -> None:
        """Reporter thread: one delivered report (never raises)."""
        try:
            self._last_step = report.step
            self._final = self._final or report.final
            if self._lines is not None:
                self._lines.observe(report)
            if self._file is not None:
                self._file.write(report.model_dump_json())
        except Exception:  # noqa: BLE001 - monitoring never breaks training
            log.exception("nanwatch: local log failed for step %s", report.step)

    def published(self, version: int, dtypes: list[str]) -> None:
        """Training thread: ``Monitor.publish_weights`` posted (or tried to post) weight ``version`` with casts
        to ``dtypes``; ``nanwatch status`` reads it from the file (never raises)."""
        if self._file is None:
            return
        try:
            self._file.write(json.dumps({"nanwatch_log": "weights_published", **self._who, "time": time.time(),
                                         "version": version, "dtypes": dtypes}))
        except Exception:  # noqa: BLE001
            log.exception("nanwatch: local log failed for weight version %s", version)

    def close(self) -> None:
        if self._file is None:
            return
        try:
            if not self._final:
                self._file.write(json.dumps({"nanwatch_log": "closed", **self._who, "time": time.time(),
                                             "last_step": self._last_step}))
            self._file.close()
        except Exception:  # noqa: BLE001
            log.exception("nanwatch: closing the local log failed")
