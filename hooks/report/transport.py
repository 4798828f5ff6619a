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
    sender.close(timeout_s=5.0)    # flush what is queued, give up after the timeout
    poller.close()
"""

from __future__ import annotations

import email.utils
import http.client
import logging
import queue
import random
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable

from nanwatch.addresses import check_collector_url
from nanwatch.tokens import token_from_env
from nanwatch.wire import Directive, ReportBatch, StepReport

__all__ = ["DirectivePoller", "ReportSender"]

log = logging.getLogger("nanwatch.transport")

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


class _Http:
    """One keep-alive connection to the collector, reopened after any error."""

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

    def request(self, method: str, path: str, body: bytes | None = None, *,
                timeout_s: float | None = None) -> tuple[int, bytes, str | None]:
        """(status, body, Retry-After). A stale keep-alive connection gets one fresh retry: the
        collector recognises resends as duplicates, so resending is safe."""
        for attempt in (0, 1):
            if self.aborted:
                raise ConnectionAbortedError("closed")
            fresh = self._conn is None
            if fresh:
                self._conn = self._cls(self._host, self._port, timeout=timeout_s or self.timeout_s)
            conn = self._conn
            conn.timeout = timeout_s or self.timeout_s
            if conn.sock is not None:
                conn.sock.settimeout(conn.timeout)
            try:
                conn.request(method, self.prefix + path, body=body, headers=self._headers)
                resp = conn.getresponse()
                data = resp.read()
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


class ReportSender:
    """Ships ``StepReport``s to ``POST {url}/v1/reports`` from a background thread.

    Reports wait in a bounded queue (``max_queue``); a full queue drops the new report and counts it.
    Up to ``batch_max`` queued reports go in one request. Connection errors, 408/429/5xx are retried with
    exponential backoff and jitter, at least ``Retry-After`` apart, for as long as the sender is open (the
    queue bound is what limits memory, not a retry count); other 4xx give the batch up and count it
    (413 splits it first). The token comes from ``token``, else ``NANWATCH_TOKEN`` (or its ``_FILE``).

    Drops reach the collector in ``dropped_reports``: the caller sets its own cumulative count (including
    ``sender.dropped``) and the sender adds the drops counted between ``submit`` and the send.
    """

    def __init__(self, url: str, *, token: str | None = None, max_queue: int = 1024, batch_max: int = 64,
                 timeout_s: float = 5.0, backoff_base_s: float = 0.1, backoff_max_s: float = 10.0) -> None:
        if max_queue < 1 or not 1 <= batch_max <= 256:
            raise ValueError(f"need max_queue >= 1 and 1 <= batch_max <= 256, got {max_queue}, {batch_max}")
        self._http = _Http(url, token, timeout_s)
        self._queue: queue.Queue[tuple[StepReport, int]] = queue.Queue(max_queue)
        self._batch_max = batch_max
        self._backoff = _Backoff(backoff_base_s, backoff_max_s)
        self._warn = _Warn()
        self._lock = threading.Lock()
        self._dropped = 0
        self._delivered = 0
        self._closing = threading.Event()
        self._deadline = float("inf")
        self._thread = threading.Thread(target=self._run, name="nanwatch-sender", daemon=True)
        self._thread.start()

    @property
    def dropped(self) -> int:
        """Reports that will never arrive: queue-full drops plus reports of batches given up."""
        return self._dropped

    @property
    def delivered(self) -> int:
        """Reports the collector acknowledged (applied or recognised as resends)."""
        return self._delivered

    def submit(self, report: StepReport) -> bool:
        """Queue ``report`` without waiting. False (and counted) if the queue is full or the sender closed."""
        try:
            if self._closing.is_set():
                raise queue.Full
            self._queue.put_nowait((report, self._dropped))
            return True
        except queue.Full:
            self._count_drop(1)
            self._warn("full", "report queue full (collector unreachable or slow); dropped %d so far",
                       self._dropped)
            return False
        except Exception as e:  # never into the training loop
            self._count_drop(1)
            self._warn("submit", "could not queue a report: %r", e)
            return False

    def close(self, timeout_s: float = 5.0) -> bool:
        """Deliver what is queued within ``timeout_s``, then stop. True if nothing was left undelivered."""
        dropped_before = self._dropped
        self._deadline = time.monotonic() + max(timeout_s, 0.0)
        self._closing.set()
        self._thread.join(max(timeout_s, 0.0) + 1.0)
        flushed = (not self._thread.is_alive() and self._queue.empty() and not self._holding
                   and self._dropped == dropped_before)
        self._http.close()
        return flushed

    _holding = False  # a batch is taken from the queue but not yet delivered or given up

    def _count_drop(self, n: int) -> None:
        with self._lock:
            self._dropped += n

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
            self._holding = True
            try:
                self._deliver(batch)
            except Exception as e:  # a bug here must not kill the thread silently, nor the trainer
                self._count_drop(len(batch))
                self._warn("bug", "sender error, batch of %d dropped: %r", len(batch), e)
            self._holding = False
            if self._closing.is_set() and time.monotonic() >= self._deadline:
                self._give_up_queue()
                return

    def _deliver(self, batch: list[tuple[StepReport, int]]) -> None:
        reports = []
        for r, dropped_at_submit in batch:
            extra = self._dropped - dropped_at_submit
            reports.append(r.model_copy(update={"dropped_reports": r.dropped_reports + extra}) if extra else r)
        body = ReportBatch(reports=reports).model_dump_json().encode()
        while True:
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
                self._count_drop(len(batch))
                self._warn(f"http{status}", "collector refused %d reports with HTTP %d: %s", len(batch), status,
                           data[:300].decode("utf-8", "replace"))
                return
            delay = self._backoff.next(_retry_after(retry_after))
            if self._closing.is_set() and time.monotonic() + delay >= self._deadline:
                self._count_drop(len(batch))
                self._warn("close", "gave up %d reports at close: %s", len(batch),
                           data[:200].decode("utf-8", "replace"))
                return
            self._warn("retry", "collector unavailable (%s); retrying, %d reports queued",
                       status or data[:200].decode("utf-8", "replace"), self._queue.qsize() + len(batch))
            self._closing.wait(delay) if not self._closing.is_set() else time.sleep(delay)

    def _give_up_queue(self) -> None:
        n = 0
        while True:
            try:
                self._queue.get_nowait()
                n += 1
            except queue.Empty:
                break
        if n:
            self._count_drop(n)
            self._warn("close", "closing: %d queued reports not delivered", n)


class DirectivePoller:
    """Long-polls ``GET {url}/v1/directives/{run_id}`` and keeps the newest directive in ``latest``.

    ``on_directive(d)`` runs on the poller thread for every new version; its exceptions are logged,
    never raised. Errors back off with jitter (honouring Retry-After). If the collector answers with a
    lower version than we hold (its database was replaced), the poller resynchronises to it.
    """

    def __init__(self, url: str, run_id: str, *, token: str | None = None, wait_s: float = 30.0,
                 on_directive: Callable[[Directive], object] | None = None, backoff_base_s: float = 0.2,
                 backoff_max_s: float = 30.0) -> None:
        self._http = _Http(url, token, wait_s + 10.0)
        self._path = f"/v1/directives/{urllib.parse.quote(run_id, safe='')}"
        self._wait_s = wait_s
        self._on_directive = on_directive
        self._backoff = _Backoff(backoff_base_s, backoff_max_s)
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
                status, data, retry_after = self._http.request(
                    "GET", f"{self._path}?index={self._index}&wait={self._wait_s:g}")
                if status == 200:
                    self._backoff.reset()
                    self._take(Directive.model_validate_json(data))
                    continue
                self._warn(f"http{status}", "directive poll got HTTP %d: %s", status,
                           data[:300].decode("utf-8", "replace"))
            except Exception as e:
                if self._stop.is_set():
                    return
                self._warn("error", "directive poll failed: %r", e)
            self._stop.wait(self._backoff.next(_retry_after(retry_after)))

    def _take(self, d: Directive) -> None:
        if d.version < self._index:
            self._warn("resync", "collector's directive version went back from %d to %d; following it",
                       self._index, d.version)
            self._index = d.version
            return
        if d.version == self._index:
            return
        self._index = d.version
        self.latest = d
        if self._on_directive is not None:
            try:
                self._on_directive(d)
            except Exception as e:
                self._warn("callback", "on_directive raised %r (ignored)", e)
