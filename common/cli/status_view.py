"""What ``nanwatch status`` prints, from either source: the collector's run view (``GET /v1/runs/{id}``, JSON)
or a trainer's local JSONL record (``MonitorConfig.log.dir``, see ``nanwatch.hooks.report.local_log``), folded here
into the same shape. One renderer prints both, so a figure reads the same wherever it came from.

The fold mirrors the collector's ingest where it matters: run-level totals (non-finite site visits, SDPA
calls, skipped steps) come from ``rank`` and ``job`` reports only (a ``detail`` report's figures are already
in its job report), and a rank's view is its latest report. The lifecycle of a rank in a file: ``crashed``
when its latest report carries ``raised``; ``ended`` when the Monitor wrote its closing record; ``live`` when
its latest report is recent; otherwise ``silent`` (hung, or killed without a word), with how long. The run's
status is the collector's word for it, decided in one place for both (``nanwatch.run_status``).

Imports nothing heavy (the CLI must start fast): the standard library, ``nanwatch.readable`` and
``nanwatch.run_status``.
"""

from __future__ import annotations

import glob
import json
import math
import os
import re
import time
from collections.abc import Iterable, Iterator
from typing import Any

from nanwatch import readable
from nanwatch.run_status import CRASHED, ENDED, IDLE, LIVE, SILENT, run_status

__all__ = ["DEFAULT_LATE_S", "fold", "lifecycle", "read_records", "render_detail", "render_summary"]

#: A rank silent this long is ``silent`` (the collector's own default, ``NANWATCH_RANK_LATE_S``)
DEFAULT_LATE_S = 90.0
_BACKUP = re.compile(r"\.jsonl(?:\.(\d+))?$")


def _files(path: str) -> list[list[str]]:
    """The JSONL file sets under ``path`` (a file, one of its rotated backups, or a folder): each set is one
    Monitor's file and its backups, oldest first (``.N`` ... ``.1``, then the current one)."""
    if os.path.isdir(path):
        names = [p for p in glob.glob(os.path.join(path, "*.jsonl*")) if _BACKUP.search(p)]
    else:
        base = _BACKUP.sub(".jsonl", path) if _BACKUP.search(path) else path
        names = [p for p in (base, *glob.glob(glob.escape(base) + ".*")) if os.path.isfile(p)] or [path]
    sets: dict[str, list[tuple[int, str]]] = {}
    for p in names:
        m = _BACKUP.search(p)
        base = p[: m.start()] + ".jsonl" if m else p
        sets.setdefault(base, []).append((int(m.group(1)) if m and m.group(1) else 0, p))
    return [[p for _, p in sorted(members, reverse=True)] for _, members in sorted(sets.items())]


#: the longest line of a local record read, in bytes (a trainer's report is far shorter); a longer one is
#: skipped without being held in memory
MAX_LINE_BYTES = 16 * 2**20


def _lines(f, skipped: list[str], name: str) -> Iterator[bytes]:
    """The lines of a binary file, each at most ``MAX_LINE_BYTES``: a longer one is read past, not kept."""
    while True:
        line = f.readline(MAX_LINE_BYTES + 1)
        if not line:
            return
        if len(line) > MAX_LINE_BYTES and not line.endswith(b"\n"):
            while (rest := f.readline(2**20)) and not rest.endswith(b"\n"):
                pass
            skipped.append(f"{name}: a line over {MAX_LINE_BYTES // 2**20} MiB")
            continue
        yield line


def read_records(path: str, *, skipped: list[str] | None = None) -> Iterator[dict[str, Any]]:
    """Every record under ``path``, file set by file set, each in the order it was written. A line that is
    not JSON (a torn last line) or not UTF-8 is skipped; one nested too deep or over ``MAX_LINE_BYTES`` is
    skipped and described in ``skipped``."""
    skipped = [] if skipped is None else skipped
    for members in _files(path):
        for p in members:
            with open(p, "rb") as f:
                for line in _lines(f, skipped, p):
                    try:
                        rec = json.loads(line.decode("utf-8"))  # NaN and Infinity are JSON constants, as on the wire
                    except ValueError:
                        continue
                    except RecursionError:
                        skipped.append(f"{p}: a line nested too deep")
                        continue
                    if isinstance(rec, dict):
                        yield rec


