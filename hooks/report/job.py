"""Job-level reporting: one report per job-step, reduced across ranks on the host, in the reporter thread.

Per rank and step: one header all-reduce (MAX of 6 int64: the step, the table's hash, "closing", "broken"),
then one SUM and one MAX all-reduce of float64 vectors laid out by the agreed table (``nanwatch.hooks.report.job_stats``;
4 sums and 2 maxima per site, a few per SDPA signature, logit layer and forward, ~60 fixed). Only when the
ranks' tables differ (an MoE expert that fired on one rank, a ``watch()`` name) does an ``all_gather_object``
of the tables run first. Rank 0 posts the job's report; a rank that differs (a non-finite value, another SDPA
backend, another directive) also posts its own, as a ``detail``; the other ranks post a ``heartbeat`` every
``heartbeat_s``.

Why here and not a device-side async collective, as the issue first asked: the values are already on the host
in this thread (the step's one async copy has landed), so reducing them here costs the training thread
nothing and adds no device sync; and a collective issued on the training stream would be ordered among the
user's own NCCL collectives, where one extra call on a rank that skipped a step (a dropped report, an
exception in a hook) would pair with the user's all-reduce and corrupt or hang training. Here the collectives
run on a dedicated gloo group (created collectively at attach, on the training thread), with a timeout; the
training thread and its streams never see them.

Failure handling: ranks pair each step by its number (a rank that is behind, e.g. after a dropped report,
posts that step as its own report and catches up); any exception or timeout warns once and turns this rank
to per-rank reports for good, and its peers follow at their next collective (timeout, or the "closing" flag a
closing rank sends). The reporter's queue is bounded by its host buffers, so training never waits.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta

import torch

from nanwatch.hooks.report.job_stats import Contribution, contribution, merge_tables, reduce_job
from nanwatch.wire import StepReport

__all__ = ["AUTO_JOB_WORLD", "JobReporting", "heartbeat_interval", "open_job_reporting", "report_scope"]

log = logging.getLogger("nanwatch")

#: ``report_scope="auto"`` reports per job from this world size on (see ``MonitorConfig.reports.scope``).
AUTO_JOB_WORLD = 16

_CLOSING, _BROKEN = 4, 5


def report_scope(scope: str, world_size: int) -> str:
    """``rank`` or ``job``: what ``scope`` means for this process (job needs torch.distributed, > 1 rank)."""
    d = torch.distributed
    if scope == "rank" or world_size < 2:
        return "rank"
    if not (d.is_available() and d.is_initialized()) or d.get_world_size() != world_size:
        if scope == "job":
            log.warning("nanwatch: report_scope='job' needs torch.distributed initialised with world_size %d; "
                        "reporting per rank", world_size)
        return "rank"
    return "job" if scope == "job" or world_size >= AUTO_JOB_WORLD else "rank"


def heartbeat_interval(heartbeat_s: float | None, world_size: int) -> float:
    """``MonitorConfig.reports.heartbeat_s``, or its default: 30 s, longer for jobs past 3,000 ranks so that one
    job's heartbeats stay under 100 requests a second (``MonitorConfig.reports.heartbeat_s`` says why)."""
    return heartbeat_s if heartbeat_s is not None else max(30.0, world_size / 100)


def open_job_reporting(*, scope: str, rank: int, world_size: int, heartbeat_s: float | None,
                       timeout_s: float) -> JobReporting | None:
    """Training thread, at attach, on every rank together: the group job reports are reduced on, or None
    (per-rank reports) when the scope is ``rank`` or the group cannot be made (warned)."""
    if report_scope(scope, world_size) != "job":
        return None
    try:
        group = torch.distributed.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    except Exception as exc:  # noqa: BLE001 - monitoring never breaks training
        log.warning("nanwatch: could not create the gloo group for job reports (%r); reporting per rank", exc)
        return None
    return JobReporting(group, rank=rank, world_size=world_size,
                        heartbeat_s=heartbeat_interval(heartbeat_s, world_size))


