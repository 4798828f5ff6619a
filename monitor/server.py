"""Running the collector: ``serve`` (blocking, for ``nanwatch serve``) and ``BackgroundServer`` (a real
uvicorn server on a thread, for the demo and for embedding the collector in a trainer-side process)."""

from __future__ import annotations

import threading
import time
import urllib.request

import uvicorn

from nanwatch.monitor.app import create_app
from nanwatch.monitor.settings import Settings

__all__ = ["BackgroundServer", "serve"]


def _config(settings: Settings, port: int) -> uvicorn.Config:
    # One worker: the live state is in this process. Short graceful shutdown: long-polls simply retry.
    return uvicorn.Config(create_app(settings), host=settings.host, port=port, workers=1,
                          log_level=settings.log_level, timeout_graceful_shutdown=3)


def serve(settings: Settings) -> None:
    """Run the collector in the foreground until interrupted."""
    settings.check_exposure()
    uvicorn.Server(_config(settings, settings.port)).run()


class BackgroundServer:
    """The collector on a daemon thread. ``port=0`` in settings picks a free port.

    Example usage::

        with BackgroundServer(Settings(db_path=":memory:", port=0)) as srv:
            nanwatch.attach(model, run_id="r", collector=srv.url)
    """

    def __init__(self, settings: Settings) -> None:
        settings.check_exposure()
        self.settings = settings
        self._server = uvicorn.Server(_config(settings, settings.port))
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
        self.url = f"http://{self.settings.host}:{port}"
        with urllib.request.urlopen(self.url + "/readyz", timeout=5):
            pass
        return self

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