def _headroom(sites: list[dict]) -> dict[str, float]:
    """The collector's per-kind headroom of one report: backward sites count as ``grad``; a NaN shows."""
    out: dict[str, float] = {}
    for s in sites:
        kind = "grad" if s.get("phase") == "backward" else s.get("kind", "tensor")
        h, cur = float(s.get("headroom", math.nan)), out.get(kind)
        if cur is None or h > cur or h != h:
            out[kind] = h
    return out


class _Run:
    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.latest_step = 0
        self.nonfinite = 0.0
        self.job_skipped = 0
        self.sdpa: dict[tuple[str, str, str], float] = {}
        self.first: dict | None = None
        self.events: list[dict] = []
        self.ranks: dict[int, dict] = {}  # rank -> view of its latest incarnation
        self.ended: dict[tuple[int, str], float] = {}
        self.rollout_nonfinite = 0.0
        self.latest_published: int | None = None
        self.spike_steps: dict[str, set[tuple[str, int]]] = {}  # site kind -> (stage, step): once per step
        self.latest_spikes: list[dict] = []

    def report(self, r: dict) -> None:
        scope, rank, step = r.get("scope", "rank"), int(r.get("rank", 0)), int(r.get("step", 0))
        self.latest_step = max(self.latest_step, step)
        sites = r.get("sites") or []
        visits = sum(s.get("nan", 0) + s.get("inf", 0) for s in sites)
        run_level = scope in ("rank", "job")
        if run_level:
            self.nonfinite += visits
            for c in r.get("sdpa") or []:
                key = (c["backend"], c["dtype"], c.get("stage", "train"))
                self.sdpa[key] = self.sdpa.get(key, 0.0) + c.get("calls", 1)
            self.job_skipped += scope == "job" and bool(r.get("step_skipped"))
            fo = r.get("first_offender")
            if fo is not None and (self.first is None or r["time"] < self.first["time"]):
                who = r.get("first_offender_rank")
                self.first = dict(site=fo, phase=r.get("first_offender_phase"), stage=r.get("first_offender_stage"),
                                  rank=rank if who is None else who, step=step, time=r["time"])
        self._rollout(r, scope, rank, run_level)
        if run_level and r.get("spikes"):
            self._spikes(r, rank, step)
        inc = r.get("incident")
        if inc is not None and scope != "detail":
            detail = {k: v for k, v in inc.items() if k not in ("site", "step")}
            self.events.append(dict(time=r["time"], kind="incident", step=inc.get("step"), rank=rank,
                                    site=inc.get("site"), actor="", detail=detail))
        view = self.ranks.get(rank)
        if scope == "heartbeat":
            if view is not None and r["time"] >= view["time"]:
                view["time"] = r["time"]
            return
        if view is not None and (r["time"], r.get("seq", 0)) < (view["time"], view["seq"]):
            return  # an older incarnation's report, read after a newer one's
        skipped = (view["skipped_steps"] if view is not None and view["incarnation"] == r["incarnation"] else 0)
        if view is not None and view["incarnation"] == r["incarnation"] and view["attention_mode"] != r.get(
                "attention_mode", "none"):
            self.events.append(dict(time=r["time"], kind="mode_changed", step=step, rank=rank, site=None, actor="",
                                    detail={"previous_mode": view["attention_mode"],
                                            "directive_version": r.get("directive_version", 0)}))
        if r.get("stage", "train") != "train" and view is not None and view["incarnation"] == r["incarnation"]:
            view.update(time=r["time"], seq=r.get("seq", 0), raised=r.get("raised"))  # eval: liveness only
            return
        logits = [float(lg["bound"]) for lg in r.get("logits") or []]
        self.ranks[rank] = dict(
            rank=rank, incarnation=r["incarnation"], seq=r.get("seq", 0), scope=scope, step=step, time=r["time"],
            world_size=r.get("world_size", 1), attention_mode=r.get("attention_mode", "none"),
            directive_version=r.get("directive_version", 0), dropped_reports=r.get("dropped_reports", 0),
            nonfinite=visits, first_offender=r.get("first_offender"),
            first_offender_phase=r.get("first_offender_phase"), headroom=_headroom(sites),
            logit_max=max(logits) if logits else None, rlhf=r.get("rlhf"), raised=r.get("raised"),
            skipped_steps=skipped + bool(r.get("step_skipped") and scope in ("rank", "detail")))

    def _rollout(self, r: dict, scope: str, rank: int, run_level: bool) -> None:
        """The rollout's own non-finite logprobs and its classified events, as the collector folds them (wire
        1.8): counted and logged from run-level reports; an attribution from any measured one."""
        if run_level:
            self.rollout_nonfinite += ((r.get("rlhf") or {}).get("nonfinite") or {}).get("rollout_logprobs", 0)
            for ev in r.get("rollout_events") or []:
                self.events.append(dict(time=r["time"], kind="rollout_mismatch", step=ev.get("step"), rank=rank,
                                        site=None, actor="", detail=ev))
        at = r.get("rollout_attribution")
        if at is not None and scope != "heartbeat":
            self.events.append(dict(time=r["time"], kind="rollout_attribution", step=r.get("step"), rank=rank,
                                    site=at.get("module"), actor="", detail=at))

    def _spikes(self, r: dict, rank: int, step: int) -> None:
        """A run-level report's spikes, as the collector counts them (wire 1.9): one per step and site kind
        (backward sites are ``grad``), and the latest report's spikes."""
        for s in r["spikes"]:
            kind = "grad" if s.get("phase") == "backward" else s.get("kind", "tensor")
            self.spike_steps.setdefault(kind, set()).add((r.get("stage", "train"), step))
        if not self.latest_spikes or step >= self.latest_spikes[0]["step"]:
            self.latest_spikes = [dict(s, step=step, rank=rank) for s in r["spikes"][:8]]

    def published(self, rec: dict) -> None:
        """A ``weights_published`` record (``Monitor.publish_weights``): the trainer's side only."""
        version = rec.get("version")
        if isinstance(version, int) and not isinstance(version, bool):
            self.latest_published = max(self.latest_published if self.latest_published is not None else -1, version)

    def closed(self, rec: dict) -> None:
        self.ended[(int(rec.get("rank", 0)), str(rec.get("incarnation", "")))] = float(rec.get("time", 0.0))

    def detail(self, now: float, late_s: float) -> dict[str, Any]:
        ranks = []
        for view in sorted(self.ranks.values(), key=lambda v: v["rank"]):
            ended = self.ended.get((view["rank"], view["incarnation"]))
            silent = max(0.0, now - view["time"])
            state = (CRASHED if view["raised"] else ENDED if ended is not None
                     else LIVE if silent <= late_s else SILENT)
            ranks.append({**view, "state": state, "silent_s": silent, "late": state == SILENT})
        first_nf = []
        if self.first is not None:
            first_nf = [dict(time=self.first["time"], kind="first_nonfinite", step=self.first["step"],
                             rank=self.first["rank"], site=self.first["site"], actor="",
                             detail={"phase": self.first["phase"], "stage": self.first["stage"] or "train"})]
        events = sorted(first_nf + self.events, key=lambda e: e["time"])
        last = max((v["time"] for v in self.ranks.values()), default=None)
        skipped = max((v["skipped_steps"] for v in self.ranks.values()), default=0) + self.job_skipped
        top = self.ranks.get(0) or next(iter(self.ranks.values()), None)
        return dict(
            run_id=self.run_id, source="file", live_ranks=sum(v["state"] == LIVE for v in ranks),
            latest_step=self.latest_step, last_report_time=last, nonfinite_total=self.nonfinite,
            skipped_steps=skipped,
            directive=None if top is None else dict(version=top["directive_version"], mode=top["attention_mode"]),
            first_offender=None if self.first is None else {k: v for k, v in self.first.items() if k != "time"},
            ranks=ranks, sdpa=[dict(backend=b, dtype=d, stage=s, calls=n) for (b, d, s), n in sorted(self.sdpa.items())],
            rollout=next((((v.get("rlhf") or {}).get("rollout")) for v in ranks if v["scope"] == "job"), None),
            rollout_nonfinite_total=self.rollout_nonfinite, event_counts={}, events=events,
            spikes_total={k: len(v) for k, v in sorted(self.spike_steps.items())}, latest_spikes=self.latest_spikes,
            weight_sync=None if self.latest_published is None else {"latest_published": self.latest_published,
                                                                     "workers": None})


