"""What a request may do, checked before anything is applied: whether it claims only what its senders own
(``Caps.check``: the run's job poster, a final report's incarnation), whether it may add what it adds under
the run and incarnation caps (``Caps.over``), and which high-water marks may be forgotten to make room under
the incarnation cap (``Caps.stale``). Apart from the
state they read, so that the state holds runs and the caps decide what may join them; the ledger asks before
anything is applied.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from nanwatch.monitor.data.auth import ANY_NAMESPACE
from nanwatch.monitor.data.refusal import Refused
from nanwatch.monitor.data.state import CollectorState, RunState
from nanwatch.wire import ReportBatch

__all__ = ["Caps"]


class Caps:
    """What the caps remember between requests: each namespace's run ids, and the runs found full."""

    def check(self, state: CollectorState, batch: ReportBatch, keys: set[tuple[str, int, str]]) -> list[tuple[str, int, str]]:
        """Refuse a batch that claims what its senders do not own (``Refused``: a job report from another
        rank than the run's poster, a final report of another incarnation than the one held; nothing is
        applied), else the high-water marks to forget so that its new (run, rank, incarnation) ``keys`` fit
        (``stale``)."""
        _refuse_foreign_posters(state, batch)
        _refuse_blind_finals(state, batch)
        return self.stale(state, keys)

    def __init__(self) -> None:
        #: run ids by namespace, for the per-namespace run cap (``over``); built on first use
        self._namespace_runs: dict[str, set[str]] | None = None
        #: runs at their incarnation cap with no pair to forget, as they were then (``stale``)
        self._no_room: dict[str, tuple[int, ...]] = {}
        #: pairs and held ranks each namespace's runs hold, as last counted plus what was let in since (an upper
        #: bound: recounted only when it seems full, so a request costs O(its keys))
        self._namespace_pairs: dict[str, int] = {}

    def over(self, state: CollectorState, keys: set[tuple[str, int, str]], run_ids: set[str],
             heartbeats: set[tuple[str, int, str]] = frozenset(), *,
             namespace_of: Callable[[str], str] = lambda _run_id: ANY_NAMESPACE) -> str | None:
        """Why a request adding these runs and (run, rank, incarnation) keys must be refused (the cap hit,
        counted), or None. Checked before anything is applied. ``heartbeats``: the heartbeats' keys, which hold
        no high-water mark but a rank's liveness in memory: a run holds at most as many ranks as pairs.

        ``max_runs`` counts per namespace (``namespace_of``: the run-id namespace a run belongs to, whoever
        asks, so an admin's directive for a new run counts in that run's): one team's junk runs fill its
        own namespace, never another's."""
        new_runs = {r for r in run_ids if r not in state.runs}
        if new_runs:
            full = self._full_namespace(state, new_runs, namespace_of)
            if full is not None:
                state.caps_hit["runs"] += 1
                return (f"the namespace {full!r} holds at most {state.max_runs} runs (NANWATCH_MAX_RUNS) and this "
                        f"request adds {len(new_runs)}: finished runs are forgotten after NANWATCH_RUN_RETENTION_S, "
                        "or an admin deletes them (DELETE /v1/runs/{run_id})")
        fresh = Counter(run_id for run_id, rank, inc in keys if (run_id, rank, inc) not in state.hwm)
        held = Counter()  # ranks held in memory (heartbeats), bounded alike
        for run_id, rank, _inc in heartbeats:
            run = state.runs.get(run_id)
            if run is None or rank not in run.ranks:
                held[run_id] += 1
        adding: Counter[str] = Counter()
        for run_id, n in (*fresh.items(), *held.items()):
            run = state.runs.get(run_id)
            now_held = 0 if run is None else run.incarnations if run_id in fresh else len(run.ranks)
            if now_held + n > state.max_incarnations:
                state.caps_hit["incarnations"] += 1
                return (f"run {run_id!r} has reached {state.max_incarnations} (rank, incarnation) pairs "
                        "(NANWATCH_MAX_INCARNATIONS_PER_RUN): use a new run id for a new job")
            adding[namespace_of(run_id)] += n
        full = self._full_of_pairs(state, adding, namespace_of) if adding else None
        if full is not None:
            state.caps_hit["incarnations_per_namespace"] += 1
            return (f"the namespace {full!r} holds at most {state.max_incarnations_per_namespace} (rank, "
                    "incarnation) pairs and ranks over its runs (NANWATCH_MAX_INCARNATIONS_PER_NAMESPACE): "
                    "finished runs are forgotten after NANWATCH_RUN_RETENTION_S, or an admin deletes them")
        return None

    def _full_of_pairs(self, state: CollectorState, adding: Counter[str],
                       namespace_of: Callable[[str], str]) -> str | None:
        """The namespace that ``adding`` (new pairs or held ranks by namespace) would take past
        ``max_incarnations_per_namespace``, else None (and they are counted in). A namespace's count is an upper
        bound (pairs forgotten, ranks swept and runs deleted are not subtracted as they go) recounted over its
        runs when it seems full: a namespace at its bound costs one pass over its runs per refusal (#37)."""
        cap = state.max_incarnations_per_namespace
        for ns, n in adding.items():
            held = self._namespace_pairs.get(ns)
            if held is None or held + n > cap:
                members = self._members(state, namespace_of).get(ns, ())
                held = self._namespace_pairs[ns] = sum(
                    max(run.incarnations, len(run.ranks)) for r in members if (run := state.runs.get(r)) is not None)
                if held + n > cap:
                    return ns
        for ns, n in adding.items():
            self._namespace_pairs[ns] += n
        return None

    def _members(self, state: CollectorState, namespace_of: Callable[[str], str]) -> dict[str, set[str]]:
        """Each namespace's run ids (a superset: forgotten ones are pruned when a namespace seems full)."""
        if self._namespace_runs is None:
            self._namespace_runs = {}
            for run_id in state.runs:
                self._namespace_runs.setdefault(namespace_of(run_id), set()).add(run_id)
        return self._namespace_runs

    def stale(self, state: CollectorState, keys: set[tuple[str, int, str]]) -> list[tuple[str, int, str]]:
        """The high-water marks to forget so that ``keys`` (a request's new (run, rank, incarnation) pairs)
        fit under ``max_incarnations``: every pair of a run that would overflow whose rank is not held live
        under that incarnation. Empty while every run fits (the usual case costs one pass over ``keys``).

        Why forgetting them is safe: a high-water mark only stops a resend by the sender of that very
        incarnation, and a sender retries only while its process lives and reports; a process that does is
        held (its rank's view is of its incarnation, refreshed by each report and heartbeat). A pair not held
        was superseded by its rank's restart (elastic restarts stop every old process before starting the
        new ones) or has been silent a whole TTL (``NANWATCH_RANK_TTL_S``, 300 s, far beyond the sender's
        10 s longest back-off). So a run filled with junk incarnations makes room for a victim's restart
        instead of refusing it; junk held live (ranks that keep reporting) still counts until its TTL."""
        fresh = Counter(run_id for run_id, rank, inc in keys if (run_id, rank, inc) not in state.hwm)
        full = {run_id for run_id, n in fresh.items()
                if (run := state.runs.get(run_id)) is not None and run.incarnations + n > state.max_incarnations
                and self._no_room.get(run_id) != self._room_key(run)}
        if not full:
            return []
        stale = [(run_id, rank, inc) for run_id, rank, inc in state.hwm
                 if run_id in full and ((held := state.runs[run_id].ranks.get(rank)) is None or held.incarnation != inc)]
        # a run found with nothing to forget is not searched again (one pass over every mark) until its
        # ranks or incarnations change: a flood of refused new pairs costs no search each
        if len(self._no_room) > 2 * len(state.runs) + 16:
            self._no_room = {k: v for k, v in self._no_room.items() if k in state.runs}
        for run_id in full - {k[0] for k in stale}:
            self._no_room[run_id] = self._room_key(state.runs[run_id])
        return stale

    @staticmethod
    def _room_key(run: RunState) -> tuple[int, ...]:
        """What changes when one of a run's pairs may have stopped being live (a rank superseded, swept,
        ended or crashed, or a pair added)."""
        return run.incarnations, len(run.ranks), len(run.silent), len(run.ended_ranks), len(run.crashed)

    def _full_namespace(self, state: CollectorState, new_runs: set[str], namespace_of: Callable[[str], str]) -> str | None:
        """The namespace that ``new_runs`` would take past ``max_runs``, else None (and they are counted in).

        Each namespace's run ids are kept in a set that may hold ids no longer in ``runs`` (forgotten, or
        whose write was refused after this check): it is pruned to the live ones only when it seems full, so
        a request costs O(its new runs), and a refusal at most one pass over its namespace's runs."""
        namespace_runs = self._members(state, namespace_of)
        adding: dict[str, set[str]] = {}
        for run_id in new_runs:
            adding.setdefault(namespace_of(run_id), set()).add(run_id)
        for ns, fresh in adding.items():
            members = namespace_runs.setdefault(ns, set())
            if len(members) + len(fresh - members) > state.max_runs:
                members -= {r for r in members if r not in state.runs}
                if len(members) + len(fresh - members) > state.max_runs:
                    return ns
        for ns, fresh in adding.items():
            namespace_runs[ns] |= fresh
        return None


