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


class _Server(uvicorn.Server):
    """uvicorn, plus: on shutdown, answer the long-polls first so none is cancelled mid-wait."""

    def __init__(self, settings: Settings, port: int) -> None:
        self.app = create_app(settings)
        # One worker: the live state is in this process. Short graceful shutdown: long-polls just retry.
        super().__init__(uvicorn.Config(self.app, host=settings.host, port=port, workers=1,
                                        log_level=settings.log_level, timeout_graceful_shutdown=3))

    async def shutdown(self, sockets=None) -> None:
        res = getattr(self.app.state, "resources", None)
        if res is not None:
            res.hub.close()
        await super().shutdown(sockets=sockets)


def serve(settings: Settings) -> None:
    """Run the collector in the foreground until interrupted."""
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
        self.url = f"http://{self.settings.host}:{port}"
        with urllib.request.urlopen(self.url + "/readyz", timeout=5):
            pass
        return self

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