def fold(records: Iterable[dict[str, Any]], *, now: float | None = None,
         late_s: float = DEFAULT_LATE_S) -> list[dict[str, Any]]:
    """Run views (the collector's ``RunDetail`` shape, plus ``source``, ``skipped_steps`` and each rank's
    ``state``) from a local record's reports and closing records, one per run id, sorted."""
    runs: dict[str, _Run] = {}
    for rec in records:
        run_id = rec.get("run_id")
        if not isinstance(run_id, str):
            continue
        run = runs.get(run_id) or runs.setdefault(run_id, _Run(run_id))
        if rec.get("nanwatch_log") == "closed" or rec.get("final") is True:  # a final report: a normal end
            run.closed(rec)
        elif rec.get("nanwatch_log") == "weights_published":
            run.published(rec)
        elif "seq" in rec and "incarnation" in rec and str(rec.get("v", "1")).split(".")[0] == "1":
            run.report(rec)
    now = time.time() if now is None else now
    return [runs[k].detail(now, late_s) for k in sorted(runs)]


def lifecycle(r: dict[str, Any]) -> str:
    """A run's lifecycle in a few words: its status (``nanwatch.run_status``: crashed, silent, live, ended or
    idle) and, for crashed or silent, which rank and how. A collector that reports its own is taken at its
    word: ``status: crashed`` and ``crashed_ranks`` (the collector's run view), or a rank's ``crashed``
    exception type."""
    ranks = r.get("ranks") or []
    crashed = [{"rank": v["rank"], "raised": v.get("raised") or v.get("crashed"), "step": v.get("step")}
               for v in ranks if v.get("state") == CRASHED or v.get("raised") or v.get("crashed")]
    crashed += [c for c in r.get("crashed_ranks") or () if c["rank"] not in {v["rank"] for v in crashed}]
    late = [v for v in ranks if v.get("late")]
    ended = r.get("status") == ENDED or r.get("ended") or (ranks and all(v.get("state") == ENDED or v.get("ended")
                                                                        for v in ranks))
    status = run_status(crashed=r.get("status") == CRASHED or bool(crashed), silent=bool(late),
                        live=bool(r.get("live_ranks")), ended=bool(ended))
    if status == CRASHED:
        which = ", ".join(f"rank {c['rank']} raised {c.get('raised') or '?'}"
                          + (f" at step {c['step']}" if c.get("step") is not None else "") for c in crashed)
        return CRASHED + (f" ({which})" if which else "")
    if status == SILENT:
        v = max(late, key=lambda v: v.get("silent_s") or 0)
        return f"{SILENT}: rank {v['rank']} quiet for {v.get('silent_s', 0):.0f} s (hung, or gone without a word)"
    return _IDLE_WORDS if status == IDLE else status


