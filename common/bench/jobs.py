"""What ``nanwatch bench collector`` sends, per rank or per job (wire 1.4), and ``--matrix``: the same
jobs sent both ways, side by side, each against a fresh collector.

Per-rank (``--scope rank``, every sender before 1.4): each rank posts its report of S sites every step.
Job-level (``--scope job``): per step one batch from the job (its reduced report plus ``--details`` detail
reports of ranks that differ), and every rank's heartbeat every ``--heartbeat-every`` s, ``--heartbeat-batch``
ranks to a request. Bodies are encoded once per sender (only seq and step change), so the generator stays
cheap; senders share ``--connections`` keep-alive connections (a 65,536-rank job cannot hold a descriptor
per rank, on either side).

Also here, for the collector's tests: :func:`job_step`, a reference reduction of one step's rank reports
into the job report and detail reports, and :func:`heartbeat`.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import dataclass

from nanwatch.wire import LogitStat, ReportBatch, SdpaCall, SiteStat, StepReport

__all__ = ["Sender", "heartbeat", "job_step", "matrix_configs", "priming", "senders"]

_MARK = '"seq":0,"step":0'


def _reduce_sites(reports: list[StepReport]) -> list[SiteStat]:
    """Per (site, phase, stage): calls, elements and non-finite calls summed, amax and headroom maxed (a NaN
    wins, as in the collector) -- the reduction a job report carries."""
    out: dict[tuple, SiteStat] = {}
    for r in reports:
        for s in r.sites:
            key = (s.site, s.phase, s.stage)
            cur = out.get(key)
            if cur is None:
                out[key] = s.model_copy()
                continue
            nan_h = cur.headroom != cur.headroom or s.headroom != s.headroom
            out[key] = cur.model_copy(update=dict(
                calls=cur.calls + s.calls, numel=cur.numel + s.numel, nan=cur.nan + s.nan, inf=cur.inf + s.inf,
                amax=max(cur.amax, s.amax) if cur.amax == cur.amax and s.amax == s.amax else math.nan,
                headroom=math.nan if nan_h else max(cur.headroom, s.headroom)))
    return list(out.values())


def job_step(reports: list[StepReport], *, seq: int | None = None) -> tuple[StepReport, list[StepReport]]:
    """One step's rank reports (all ranks, the same step) as wire 1.4 sends them in job mode: the job report
    (posted by the lowest rank: sites reduced, SDPA calls summed, logit bounds maxed, the first offender the
    earliest in execution order, ties to the lowest rank) and the detail reports of the ranks that differ
    (a non-finite value, another backend or attention mode than the poster's). A reference for the bench
    and the collector's tests; the trainer's reduction is ``nanwatch.hooks``'."""
    reports = sorted(reports, key=lambda r: r.rank)
    head = reports[0]
    sdpa: dict[tuple, SdpaCall] = {}
    for c in (c for r in reports for c in r.sdpa):
        key = (c.site, c.backend, c.dtype, c.stage, c.shape)
        sdpa[key] = sdpa[key].model_copy(update={"calls": sdpa[key].calls + c.calls}) if key in sdpa else c
    logits: dict[str, LogitStat] = {}
    for lg in (lg for r in reports for lg in r.logits):
        if lg.layer not in logits or lg.bound > logits[lg.layer].bound:
            logits[lg.layer] = lg
    order = {(s.site, s.phase): i for i, s in enumerate(head.sites)}
    offenders = [(order.get((r.first_offender, r.first_offender_phase), len(order)), r.rank, r)
                 for r in reports if r.first_offender is not None]
    first = min(offenders, key=lambda t: t[:2])[2] if offenders else None
    skipped = [r.step_skipped for r in reports if r.step_skipped is not None]
    job = head.model_copy(update=dict(
        scope="job", seq=head.seq if seq is None else seq, sites=_reduce_sites(reports), sdpa=list(sdpa.values()),
        logits=list(logits.values()), ranks_reporting=len(reports), step_skipped=any(skipped) if skipped else None,
        incident=first.incident if first else None, first_offender=first.first_offender if first else None,
        first_offender_phase=first.first_offender_phase if first else None,
        first_offender_stage=first.first_offender_stage if first else None,
        first_offender_rank=first.rank if first else None))
    backends = {(c.site, c.backend) for c in head.sdpa}
    details = [r.model_copy(update={"scope": "detail", "first_offender_rank": r.rank if r.first_offender else None})
               for r in reports if r.nonfinite_total or r.attention_mode != head.attention_mode
               or {(c.site, c.backend) for c in r.sdpa} != backends]
    return job, details


def heartbeat(*, run_id: str, rank: int, world_size: int, seq: int, step: int, incarnation: str = "inc0",
              mode: str = "none", dropped: int = 0, time_s: float = 1.7e9, every_s: float | None = None) -> StepReport:
    """A rank's job-mode heartbeat: liveness, mode, dropped reports, its interval; no measurements."""
    return StepReport(run_id=run_id, scope="heartbeat", rank=rank, world_size=world_size, incarnation=incarnation,
                      seq=seq, step=step, time=time_s, attention_mode=mode, dropped_reports=dropped,
                      heartbeat_s=every_s)


# ---- the load: senders -------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Sender:
    """One stream of POSTs on one connection: body ``n`` at ``offset + n * every`` seconds from the start
    (``reports`` reports per body; ``kind`` labels its latency: rank, job or heartbeat; ``run(n)``: body ``n``'s
    run id)."""

    kind: str
    every: float
    offset: float
    reports: int
    body: Callable[[int], bytes]
    run: Callable[[int], str]
    """The run id of body ``n`` (a load balancer routing by run id reads it: ``--route sticky``)."""


class _Template:
    """A batch encoded once; ``fill(n)`` sets every report's seq and step to ``n``."""

    def __init__(self, reports: list[StepReport]) -> None:
        self._parts = [p.encode() for p in ReportBatch(reports=reports).model_dump_json().split(_MARK)]

    def fill(self, n: int) -> bytes:
        return f'"seq":{n},"step":{n}'.encode().join(self._parts)


class _RankTemplate:
    """One rank report encoded once for every rank of a job: ``fill(rank, n)`` (65,536 ranks x 64 sites
    would not fit in memory as bodies)."""

    def __init__(self, report: StepReport) -> None:
        text = ReportBatch(reports=[report]).model_dump_json()
        head, tail = text.split('"rank":0,', 1)
        self._head = head.encode()
        self._tail = [p.encode() for p in tail.split(_MARK)]

    def fill(self, rank: int, n: int) -> bytes:
        return self._head + f'"rank":{rank},'.encode() + f'"seq":{n},"step":{n}'.encode().join(self._tail)


def _round_robin(templates: list[_Template], *, first: int = 0) -> Callable[[int], bytes]:
    """Body ``n``: template ``n % len`` at round ``first + n // len`` (each rank's seq rises by one a round)."""
    k = len(templates)
    return lambda n: templates[n % k].fill(first + n // k)


def priming(args: argparse.Namespace) -> list[tuple[str, bytes]]:
    """Job mode: every rank's heartbeat once (seq 0, 256 to a request), posted before the clock starts, so
    that the collector holds every rank from the first measured second, as it does a job in its stride
    (the timed heartbeats start at seq 1). Each body with its run id (for routing)."""
    if args.scope != "job":
        return []
    runs = [args.run_id if args.jobs == 1 else f"{args.run_id}-{j}" for j in range(args.jobs)]
    return [(run_id, ReportBatch(reports=[heartbeat(run_id=run_id, rank=k, world_size=args.ranks, seq=0, step=0,
                                                    every_s=args.heartbeat_every)
                                          for k in range(a, min(a + 256, args.ranks))]).model_dump_json().encode())
            for run_id in runs for a in range(0, args.ranks, 256)]


def senders(args: argparse.Namespace, report: Callable[..., StepReport]) -> list[Sender]:
    """Everything one bench configuration sends (``report``: ``synthetic_report``)."""
    layers = max(1, (args.sites - 2) // 2)  # two sites per layer, plus logits and logprobs

    def rank_report(run_id: str, rank: int, **kw: object) -> StepReport:
        return report(run_id=run_id, rank=rank, world_size=args.ranks, seq=0, step=0, layers=layers,
                      time_s=1.7e9, **kw)

    runs = [args.run_id if args.jobs == 1 else f"{args.run_id}-{j}" for j in range(args.jobs)]
    if args.scope == "rank":  # every rank of every job, spread over the connections
        templates = {run_id: _RankTemplate(rank_report(run_id, 0)) for run_id in runs}
        streams = [(templates[run_id], rank, run_id) for run_id in runs for rank in range(args.ranks)]
        lanes = min(len(streams), args.connections)
        out = []
        for i in range(lanes):
            mine = streams[i::lanes]

            def body(n: int, mine: list = mine) -> bytes:
                template, rank, _ = mine[n % len(mine)]
                return template.fill(rank, n // len(mine))

            out.append(Sender("rank", 1.0 / (args.rate * len(mine)), i / lanes / args.rate, 1, body,
                              lambda n, mine=mine: mine[n % len(mine)][2]))
        return out
    out = []
    heartbeat_lanes = max(1, (args.connections - len(runs)) // len(runs))
    for j, run_id in enumerate(runs):
        reports = [rank_report(run_id, 0)] + [rank_report(run_id, args.ranks - 1 - d, backend="math")
                                              for d in range(min(args.details, args.ranks - 1))]
        job, details = job_step(reports)
        job = job.model_copy(update={"ranks_reporting": args.ranks})
        out.append(Sender("job", 1.0 / args.rate, j / len(runs) / args.rate, 1 + len(details),
                          _round_robin([_Template([job, *details])]), lambda n, run_id=run_id: run_id))
        groups = [list(range(a, min(a + args.heartbeat_batch, args.ranks)))
                  for a in range(0, args.ranks, args.heartbeat_batch)]
        lanes = min(len(groups), heartbeat_lanes)
        for i in range(lanes):
            mine = groups[i::lanes]
            templates = [_Template([heartbeat(run_id=run_id, rank=k, world_size=args.ranks, seq=0, step=0, every_s=args.heartbeat_every)
                                    for k in g]) for g in mine]
            out.append(Sender("heartbeat", args.heartbeat_every / len(mine),
                              (j + i / lanes) * args.heartbeat_every / len(runs) / max(1, len(mine)),
                              args.heartbeat_batch, _round_robin(templates, first=1), lambda n, run_id=run_id: run_id))
    return out


def matrix_configs(args: argparse.Namespace) -> list[dict]:
    """``--matrix``: each of ``--matrix-ranks`` sent per rank and per job, at each of ``--matrix-scrapes``."""
    return [dict(ranks=n, scope=scope, scrape_every=every) for n in args.matrix_ranks
            for every in args.matrix_scrapes for scope in ("rank", "job")]
