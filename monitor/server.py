"""Running the collector: ``serve`` (blocking, for ``nanwatch serve``) and ``BackgroundServer`` (a real
uvicorn server on a thread, for the demo and for embedding the collector in a trainer-side process). The
collector as a child process, for the load benchmark and tests, is ``nanwatch.bench.serve``."""

from __future__ import annotations

import logging
import re
import resource
import ssl
import sys
import threading
import time
import urllib.request
from pathlib import Path
from urllib.parse import unquote_plus

import uvicorn

from nanwatch.monitor.app import create_app
from nanwatch.monitor.settings import Settings
from nanwatch.monitor.web.protocol import bounded_protocol

__all__ = ["LOGGED_PARAMETERS", "BackgroundServer", "raise_fd_limit", "redact_query", "serve"]


#: the query parameters whose values the access log shows: the ones the routes document, none secret
LOGGED_PARAMETERS = frozenset({"index", "wait", "limit", "after"})
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_.-]{1,32}")


def redact_query(target: str) -> str:
    """A request target as the access log may show it: the path, and of the query only the allow-listed
    parameters (``LOGGED_PARAMETERS``, matched after percent-decoding) with their values. Any other
    parameter keeps its name if that is a short plain word and loses its value (``api_key=<redacted>``);
    anything else is ``<redacted>`` whole. An allow-list: a secret in a parameter nobody thought of
    (``?jwt=``, ``%74oken=``, a bare ``?<token>``) is never written."""
    path, sep, query = target.partition("?")
    if not sep:
        return target
    shown = []
    for part in query.split("&"):
        raw_name, eq, _ = part.partition("=")
        name = unquote_plus(raw_name)
        if name in LOGGED_PARAMETERS:
            shown.append(part)
        elif eq and _PLAIN_NAME.fullmatch(name):
            shown.append(f"{name}=<redacted>")
        else:
            shown.append("<redacted>")
    return f"{path}?{'&'.join(shown)}"


class _RedactQuery(logging.Filter):
    """The access log never shows a query value that is not allow-listed (``redact_query``): the collector
    takes tokens only from the Authorization header, but a client may still send one in the URL."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple) and len(record.args) >= 3 and isinstance(record.args[2], str):
            args = list(record.args)
            args[2] = redact_query(args[2])
            record.args = tuple(args)
        return True


def raise_fd_limit() -> int:
    """The soft descriptor limit up to the hard one (every connection is a descriptor; a process started
    afterwards inherits it); returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            pass
    return soft


def _check_tls(cert: Path, key: Path | None) -> None:
    """Load the certificate and key as uvicorn will, so that a wrong path or a key of another certificate
    is a one-line error before listening (ValueError), not a traceback from the server's startup."""
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as e:
        raise ValueError(f"cannot load the TLS certificate {str(cert)!r} with the key {str(key)!r}: {e}") from e


class _Server(uvicorn.Server):
    """uvicorn, plus: limits on request heads and trailers (size, time) and on idle connections after an
    answer (``nanwatch.monitor.web.protocol``), TLS when a certificate is configured, only allow-listed query
    values in the access log, and on shutdown the long-polls answered first so none is cancelled mid-wait."""

    def __init__(self, settings: Settings, port: int) -> None:
        if settings.tls_cert_file is not None:
            _check_tls(settings.tls_cert_file, settings.tls_key_file)
        self.app = create_app(settings)
        raise_fd_limit()
        protocol = bounded_protocol(max_header_bytes=settings.max_header_bytes,
                                    header_timeout_s=settings.header_timeout_s)
        # One worker: the live state is in this process. Short graceful shutdown: long-polls just retry.
        tls = {"ssl_certfile": settings.tls_cert_file, "ssl_keyfile": settings.tls_key_file}
        super().__init__(uvicorn.Config(self.app, host=settings.host, port=port, workers=1, http=protocol,
                                        log_level=settings.log_level, timeout_graceful_shutdown=3,
                                        timeout_keep_alive=settings.keep_alive_s, **tls))
        access = logging.getLogger("uvicorn.access")
        if not any(isinstance(f, _RedactQuery) for f in access.filters):
            access.addFilter(_RedactQuery())

    async def shutdown(self, sockets=None) -> None:
        res = getattr(self.app.state, "resources", None)
        if res is not None:
            res.polls.close()
        await super().shutdown(sockets=sockets)


#: How often a thread holding the GIL hands it over (Python's default is 5 ms). The collector renders
#: ``/metrics`` in a worker thread; at the default, the event loop waited up to 5 ms for each of the many
#: handovers a request needs, so a 2.5 s render of 9,000 runs took the trainers' ingest p99 from 3 ms to
#: 1.3 s (``tests/collector_attack_bench.py --attack runs-listing``); at 0.5 ms it was 187 ms, for a render ~5 %
#: slower. Set in ``nanwatch serve`` only: an embedded collector leaves its host process's setting alone.
GIL_SWITCH_INTERVAL_S = 0.0005


def serve(settings: Settings) -> None:
    """Run the collector in the foreground until interrupted (this process is the collector's: it takes
    ``GIL_SWITCH_INTERVAL_S``)."""
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    _Server(settings, settings.port).run()


class BackgroundServer:
    """The collector on a daemon thread. ``port=0`` in settings picks a free port.

    Example usage::

        with BackgroundServer(Settings(db_path=":memory:", port=0)) as srv:
            nanwatch.attach(model, run_id="r", collector=srv.url)
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._server = _Server(settings, settings.port)
        self.app = self._server.app
        self._thread = threading.Thread(target=self._server.run, name="nanwatch-collector", daemon=True)
        self.url = ""

    def __enter__(self) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the collector did not start (see its log above)")
            time.sleep(0.02)
        port = self._server.servers[0].sockets[0].getsockname()[1]
        scheme = "http" if self.settings.tls_cert_file is None else "https"
        self.url = f"{scheme}://{self.settings.host}:{port}"
        # A look at its own socket: the certificate may name a host other than the listen address.
        probe = ssl.create_default_context()
        probe.check_hostname, probe.verify_mode = False, ssl.CERT_NONE
        with urllib.request.urlopen(self.url + "/readyz", timeout=5, context=probe if scheme == "https" else None):
            pass
        return self

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