#: what ``idle`` means, said in full to a person
_IDLE_WORDS = "no live rank (ended or gone; totals are kept)"


def _headroom_line(by_kind: dict[str, float]) -> str:
    """Headroom per site kind, kinds that read alike grouped: ``<0.01% of max everywhere`` on a healthy run."""
    groups: dict[str, list[str]] = {}
    for kind, h in sorted(by_kind.items()):
        groups.setdefault(readable.headroom(h), []).append(kind)
    if len(groups) == 1:
        return f"{next(iter(groups))} everywhere"
    return "; ".join(f"{', '.join(kinds)} {text}" for text, kinds in groups.items())


def render_summary(r: dict[str, Any]) -> str:
    """One line for a run list: its state, and every kind of incident that pages (non-finite, by class, rollout
    mismatches by cause, failed weight syncs), so a run that raised no NaN is not hidden among clean ones."""
    d = r.get("directive") or {}
    line = (f"{r['run_id']}: {lifecycle(r)}, {r['live_ranks']} live ranks, step {r['latest_step']}, "
            f"{readable.visits(r['nonfinite_total'])}, {r.get('skipped_steps', 0):g} skipped steps, "
            f"directive v{d.get('version', 0)} {d.get('mode', 'none')}")
    more = [f"incidents {', '.join(f'{n:g} {c}' for c, n in (r.get('incidents') or {}).items())}"
            if r.get("incidents") else "",
            f"rollout {', '.join(f'{n:g} {c}' for c, n in (r.get('rollout_events') or {}).items())}"
            if r.get("rollout_events") else "",
            f"{r['weight_sync_mismatches']:g} failed weight syncs" if r.get("weight_sync_mismatches") else ""]
    return "; ".join([line, *(m for m in more if m)])


