"""Trainer -> collector transport: a report sender and a directive poller, each on a daemon thread.

Stdlib only (``http.client``, ``threading``, ``queue``) plus the wire schema: the trainer must not need
the web stack, and nothing here imports torch (``import nanwatch.hooks.report.transport`` works without it, so
the collector's tests and ``nanwatch status`` can use it). The one rule: monitoring never blocks or crashes training. ``submit`` never
waits (a full queue drops and counts the report), nothing raises into the caller, and problems are
logged as rate-limited warnings on the ``nanwatch.transport`` logger.

Example usage::

    sender = ReportSender("http://collector:8000", token=token_from_env("NANWATCH_TOKEN"))
    sender.submit(report)          # from the training loop; returns at once
    poller = DirectivePoller("http://collector:8000", "run-1", on_directive=print)
    ...
    sender.close(timeout_s=5.0)    # deliver what is queued within 5 s; keep the rest (spool=); log the account
    poller.close()
"""

from __future__ import annotations

import email.utils
import http.client
import logging
import os
import queue
import random
import shlex
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import NamedTuple, Protocol

from nanwatch.addresses import check_collector_url
from nanwatch.tokens import token_from_env
from nanwatch.wire import Directive, ReportBatch, StepReport

__all__ = ["POLL_FLOOR_S", "KeepAliveHttp", "Delivery", "DirectivePoller", "ReportSender", "Undelivered"]

log = logging.getLogger("nanwatch.transport")

#: The most of one answer read (an ack or a directive is a few KiB): a hostile or broken endpoint cannot
#: grow the trainer's or ``nanwatch push``'s memory past it; a longer one is a failed request.
MAX_ANSWER_BYTES = 8 << 20

#: Statuses worth retrying: the collector is starting, overloaded or briefly broken.
_RETRY = frozenset({408, 425, 429, 500, 502, 503, 504})