class JobReporting:
    """One rank's side of job-level reporting. Reporter thread only (after construction)."""

    def __init__(self, group, *, rank: int, world_size: int, heartbeat_s: float) -> None:
        self._group = group
        self.rank, self.world = rank, world_size
        self.active = True
        self._heartbeat_s = heartbeat_s
        self._last_post = -float("inf")
        self._seq = 0  # what this rank posts is numbered here: rank 0 may post a job report and a detail

    def route(self, own: StepReport, rlhf: dict | None) -> list[StepReport]:
        """What this rank posts for the step whose own report is ``own`` (job, detail, heartbeat or rank)."""
        posts = self._job_posts(own, rlhf) if self.active else [own]
        out = [r.model_copy(update={"seq": self._next_seq()}) for r in posts]
        if out:
            self._last_post = time.monotonic()
        return out

    def own(self, report: StepReport) -> list[StepReport]:
        """This rank's own report, posted as it is (no collective: an evaluation's report), numbered in the
        sequence the job's reports share, so that the collector's idempotency key stays unique."""
        self._last_post = time.monotonic()
        return [report.model_copy(update={"seq": self._next_seq()})]

    def close(self) -> None:
        """Reporter thread, at close: tell peers still reducing that this rank will not (no waiting for them
        beyond the group's timeout)."""
        if self.active:
            self.active = False
            try:
                self._header([0, 0, 0, 0, 1, 0])
            except Exception as exc:  # noqa: BLE001
                log.debug("nanwatch: closing header failed: %r", exc)

    # ---- reporter thread ---------------------------------------------------------------------------
    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq - 1

    def _job_posts(self, own: StepReport, rlhf: dict | None) -> list[StepReport]:
        try:
            mine = contribution(own, rlhf, rank=self.rank)
            digest, broken = mine.table.digest(), 0
        except Exception as exc:  # noqa: BLE001 - still take part, so that no peer waits
            log.warning("nanwatch: could not lay out step %d for the job report: %r", own.step, exc)
            mine, digest, broken = None, 0, 1
        try:
            while True:
                h = self._header([own.step, -own.step, digest, -digest, 0, broken])
                if h[_CLOSING]:
                    self.active = False
                    return [own]
                if h[_BROKEN]:
                    return [own]
                if h[0] == -h[1]:
                    break
                if own.step < h[0]:
                    return [own]  # behind (a peer dropped this step, or this rank one before): catch up
                # a peer is behind: the same step again, while it posts its own reports and catches up
            return self._reduce(mine, h[2] == -h[3])
        except Exception as exc:  # noqa: BLE001 - a timeout, a peer gone, a bug: per-rank reports from now on
            self.active = False
            log.warning("nanwatch: the job report's reduction failed at step %d (%r); this rank reports per rank "
                        "from now on", own.step, exc)
            return [own]

    def _reduce(self, mine: Contribution, same_table: bool) -> list[StepReport]:
        d = torch.distributed
        table = mine.table
        if not same_table:  # rare: ranks saw different sites (MoE experts, watch() names)
            tables: list = [None] * self.world
            d.all_gather_object(tables, table, group=self._group)
            table = merge_tables(tables)
        sums, maxes = mine.vectors(table, world=self.world)
        t_sum = torch.tensor(sums, dtype=torch.float64)
        t_max = torch.tensor(maxes, dtype=torch.float64)
        d.all_reduce(t_sum, op=d.ReduceOp.SUM, group=self._group)
        d.all_reduce(t_max, op=d.ReduceOp.MAX, group=self._group)
        job = reduce_job(mine.report, table, t_sum.tolist(), t_max.tolist(), world=self.world)  # sync-ok: CPU (gloo)
        posts = [job.report] if self.rank == 0 else []
        if mine.differs(job) is not None:
            posts.append(mine.report.model_copy(update={"scope": "detail"}))
        elif self.rank != 0 and time.monotonic() - self._last_post >= self._heartbeat_s:
            posts.append(heartbeat(mine.report, self._heartbeat_s))
        return posts

    def _header(self, values: list[int]) -> list[int]:
        d = torch.distributed
        t = torch.tensor(values, dtype=torch.int64)
        d.all_reduce(t, op=d.ReduceOp.MAX, group=self._group)
        return t.tolist()  # sync-ok: a CPU tensor (gloo), on the reporter thread


def heartbeat(own: StepReport, every_s: float) -> StepReport:
    """A rank's liveness for the step of ``own``: ids, step, directive state and drops, no measurements; and
    the interval the next one comes at (``every_s``)."""
    return StepReport(run_id=own.run_id, scope="heartbeat", heartbeat_s=every_s, rank=own.rank,
                      world_size=own.world_size,
                      incarnation=own.incarnation, seq=own.seq, step=own.step, time=own.time,
                      agree_every=own.agree_every, attention_mode=own.attention_mode,
                      directive_version=own.directive_version, step_skipped=own.step_skipped,
                      nonfinite_rank=own.nonfinite_rank, dropped_reports=own.dropped_reports)