def _rollout_lines(r: dict[str, Any]) -> list[str]:
    """The run's rollout mismatch (its latest step, over ranks), and its latest classified mismatch and module
    attribution (wire 1.8), when it has any."""
    out = []
    if r.get("rollout"):
        out.append(f"  rollout vs trainer: {readable.rollout(r['rollout'], r.get('rollout_nonfinite_total', 0))}")
    elif r.get("rollout_nonfinite_total"):
        out.append(f"  rollout vs trainer: {readable.rollout(None, r['rollout_nonfinite_total'])}")
    evs = r.get("events") or []
    for kind, say in (("rollout_mismatch", readable.rollout_event), ("rollout_attribution", readable.attribution)):
        e = next((e for e in reversed(evs) if e["kind"] == kind), None)
        if e is not None:
            label = "rollout mismatch" if kind == "rollout_mismatch" else "rollout attribution"
            out.append(f"  {label} at step {e['step']} on rank {e['rank']}: {say(e['detail'])}")
    return out


#: rollout workers ``nanwatch status`` lists by name (the lagging and failing ones first); the rest are counted
_WORKERS_SHOWN = 8
_WORKER_ORDER = {"mismatch": 0, "unverifiable": 1, "waiting": 2, "verified": 3}


def _weight_sync_lines(r: dict[str, Any]) -> list[str]:
    """The run's weight syncs (the collector's ``weight_sync``): the latest published version, and per rollout
    worker its latest outcome, what it last posted and verified, and its lag."""
    ws = r.get("weight_sync")
    if not ws:
        return []
    latest = ws.get("latest_published")
    if ws.get("workers") is None:  # a trainer's local record: its side alone
        return [f"  weight sync: latest published v{latest} (the trainer's record: the rollout workers' verdicts "
                "and lag are the collector's: `nanwatch status RUN --url URL`)"]
    workers = ws["workers"]
    counts = {k: sum(w["outcome"] == k for w in workers.values()) for k in _WORKER_ORDER}
    lagging = sum(bool(w.get("lag")) for w in workers.values())
    out = [f"  weight sync: latest published {'v' + str(latest) if latest is not None else 'none yet'}; "
           f"{len(workers)} rollout workers: {counts['verified']} verified, {counts['mismatch']} mismatched, "
           f"{counts['unverifiable']} dtype or shape differs, {lagging} lagging"]
    order = sorted(workers.items(), key=lambda kv: (-(kv[1].get("lag") or 0), _WORKER_ORDER.get(kv[1]["outcome"], 4),
                                                    kv[0]))
    for name, w in order[:_WORKERS_SHOWN]:
        word = {"unverifiable": "dtype or shape differs"}.get(w["outcome"], w["outcome"])
        verified = f"v{w['latest_verified']}" if w.get("latest_verified") is not None else "none"
        lag = f"; LAGS {w['lag']} versions" if w.get("lag") else ""
        out.append(f"    worker {name}: {word}, posted v{w['latest_posted']}, verified {verified}{lag}")
    if len(order) > _WORKERS_SHOWN:
        out.append(f"    ... and {len(order) - _WORKERS_SHOWN} more workers")
    return out