class _Warn:
    """At most one warning per ``every_s`` per key; the number suppressed is told with the next one."""

    def __init__(self, every_s: float = 30.0) -> None:
        self._every, self._last, self._hidden = every_s, {}, {}

    def __call__(self, key: str, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last.get(key, -1e18) < self._every:
            self._hidden[key] = self._hidden.get(key, 0) + 1
            return
        hidden, self._last[key], self._hidden[key] = self._hidden.get(key, 0), now, 0
        log.warning("nanwatch: " + msg + (f" ({hidden} similar suppressed)" if hidden else ""), *args)


class KeepAliveHttp:
    """One keep-alive connection to the collector, reopened after any error (the sender's, the poller's and
    ``nanwatch push``'s). The token: ``token``, else ``NANWATCH_TOKEN`` (or its ``_FILE``)."""

    def __init__(self, url: str, token: str | None, timeout_s: float) -> None:
        u = check_collector_url(url)
        self._cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
        self._host, self._port, self.prefix = u.hostname, u.port, u.path.rstrip("/")
        self.timeout_s = timeout_s
        self._headers = {"Content-Type": "application/json", "Accept": "application/json"}
        token = token if token is not None else token_from_env("NANWATCH_TOKEN")
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self._conn: http.client.HTTPConnection | None = None
        self.aborted = False
        #: time.monotonic() past which no request waits (close's deadline): each request's timeout shrinks to it
        self.deadline = float("inf")

    def request(self, method: str, path: str, body: bytes | None = None, *,
                timeout_s: float | None = None) -> tuple[int, bytes, str | None]:
        """(status, body, Retry-After). A stale keep-alive connection gets one fresh retry: the
        collector recognises resends as duplicates, so resending is safe."""
        for attempt in (0, 1):
            if self.aborted:
                raise ConnectionAbortedError("closed")
            wait = min(timeout_s or self.timeout_s, max(self.deadline - time.monotonic(), 0.01))
            fresh = self._conn is None
            if fresh:
                self._conn = self._cls(self._host, self._port, timeout=wait)
            conn = self._conn
            conn.timeout = wait
            if conn.sock is not None:
                conn.sock.settimeout(conn.timeout)
            try:
                conn.request(method, self.prefix + path, body=body, headers=self._headers)
                resp = conn.getresponse()
                data = resp.read(MAX_ANSWER_BYTES + 1)
                if len(data) > MAX_ANSWER_BYTES:  # an answer is an ack or a directive: a few KiB
                    raise OSError(f"the collector's answer is over {MAX_ANSWER_BYTES} bytes: not read further")
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                self.close()
                if fresh or attempt:
                    raise
                continue
            except BaseException:
                self.close()
                raise
            if resp.will_close:
                self.close()
            return resp.status, data, resp.getheader("Retry-After")
        raise AssertionError("unreachable")

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()
            except Exception:  # noqa: S110 - closing a broken socket
                pass

    def abort(self) -> None:
        """Wake a thread blocked reading from this connection (from another thread), for good."""
        self.aborted = True
        conn = self._conn
        sock = conn.sock if conn is not None else None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _retry_after(value: str | None) -> float | None:
    """Seconds from a Retry-After header (delta-seconds or HTTP-date), capped at 5 minutes."""
    if not value:
        return None
    try:
        secs = float(value)
    except ValueError:
        try:
            secs = email.utils.parsedate_to_datetime(value).timestamp() - time.time()
        except (TypeError, ValueError, IndexError, OverflowError):
            return None
    return min(max(secs, 0.0), 300.0)


class _Backoff:
    """Exponential backoff with full jitter; a Retry-After is a floor, not a suggestion."""

    def __init__(self, base_s: float, max_s: float) -> None:
        self.base_s, self.max_s, self.attempt = base_s, max_s, 0

    def next(self, retry_after: float | None) -> float:
        delay = random.uniform(0, min(self.max_s, self.base_s * 2 ** min(self.attempt, 30)))
        self.attempt += 1
        return max(delay, retry_after) if retry_after is not None else delay

    def reset(self) -> None:
        self.attempt = 0


class _Steps:
    """Which steps a count covers, as compact ranges (``"3-7, 12"``); at most 20 ranges, then a count."""

    def __init__(self) -> None:
        self._ranges: list[list[int]] = []
        self._more = 0

    def add(self, reports: list[StepReport]) -> None:
        for r in reports:
            last = self._ranges[-1] if self._ranges else None
            if last is not None and last[0] <= r.step <= last[1] + 1:
                last[1] = max(last[1], r.step)
            elif len(self._ranges) < 20:
                self._ranges.append([r.step, r.step])
            else:
                self._more += 1

    def __str__(self) -> str:
        text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in self._ranges)
        return text + (f" and {self._more} more" if self._more else "")


class Delivery(NamedTuple):
    """A sender's account at close: every report submitted was delivered, kept on disk or lost."""

    collector: str
    submitted: int
    delivered: int
    kept: int
    """Not delivered, kept in ``kept_in`` for ``nanwatch push``."""
    lost: int
    """Not delivered and not kept: the queue was full, the disk refused, or there was no spool."""
    kept_in: str | None = None
    kept_steps: str = ""
    lost_steps: str = ""
    lost_why: str = ""

    @property
    def undelivered(self) -> int:
        return self.kept + self.lost

    def __str__(self) -> str:
        text = (f"reports to {self.collector}: {self.delivered} of {self.submitted} delivered, "
                f"{self.undelivered} not")
        if self.kept:
            folder = os.path.dirname(self.kept_in or "")
            text += (f"; {self.kept} kept (steps {self.kept_steps}) in {self.kept_in}: send them with "
                     f"`nanwatch push --collector {shlex.quote(self.collector)} {shlex.quote(folder)}`")
        if self.lost:
            text += f"; {self.lost} lost (steps {self.lost_steps}): {self.lost_why}"
        return text


class Undelivered(Protocol):
    """Where the sender keeps what it could not deliver, as it uses it: ``nanwatch.hooks.report.spool.Spool``,
    built by whoever connects the sender (``nanwatch.hooks.report.handover.connect``) and handed in."""

    path: Path
    kept: int
    error: str | None

    def keep(self, reports: Iterable[StepReport]) -> int: ...

    def close(self) -> None: ...


