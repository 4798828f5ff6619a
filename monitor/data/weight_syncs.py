"""Weight syncs, compared: each run's weight versions, the trainer's set of each, each rollout worker's
verdicts, and how far each worker lags (docs/weight_sync.md). Held in memory and kept in the store, row by row
(``nanwatch.monitor.data.weight_rows``), in the write's transaction: a restarted collector, or another replica
on a shared PostgreSQL database, reads them back (``replace``); the ledger counts and logs what a comparison
finds (``nanwatch.monitor.write.weight_compare``).

* **Bound to the run's ranks.** A trainer set carries the incarnation of the rank that posts the run's
  reports (``Monitor.publish_weights`` sends it). It is compared only once that incarnation is the run's
  (rank 0's or the job poster's latest view, or the incarnation the run's latest set was bound to, while
  its rank view has expired in a long phase without reports): until then it waits as a *candidate* (a
  trainer that publishes before its first report reached the collector), at most ``MAX_CANDIDATES`` a version. A set without an
  incarnation is refused (403): a rollout worker cannot post ``side=trainer``, and a made-up incarnation
  never binds, so the real trainer's set is still taken.
* **Whichever side arrives second compares** (a bound trainer set and a rollout set). Dtype-aware: the verdict
  is ``nanwatch.monitor.data.weight_verdicts``'.
* **Kept until compared.** A version stays while a worker the run knows has neither compared with it nor
  moved past it, up to ``max_versions`` a run (versions every worker compared go first) and ``expire_s``;
  one dropped before a worker compared with it is named by ``expired`` (an event), so a worker lagging
  many publishes is still compared when its set comes, and a worker that stopped is said to have.
* **Bounded per namespace** (#37 finding 3: 67 rollout-only sets of ~1 MB filled a collector, and another team's
  new runs were refused for memory): the sets a namespace's runs hold (trainer sets, candidates, waiting
  rollout sets; ``held_bytes`` estimates their memory) and the versions they hold are checked before a write
  (``check_namespace``: 429, counted), so one team at its bound never fills the memory every team shares.
* **Lag**, per worker: the published (bound) versions after its latest verified one (after its first post,
  before any). Two or more, or one unposted past ``wait_s``, is a lag (``lag``): the exporter's gauge and
  the ``weight_sync_lag`` event.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from nanwatch.monitor.data.refusal import CapReached, Refused
from nanwatch.monitor.data.weight_verdicts import SideSet, Verdict, compare

__all__ = ["MAX_CANDIDATES", "Expired", "RunSyncs", "VersionSyncs", "WeightSyncs", "WorkerSync", "held_bytes"]

#: unbound trainer sets a version holds (a restarted trainer's and a stray sender's, say); beyond it 429
MAX_CANDIDATES = 4
#: published versions remembered per run for the lag (version numbers and times only)
_PUBLISHED = 1024


#: what one kept entry (a tensor's fingerprint, dtype or shape) costs beyond its characters: the key and value
#: objects and the dict slot. An upper bound: 20,000 fingerprints of 38-character names held 189 B an entry
#: (tracemalloc, CPython 3.11), estimated 220
_ENTRY_BYTES = 150


def held_bytes(s: SideSet) -> int:
    """About how much memory a kept set holds (its entries' characters plus ``_ENTRY_BYTES`` each)."""
    maps = (s.fingerprints, s.dtypes, s.shapes, *s.casts.values())
    return sum(len(k) + len(str(v)) + _ENTRY_BYTES for m in maps for k, v in m.items())


@dataclass(slots=True)
class WorkerSync:
    """What the run knows of one rollout worker (for the lag and ``nanwatch status``)."""

    first_posted: int
    latest_posted: int
    latest_verified: int | None = None
    outcome: str = "waiting"
    """Its latest compared set's outcome (``verified``, ``mismatch``, ``unverifiable``), or ``waiting``."""
    lagging: bool = False
    """A ``weight_sync_lag`` event was logged and the worker has not caught up since."""
    expired_told: bool = False
    """A version it never compared with was dropped and said so, since its latest post."""


@dataclass(slots=True)
class VersionSyncs:
    """One weight version of a run: the trainer's set (bound), its candidates, the waiting rollout sets and
    each worker's verdict."""

    trainer: SideSet | None = None
    #: unbound trainer sets, by incarnation
    candidates: dict[str, SideSet] = field(default_factory=dict)
    #: rollout sets waiting for the trainer's, by worker
    waiting: dict[str, SideSet] = field(default_factory=dict)
    #: by worker: the digest of its last compared set and the verdict
    verdicts: dict[str, tuple[bytes, Verdict]] = field(default_factory=dict)
    received: float = 0.0
    published: float | None = None


@dataclass(slots=True)
class RunSyncs:
    """One run's weight syncs: what the store keeps of them, row by row (``nanwatch.monitor.data.weight_rows``)."""

    versions: OrderedDict[int, VersionSyncs] = field(default_factory=OrderedDict)
    workers: dict[str, WorkerSync] = field(default_factory=dict)
    #: bound (published) versions and when they were bound, the newest last
    published: OrderedDict[int, float] = field(default_factory=OrderedDict)
    #: the incarnation the latest set was bound to: still the run's trainer while its rank view has expired
    #: (a long rollout phase without reports), until another incarnation's set binds
    trainer: str | None = None


@dataclass(frozen=True, slots=True)
class Expired:
    """A version dropped before the named workers compared with it (the trainer's set was there, or not)."""

    version: int
    workers: tuple[str, ...]
    published: bool


class WeightSyncs:
    """Each run's versions (event-loop thread only; the ledger calls it inside its transaction)."""

    def __init__(self, *, max_versions: int = 32, max_waiting: int = 256, wait_s: float = 120.0,
                 expire_s: float = 6 * 3600.0, max_bytes_per_namespace: int = 256 << 20,
                 max_versions_per_namespace: int = 1024) -> None:
        self.max_versions, self.max_waiting, self.wait_s, self.expire_s = max_versions, max_waiting, wait_s, expire_s
        self.max_bytes_per_namespace, self.max_versions_per_namespace = max_bytes_per_namespace, max_versions_per_namespace
        self.runs: dict[str, RunSyncs] = {}
        #: (versions, bytes) each run holds, counted when asked and forgotten when the run changes
        self._held: dict[str, tuple[int, int]] = {}

    # ---- checks before a write ------------------------------------------------------------------------

    def check(self, run_id: str, version: int, side: str, worker: str, incarnation: str | None, s: SideSet) -> None:
        """Refuse, before anything changes: a trainer set without an incarnation (403), a second trainer set
        of a bound version that differs from it (409), more candidates than ``MAX_CANDIDATES`` (429) and a
        rollout set beyond ``max_waiting`` waiting for the trainer's (429)."""
        if side == "trainer" and incarnation is None:
            raise Refused("side=trainer needs the incarnation of the rank that posts the run's reports (Monitor."
                          "publish_weights sends it): a rollout worker posts side=rollout", status=403,
                          reason="unbound_trainer")
        v = self.runs[run_id].versions.get(version) if run_id in self.runs else None
        if v is None:
            return
        if side == "trainer" and v.trainer is not None and s.digest != v.trainer.digest:
            raise Refused(f"weight version {version} of run {run_id!r} already has the trainer's weight "
                          "fingerprints, and these differ: a version is published once (use a new version)",
                          status=409, reason="conflict")
        if (side == "trainer" and v.trainer is None and incarnation not in v.candidates
                and len(v.candidates) >= MAX_CANDIDATES):
            raise CapReached(f"weight version {version} of run {run_id!r} already has {MAX_CANDIDATES} trainer "
                             "sets from incarnations the run does not report from", reason="weight_sync")
        if (side == "rollout" and v.trainer is None and worker not in v.waiting
                and len(v.waiting) >= self.max_waiting):
            raise CapReached(f"weight version {version} of run {run_id!r} already has {self.max_waiting} "
                             "rollout workers' sets waiting for the trainer's", reason="weight_sync")

    def check_namespace(self, run_id: str, version: int, s: SideSet,
                        namespace_of: Callable[[str], str]) -> str | None:
        """The namespace bound (``"weight_bytes_per_namespace"`` or ``"weight_versions_per_namespace"``) that
        keeping ``s`` for ``version`` of ``run_id`` would pass, else None. Costs one pass over the runs holding
        weight versions (each run's own count is kept until it changes)."""
        ns = namespace_of(run_id)
        versions = held = 0
        for other in self.runs:
            if namespace_of(other) == ns:
                n, b = self._held_by(other)
                versions, held = versions + n, held + b
        run = self.runs.get(run_id)
        if (run is None or version not in run.versions) and versions + 1 > self.max_versions_per_namespace:
            return "weight_versions_per_namespace"
        if held + held_bytes(s) > self.max_bytes_per_namespace:
            return "weight_bytes_per_namespace"
        return None

    def _held_by(self, run_id: str) -> tuple[int, int]:
        held = self._held.get(run_id)
        if held is None:
            versions = self.runs[run_id].versions.values()
            held = self._held[run_id] = (len(versions), sum(
                held_bytes(x) for v in versions
                for x in (*([v.trainer] if v.trainer is not None else ()), *v.candidates.values(), *v.waiting.values())))
        return held

    # ---- the writes -------------------------------------------------------------------------------------

    def trainer(self, run_id: str, version: int, incarnation: str, s: SideSet, now: float) -> None:
        """A trainer set of ``version``: a candidate until ``bind`` finds its incarnation the run's."""
        v = self._slot(run_id, version, now)
        if v.trainer is None:
            v.candidates[incarnation] = s
            self._held.pop(run_id, None)

    def bind(self, run_id: str, incarnations: set[str], now: float) -> list[tuple[int, Verdict]]:
        """Bind each version's candidate of one of the run's ``incarnations`` (rank 0's, the job poster's) and
        compare the workers waiting for it: the new (version, verdict)s."""
        run, found = self.runs.get(run_id), []
        self._held.pop(run_id, None)
        for version, v in (run.versions.items() if run is not None else ()):
            if v.trainer is not None or not v.candidates:
                continue
            inc = next((i for i in v.candidates if i in incarnations), None)  # the reporting one first
            if inc is None and run.trainer in v.candidates:
                inc = run.trainer
            if inc is None:
                continue
            v.trainer, v.candidates, v.published, run.trainer = v.candidates[inc], {}, now, inc
            run.published[version] = now
            run.published.move_to_end(version)
            while len(run.published) > _PUBLISHED:
                run.published.popitem(last=False)
            for worker, rollout in v.waiting.items():
                found.append((version, self._verdict(run, version, v, worker, rollout)))
            v.waiting.clear()
        return found

    def rollout(self, run_id: str, version: int, worker: str, s: SideSet, now: float) -> tuple[Verdict | None, bool]:
        """A worker's set of ``version``: (its verdict or None while no trainer set is bound, whether the
        verdict is new, i.e. to be counted: a resend of the same set is not)."""
        v = self._slot(run_id, version, now)
        run = self.runs[run_id]
        w = run.workers.get(worker)
        if w is None:
            if len(run.workers) >= self.max_waiting:  # the longest silent worker goes
                run.workers.pop(min(run.workers, key=lambda k: run.workers[k].latest_posted))
            w = run.workers[worker] = WorkerSync(version, version)
        w.latest_posted, w.expired_told = max(w.latest_posted, version), False
        if v.trainer is None:
            v.waiting[worker] = s  # ``check`` bounded them
            self._held.pop(run_id, None)
            return None, False
        old = v.verdicts.get(worker)
        if old is not None and old[0] == s.digest:
            return old[1], False
        if old is None and len(v.verdicts) >= self.max_waiting:
            v.verdicts.pop(next(iter(v.verdicts)))  # only a resend's answer is lost
        return self._verdict(run, version, v, worker, s), True

    def _verdict(self, run: RunSyncs, version: int, v: VersionSyncs, worker: str, s: SideSet) -> Verdict:
        verdict = compare(worker, v.trainer, s)
        v.verdicts[worker] = (s.digest, verdict)
        w = run.workers.get(worker)
        if w is not None:
            w.outcome = verdict.outcome
            if verdict.verified and (w.latest_verified is None or version > w.latest_verified):
                w.latest_verified = version
        return verdict

    def _slot(self, run_id: str, version: int, now: float) -> VersionSyncs:
        versions = self.runs.setdefault(run_id, RunSyncs()).versions
        v = versions.get(version)
        if v is None:
            v = versions[version] = VersionSyncs(received=now)
            self._held.pop(run_id, None)
        return v

    # ---- what a write or the sweeper reads next ---------------------------------------------------------

    def expire(self, run_id: str, now: float) -> list[Expired]:
        """Drop versions past ``expire_s`` and, beyond ``max_versions``, those every worker is done with
        first, then the oldest: the dropped ones some worker never compared with (said once per worker
        until it posts again)."""
        run = self.runs.get(run_id)
        if run is None:
            return []
        self._held.pop(run_id, None)
        out = []
        for version in [k for k, v in run.versions.items() if now - v.received > self.expire_s]:
            out += self._drop(run, version)
        while len(run.versions) > self.max_versions:
            done = next((k for k, v in run.versions.items() if not self._pending_workers(run, k, v)), None)
            out += self._drop(run, done if done is not None else next(iter(run.versions)))
        return out

    def due(self, run_id: str, now: float) -> bool:
        """Whether ``expire`` would drop a version now."""
        run = self.runs.get(run_id)
        return run is not None and (len(run.versions) > self.max_versions or any(
            now - v.received > self.expire_s for v in run.versions.values()))

    def _pending_workers(self, run: RunSyncs, version: int, v: VersionSyncs) -> list[str]:
        """Workers the run knows that neither compared with ``version`` nor moved past it."""
        return sorted(k for k, w in run.workers.items()
                      if k not in v.verdicts and w.latest_posted <= version and w.first_posted <= version)

    def _drop(self, run: RunSyncs, version: int) -> list[Expired]:
        v = run.versions.pop(version)
        workers = [k for k in self._pending_workers(run, version, v) if not run.workers[k].expired_told]
        workers += [k for k in v.waiting if k not in workers]
        for k in workers:
            if k in run.workers:
                run.workers[k].expired_told = True
        return [Expired(version, tuple(sorted(workers)), v.trainer is not None)] if workers else []

    def lag(self, run_id: str, now: float) -> dict[str, int]:
        """Each known worker's lag in versions (module docstring): 0 when it is not lagging."""
        run = self.runs.get(run_id)
        if run is None:
            return {}
        out = {}
        for name, w in run.workers.items():
            floor = w.latest_verified if w.latest_verified is not None else w.first_posted - 1
            behind = [t for version, t in run.published.items() if version > floor]
            late = len(behind) == 1 and now - behind[0] >= self.wait_s
            out[name] = len(behind) if len(behind) >= 2 or late else 0
        return out

    def summary(self, run_id: str) -> dict[str, object] | None:
        """What ``GET /v1/runs/{run_id}`` shows: the latest published version and each worker's state."""
        run = self.runs.get(run_id)
        if run is None:
            return None
        return {"latest_published": max(run.published, default=None),
                "workers": {k: {"latest_posted": w.latest_posted, "latest_verified": w.latest_verified,
                                "outcome": w.outcome} for k, w in sorted(run.workers.items())}}

    def workers(self, run_id: str) -> dict[str, WorkerSync]:
        run = self.runs.get(run_id)
        return run.workers if run is not None else {}

    # ---- what a write changed, what the store holds, and forgetting ---------------------------------------------------------

    def save(self, run_id: str) -> RunSyncs | None:
        """A copy of the run's state at a write's start: what it changed is written from it
        (``weight_rows.changes``); a failed write takes the store's again (``replace``)."""
        run = self.runs.get(run_id)
        if run is None:
            return None
        return RunSyncs(OrderedDict((k, VersionSyncs(v.trainer, dict(v.candidates), dict(v.waiting), dict(v.verdicts),
                                             v.received, v.published)) for k, v in run.versions.items()),
                    {k: WorkerSync(w.first_posted, w.latest_posted, w.latest_verified, w.outcome, w.lagging,
                                   w.expired_told) for k, w in run.workers.items()},
                    OrderedDict(run.published), run.trainer)

    def forget(self, run_ids: list[str]) -> None:
        for run_id in run_ids:
            self.runs.pop(run_id, None)
            self._held.pop(run_id, None)

    def replace(self, runs: dict[str, RunSyncs], run_ids: set[str] | None = None) -> None:
        """Take the store's view (``weight_rows.decode``) of ``run_ids`` (None: of every run, at start-up): a
        run the store holds no set of is dropped."""
        for run_id in (set(self.runs) if run_ids is None else run_ids) - set(runs):
            self.forget([run_id])
        for run_id, run in runs.items():
            if run_ids is None or run_id in run_ids:
                self.runs[run_id] = run
                self._held.pop(run_id, None)