def _spike_lines(r: dict[str, Any]) -> list[str]:
    """The run's spike steps by site kind and its latest spikes (wire 1.9): precursors, not incidents."""
    totals, latest = r.get("spikes_total") or {}, r.get("latest_spikes") or []
    if not totals and not latest:
        return []
    out = ["  spike steps (a site over k x its baseline, finite): "
           + (", ".join(f"{k} {v:g}" for k, v in sorted(totals.items())) or "-")]
    if latest:
        out.append(f"  latest spikes at step {latest[0]['step']} on rank {latest[0]['rank']}: "
                   f"{readable.spikes(latest)}")
    return out


def render_detail(r: dict[str, Any], *, events: int = 20) -> list[str]:
    """The lines of one run's view (from the collector's JSON or from :func:`fold`)."""
    d, fo = r.get("directive") or {}, r.get("first_offender")
    out = [f"run {r['run_id']}: {lifecycle(r)}; {r['live_ranks']} live ranks, latest step {r['latest_step']}"]
    if "set_by" in d:
        out.append(f"  directive: v{d['version']} {d['mode']} from step {d['apply_at_step']} "
                   f"(set by {d['set_by'] or '-'}: {d['reason'] or '-'})")
    elif d:
        out.append(f"  attention mode: {d.get('mode', 'none')} (directive v{d.get('version', 0)})")
    if fo:
        stage = f", {fo['stage']}" if fo.get("stage") else ""
        out.append(f"  first non-finite: {fo['site']} ({fo['phase']}{stage}) on rank {fo['rank']} at step {fo['step']}")
    else:
        out.append("  no non-finite value seen")
    out.append(f"  non-finite site visits: {r['nonfinite_total']:g} (a visit is one call of a site, in one step, "
               "whose tensor held a NaN or an Inf; not elements)")
    for e in r.get("events") or []:
        if e["kind"] == "incident":
            out.append(f"  incident at step {e['step']} on rank {e['rank']}: {readable.incident(e['detail'])}")
    out += _rollout_lines(r)
    out += _weight_sync_lines(r)
    out += _spike_lines(r)
    out.append(f"  skipped steps: {r.get('skipped_steps', 0):g} (the weight guard kept them out of the weights)")
    stages = {"train": 0, "eval": 1, "generate": 2}
    for s in sorted(r.get("sdpa") or [], key=lambda s: (s["backend"], s["dtype"], stages.get(s.get("stage"), 3))):
        out.append(f"  sdpa {s['backend']:<10} {s['dtype']:<9} {s.get('stage', 'train'):<8} {s['calls']:g} calls")
    for st in r.get("ranks") or []:
        head = _headroom_line(st.get("headroom") or {})
        state = st.get("state") or ("ended" if st.get("ended") else "silent" if st.get("late") else "live")
        state += f" {st['silent_s']:.0f} s" if state == "silent" and st.get("silent_s") is not None else ""
        skipped = f", {st['skipped_steps']:g} skipped" if "skipped_steps" in st else ""
        out.append(f"  rank {st['rank']}: {state}, step {st['step']}, mode {st['attention_mode']}, "
                   f"{readable.visits(st['nonfinite'])} in its latest step, logit max {readable.figure(st['logit_max'])}"
                   f", dropped {st['dropped_reports']}{skipped}")
        if head:
            out.append(f"    headroom (amax / dtype max): {head}")
        if st.get("rlhf"):
            out.append(f"    rlhf: {readable.rlhf(st['rlhf'])}")
            if st["rlhf"].get("rollout") and not r.get("rollout"):
                nonfinite = (st["rlhf"].get("nonfinite") or {}).get("rollout_logprobs", 0)
                out.append(f"    rollout vs trainer: {readable.rollout(st['rlhf']['rollout'], nonfinite)}")
    if events:
        for e in (r.get("events") or [])[-events:]:
            out.append(f"  event {e['kind']:<24} step {e['step']} rank {e['rank']} {e['site'] or ''} "
                       f"{e['actor'] or ''} {json.dumps(e['detail'])}")
    return out