class ReportSender:
    """Ships ``StepReport``s to ``POST {url}/v1/reports`` from a background thread.

    Reports wait in a bounded queue (``max_queue``); a full queue drops the new report and counts it.
    Up to ``batch_max`` queued reports go in one request, oldest first (the collector takes a report whose
    seq is below one it already applied as a resend). Connection errors, 408/429/5xx are retried with
    exponential backoff and jitter, at least ``Retry-After`` apart, for as long as the sender is open (the
    queue bound is what limits memory, not a retry count); other 4xx give the batch up (413 splits it
    first). The token comes from ``token``, else ``NANWATCH_TOKEN`` (or its ``_FILE``).

    With a ``spool`` (``nanwatch.hooks.report.spool.Spool``) what is not delivered is kept on disk for
    ``nanwatch push``: a batch the collector refused, and at close whatever is still queued or in flight.
    ``close(timeout_s)`` waits at most that long (a request in flight is cut off at the deadline), then
    logs its :class:`Delivery` account (``account``): delivered, kept (where, which steps), lost (which steps).

    Drops reach the collector in ``dropped_reports``: the caller sets its own cumulative count (including
    ``sender.dropped``) and the sender adds the drops counted between ``submit`` and the send.
    """

    def __init__(self, url: str, *, token: str | None = None, max_queue: int = 1024, batch_max: int = 64,
                 timeout_s: float = 5.0, backoff_base_s: float = 0.1, backoff_max_s: float = 10.0,
                 spool: Undelivered | None = None) -> None:
        if max_queue < 1 or not 1 <= batch_max <= 256:
            raise ValueError(f"need max_queue >= 1 and 1 <= batch_max <= 256, got {max_queue}, {batch_max}")
        self._url = url.rstrip("/")
        self._http = KeepAliveHttp(url, token, timeout_s)
        self._queue: queue.Queue[tuple[StepReport, int]] = queue.Queue(max_queue)
        self._batch_max = batch_max
        self._backoff = _Backoff(backoff_base_s, backoff_max_s)
        self._warn = _Warn()
        self._lock = threading.Lock()
        self._spool = spool
        self._submitted = self._dropped = self._delivered = 0
        self._lost_steps, self._kept_steps, self._lost_why = _Steps(), _Steps(), set()
        self._inflight: list[tuple[StepReport, int]] | None = None  # taken from the queue, not yet settled
        self._left: list[StepReport] = []  # set aside at close, to be kept
        self._closing = threading.Event()
        self._deadline = float("inf")
        self.account: Delivery | None = None
        """The account ``close`` gave (None before)."""
        self._thread = threading.Thread(target=self._run, name="nanwatch-sender", daemon=True)
        self._thread.start()

    @property
    def dropped(self) -> int:
        """Reports that will never arrive: queue-full drops, and reports not delivered that could not be kept."""
        return self._dropped

    @property
    def delivered(self) -> int:
        """Reports the collector acknowledged (applied or recognised as resends)."""
        return self._delivered

    def submit(self, report: StepReport) -> bool:
        """Queue ``report`` without waiting. False (and counted) if the queue is full or the sender closed."""
        self._submitted += 1
        try:
            if self._closing.is_set():
                raise queue.Full
            self._queue.put_nowait((report, self._dropped))
            return True
        except queue.Full:
            self._lose([report], "the send queue was full (collector unreachable or slow)")
            self._warn("full", "report queue full (collector unreachable or slow); dropped %d so far",
                       self._dropped)
            return False
        except Exception as e:  # never into the training loop
            self._lose([report], f"could not queue: {e!r}")
            self._warn("submit", "could not queue a report: %r", e)
            return False

    def close(self, timeout_s: float = 5.0) -> bool:
        """Deliver what is queued within ``timeout_s`` (a request the collector has not answered by then is cut
        off), keep the rest on disk (with a spool), log the account (``account``) and stop. True if nothing
        was left undelivered."""
        timeout_s = max(timeout_s, 0.0)
        self._deadline = self._http.deadline = time.monotonic() + timeout_s
        before = (self._dropped, self._spool.kept if self._spool is not None else 0)
        self._closing.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            self._http.abort()  # a collector that accepted the connection and never answers
            self._thread.join(1.0)
        with self._lock:
            left, self._left = self._left, []
            if self._thread.is_alive() and self._inflight:  # still stuck: keep a copy (a resend is harmless)
                left += self._stamped(self._inflight)
        left += self._stamped(self._drain())
        self._set_aside(left, "not delivered before the close timeout")
        self._http.close()
        if self._spool is not None:
            self._spool.close()
        self.account = self._account()
        self._say(self.account)
        return not left and before == (self._dropped, self._spool.kept if self._spool is not None else 0)

    def _account(self) -> Delivery:
        spool = self._spool
        kept = spool.kept if spool is not None else 0
        return Delivery(self._url, self._submitted, self._delivered, kept, self._dropped,
                        str(spool.path) if spool is not None and kept else None, str(self._kept_steps),
                        str(self._lost_steps), "; ".join(sorted(self._lost_why)))

    @staticmethod
    def _say(account: Delivery) -> None:
        if account.undelivered:
            log.warning("nanwatch: %s", account)
        else:
            log.info("nanwatch: %s", account)

    def _drain(self) -> list[tuple[StepReport, int]]:
        out = []
        while True:
            try:
                out.append(self._queue.get_nowait())
            except queue.Empty:
                return out

    def _stamped(self, batch: list[tuple[StepReport, int]]) -> list[StepReport]:
        """The reports, each carrying the drops counted since it was queued (``dropped_reports``)."""
        out = []
        for r, dropped_at_submit in batch:
            extra = self._dropped - dropped_at_submit
            out.append(r.model_copy(update={"dropped_reports": r.dropped_reports + extra}) if extra else r)
        return out

    def _lose(self, reports: list[StepReport], why: str) -> None:
        with self._lock:
            self._dropped += len(reports)
            self._lost_steps.add(reports)
            self._lost_why.add(why)

    def _set_aside(self, reports: list[StepReport], why: str) -> None:
        """Keep ``reports`` on disk (with a spool), else count them lost."""
        if not reports:
            return
        kept = self._spool.keep(reports) if self._spool is not None else 0
        with self._lock:
            self._kept_steps.add(reports[:kept])
        if kept < len(reports):
            reason = "no place to keep them" if self._spool is None else self._spool.error or "not kept"
            self._lose(reports[kept:], f"{why}, and {reason}")

    # ---- sender thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            try:
                first = self._queue.get(timeout=0.05)
            except queue.Empty:
                if self._closing.is_set():
                    return
                continue
            batch = [first]
            while len(batch) < self._batch_max:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            with self._lock:
                self._inflight = batch
            try:
                self._deliver(batch)
            except Exception as e:  # a bug here must not kill the thread silently, nor the trainer
                self._warn("bug", "sender error, batch of %d set aside: %r", len(batch), e)
                self._later(self._stamped(batch))
            with self._lock:
                self._inflight = None
            if self._closing.is_set() and time.monotonic() >= self._deadline:
                return  # close() keeps what is still queued

    def _later(self, reports: list[StepReport]) -> None:
        """Set aside for close() to keep (in order: nothing after them is sent)."""
        with self._lock:
            self._left.extend(reports)

    def _deliver(self, batch: list[tuple[StepReport, int]]) -> None:
        reports = self._stamped(batch)
        body = ReportBatch(reports=reports).model_dump_json().encode()
        while True:
            if self._closing.is_set() and time.monotonic() >= self._deadline:
                self._later(reports)
                return
            try:
                status, data, retry_after = self._http.request("POST", "/v1/reports", body)
            except (OSError, http.client.HTTPException) as e:
                status, data, retry_after = None, repr(e).encode(), None
            if status is not None and 200 <= status < 300:
                self._backoff.reset()
                self._delivered += len(batch)
                return
            if status == 413 and len(batch) > 1:
                half = len(batch) // 2
                self._deliver(batch[:half])
                self._deliver(batch[half:])
                return
            if status is not None and status not in _RETRY:
                self._warn(f"http{status}", "collector refused %d reports with HTTP %d: %s%s", len(batch), status,
                           data[:300].decode("utf-8", "replace"),
                           f" (kept in {self._spool.path})" if self._spool is not None else "")
                self._set_aside(reports, f"refused with HTTP {status}")
                return
            delay = self._backoff.next(_retry_after(retry_after))
            if self._closing.is_set():  # closing: try again while the deadline leaves time for it
                remaining = self._deadline - time.monotonic()
                if remaining < 0.2:
                    self._later(reports)
                    return
                delay = min(delay, remaining / 2)
            self._warn("retry", "collector unavailable (%s); retrying, %d reports queued",
                       status or data[:200].decode("utf-8", "replace"), self._queue.qsize() + len(batch))
            self._closing.wait(delay) if not self._closing.is_set() else time.sleep(delay)