def _refuse_foreign_posters(state: CollectorState, batch: ReportBatch) -> None:
    """Only the rank that posts a run's job reports may post ``scope="job"``: the one the run's first job
    report named, or rank 0 (which takes over). Any other rank's job report refuses the whole batch (403,
    nothing applied): it would rewrite the run's counters and first and latest offenders."""
    posters: dict[str, int] = {}
    for r in batch.reports:
        if r.scope != "job":
            continue
        run = state.runs.get(r.run_id)
        poster = posters.get(r.run_id, run.job_poster if run is not None else None)
        if poster is not None and r.rank not in (poster, 0):
            raise Refused(f"run {r.run_id!r} has its job reports posted by rank {poster}: rank {r.rank} may "
                          "not post scope=job (send it as a detail report); nothing was applied",
                          status=403, reason="job_scope")
        if poster is None or r.rank == 0:
            posters[r.run_id] = r.rank


def _refuse_blind_finals(state: CollectorState, batch: ReportBatch) -> None:
    """A final report ends only what its sender proves it owns: it must carry the incarnation the run holds
    for its rank (live, crashed or hung; a rank it holds nothing of, or that ended, has none to prove). Any
    other refuses the whole batch (409, nothing applied): a blind final from a made-up incarnation cleared a
    rank's crash and ended the run, muting NanwatchRunCrashed (#37 finding 6). A resent final is acknowledged
    as before; the batch's own earlier reports (a restart, then its end) count."""
    current: dict[tuple[str, int], str | None] = {}
    for r in batch.reports:
        key = (r.run_id, r.rank)
        if r.final and r.seq > state.hwm.get((r.run_id, r.rank, r.incarnation), -1):
            if key not in current:
                run = state.runs.get(r.run_id)
                current[key] = _incarnation_of(run, r.rank) if run is not None else None
            if current[key] is not None and current[key] != r.incarnation:
                raise Refused(f"run {r.run_id!r} rank {r.rank} is held under another incarnation than "
                              f"{r.incarnation!r}: a final report ends only its own incarnation; nothing was "
                              "applied", status=409, reason="final_incarnation")
        current[key] = r.incarnation


def _incarnation_of(run: RunState, rank: int) -> str | None:
    """The rank's current incarnation as the run knows it (held live or crashed, crashed after its view went,
    hung), None for a rank it holds nothing of or that ended: only a final report carrying it may end the
    rank (#37 finding 6: a blind final cleared a crash and muted NanwatchRunCrashed)."""
    held = run.ranks.get(rank)
    if held is not None:
        return held.incarnation
    crash = run.crashed.get(rank)
    if crash is not None:
        return crash.incarnation
    silent = run.silent.get(rank)
    return silent.incarnation or None if silent is not None else None