#: The least pause after a directive poll answered at once with nothing new, with jitter up to half again;
#: it doubles while answers keep coming back at once, up to the poll's own wait: a collector (or a proxy)
#: that does not hold the long-poll costs a poll a second at first and one a wait later, never twenty a
#: second (#37 finding 9). A poll that was held, or that brought a new version, is followed at once.
POLL_FLOOR_S = 1.0


class DirectivePoller:
    """Long-polls ``GET {url}/v1/directives/{run_id}`` and keeps the newest directive in ``latest``.

    ``on_directive(d)`` runs on the poller thread for every new version; its exceptions are logged,
    never raised. Errors back off with jitter (honouring Retry-After), and so do answers that come back at
    once with nothing new (``POLL_FLOOR_S``). If the collector answers with a lower version than we hold
    (its database was replaced), the poller resynchronises to it.
    """

    def __init__(self, url: str, run_id: str, *, token: str | None = None, wait_s: float = 30.0,
                 on_directive: Callable[[Directive], object] | None = None, backoff_base_s: float = 0.2,
                 backoff_max_s: float = 30.0) -> None:
        self._http = KeepAliveHttp(url, token, wait_s + 10.0)
        self._path = f"/v1/directives/{urllib.parse.quote(run_id, safe='')}"
        self._wait_s = wait_s
        self._on_directive = on_directive
        self._backoff = _Backoff(backoff_base_s, backoff_max_s)
        #: answers in a row that came back at once with nothing new (``POLL_FLOOR_S``)
        self._quick = 0
        self._warn = _Warn()
        self._stop = threading.Event()
        self.latest: Directive | None = None
        self._index = 0
        self._thread = threading.Thread(target=self._run, name="nanwatch-directives", daemon=True)
        self._thread.start()

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop polling; an in-flight long-poll is cut off rather than waited for."""
        self._stop.set()
        self._http.abort()
        self._thread.join(timeout_s)
        self._http.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            retry_after = None
            try:
                started = time.monotonic()
                status, data, retry_after = self._http.request(
                    "GET", f"{self._path}?index={self._index}&wait={self._wait_s:g}")
                if status == 200:
                    self._backoff.reset()
                    news = self._take(Directive.model_validate_json(data))
                    if news or 0 < self._wait_s / 2 <= time.monotonic() - started:  # news, or held
                        self._quick = 0
                    else:
                        self._warn("quick", "the collector answered a directive poll at once (it should hold "
                                   "it up to %gs): polling again after a pause", self._wait_s)
                        self._quick += 1
                        self._stop.wait(self._quick_pause())
                    continue
                self._warn(f"http{status}", "directive poll got HTTP %d: %s", status,
                           data[:300].decode("utf-8", "replace"))
            except Exception as e:
                if self._stop.is_set():
                    return
                self._warn("error", "directive poll failed: %r", e)
            self._stop.wait(self._backoff.next(_retry_after(retry_after)))

    def _quick_pause(self) -> float:
        """The pause after the ``_quick``-th answer in a row that came back at once with nothing new."""
        ceiling = max(self._wait_s, POLL_FLOOR_S)
        return min(ceiling, POLL_FLOOR_S * 2 ** min(self._quick - 1, 20)) * random.uniform(1.0, 1.5)

    def _take(self, d: Directive) -> bool:
        """Keep ``d`` if it is news; whether it was (a new version)."""
        if d.version < self._index:
            self._warn("resync", "collector's directive version went back from %d to %d; following it",
                       self._index, d.version)
            self._index = d.version
            return False
        if d.version == self._index:
            return False
        self._index = d.version
        self.latest = d
        if self._on_directive is not None:
            try:
                self._on_directive(d)
            except Exception as e:
                self._warn("callback", "on_directive raised %r (ignored)", e)
        return True
