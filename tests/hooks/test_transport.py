"""The trainer-side transport: never blocks, never raises, counts what it loses, honours Retry-After."""

import email.utils
import http.server
import logging
import subprocess
import sys
import threading
import time

import pytest
from support import CollectorProcess, free_port, scrape, step_report

from nanwatch.hooks.report.transport import DirectivePoller, ReportSender, _Backoff, _retry_after
from nanwatch.wire import ReportBatch


class _Script(http.server.BaseHTTPRequestHandler):
    """A fake collector answering from a script of (status, headers) and recording what it got."""

    script: list = []
    got: list = []

    def do_POST(self):  # noqa: N802
        body = self.rfile.read(int(self.headers["Content-Length"]))
        type(self).got.append((self.headers.get("Authorization"), ReportBatch.model_validate_json(body)))
        status, headers = type(self).script.pop(0) if type(self).script else (200, {})
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        payload = b'{"accepted": 1, "duplicates": 0}'
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


@pytest.fixture
def fake():
    _Script.script, _Script.got = [], []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Script)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_retries_after_503_and_sends_the_token_from_env(fake, monkeypatch):
    server, url = fake
    monkeypatch.setenv("NANWATCH_TOKEN", "from-env")
    _Script.script = [(503, {"Retry-After": "0"}), (500, {}), (200, {})]
    sender = ReportSender(url, backoff_base_s=0.01)
    assert sender.submit(step_report(seq=0))
    assert sender.close(timeout_s=10)
    assert len(_Script.got) == 3 and sender.delivered == 1 and sender.dropped == 0
    assert {auth for auth, _ in _Script.got} == {"Bearer from-env"}


def test_refused_batch_is_given_up_counted_and_warned(fake, caplog):
    _, url = fake
    _Script.script = [(422, {})]
    sender = ReportSender(url, token="t")
    with caplog.at_level(logging.WARNING, logger="nanwatch.transport"):
        sender.submit(step_report(seq=0))
        assert sender.close(timeout_s=10) is False  # not everything was delivered
    assert sender.dropped == 1 and sender.delivered == 0
    assert "HTTP 422" in caplog.text


def test_drops_are_reported_once_the_collector_is_back(fake):
    _, url = fake
    _Script.script = [(503, {"Retry-After": "0"})] * 3
    sender = ReportSender(url, max_queue=2, batch_max=1, backoff_base_s=0.05)
    results = [sender.submit(step_report(seq=i)) for i in range(6)]
    assert results.count(False) == sender.dropped >= 1
    assert sender.close(timeout_s=10)
    assert max(b.reports[-1].dropped_reports for _, b in _Script.got) == sender.dropped


def test_retry_after_is_a_floor_for_the_backoff():
    b = _Backoff(0.1, 10.0)
    assert all(b.next(2.5) >= 2.5 for _ in range(50))
    assert _retry_after("3") == 3.0 and _retry_after("junk") is None and _retry_after(None) is None
    assert _retry_after("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0  # in the past: no wait
    soon = email.utils.formatdate(time.time() + 120, usegmt=True)
    assert 100 <= _retry_after(soon) <= 121  # an HTTP-date ahead: wait until then
    assert _retry_after(email.utils.formatdate(time.time() + 86400, usegmt=True)) == 300.0  # capped


def test_submit_never_blocks_or_raises_when_no_collector_listens():
    sender = ReportSender(f"http://127.0.0.1:{free_port()}", max_queue=8, batch_max=4, timeout_s=1)
    results = [sender.submit(step_report(seq=i)) for i in range(100)]
    assert results[:8] == [True] * 8 and results.count(False) >= 100 - 8 - 4  # the thread may hold one batch
    assert sender.close(timeout_s=0.2) is False
    assert sender.dropped == 100 - sender.delivered and sender.delivered == 0


def test_submit_after_close_is_a_counted_drop(fake):
    _, url = fake
    sender = ReportSender(url)
    sender.close(timeout_s=1)
    assert sender.submit(step_report(seq=0)) is False and sender.dropped == 1


def test_poller_sees_directives_and_closes_mid_poll(tmp_path):
    import httpx

    with CollectorProcess(db_path=tmp_path / "p.db") as c:
        got = []
        poller = DirectivePoller(c.url, "poll-run", wait_s=30, on_directive=got.append)
        httpx.put(f"{c.url}/v1/directives/poll-run", json={"mode": "fp32"})
        deadline = time.monotonic() + 20
        while poller.latest is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert poller.latest is not None and poller.latest.mode == "fp32" and got == [poller.latest]
        poller.close()  # while a 30 s long-poll is in flight
        assert not poller._thread.is_alive()


def test_sender_against_a_real_collector_reports_its_drops(tmp_path):
    with CollectorProcess(db_path=tmp_path / "s.db") as c:
        sender = ReportSender(c.url, max_queue=4, batch_max=1)
        sender._dropped = 3  # as if three reports had been lost earlier
        assert sender.submit(step_report(run_id="drops", seq=0, dropped=3))
        assert sender.close(timeout_s=10)
        assert scrape(c.url)[("nanwatch_reports_dropped_total",
                              frozenset({("run_id", "drops"), ("rank", "0")}))] == 3


def test_transport_imports_neither_torch_nor_the_web_stack():
    # Loaded by path: the nanwatch.hooks package itself imports torch, the module must not need it.
    code = ("import importlib.util as u, sys, nanwatch.hooks.report.transport as t; "
            "spec = u.spec_from_file_location('lone_transport', t.__file__); "
            "[sys.modules.pop(m) for m in list(sys.modules) if m.split('.')[0] in ('torch', 'nanwatch')]; "
            "u.module_from_spec(spec); spec.loader.exec_module(u.module_from_spec(spec)); "
            "bad = [m for m in ('torch', 'fastapi', 'starlette', 'uvicorn', 'prometheus_client', 'httpx', "
            "'requests') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_transport_imports_without_torch():
    """What its docstring promises: the package ``__init__`` is lazy, so only the leaf's own imports run."""
    blocker = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('torch', 'transformers'):\n"
        "            raise ImportError('blocked: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import nanwatch.hooks.report.transport, nanwatch.hooks.directives.decision, nanwatch.hooks.measure.call_stack\n"
        "import nanwatch.hooks.directives.local_rules, nanwatch.hooks.measure.compiled, nanwatch.hooks.failsafe\n"
        "import nanwatch.bench.tiny_models\n"
        "from nanwatch.hooks import __all__ as names\n"
        "assert names == ['Monitor', 'MonitorConfig', 'attach', 'fingerprint', 'record_routes', 'rollout_logprobs'], names\n"
        "assert 'torch' not in sys.modules\n"
    )
    out = subprocess.run([sys.executable, "-c", blocker], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_one_collector_url_check():
    from nanwatch.addresses import check_collector_url

    assert check_collector_url("https://c.example:8443/prefix").port == 8443
    for bad in ("http://", "http://host:notaport", "ftp://host", "host:80"):
        with pytest.raises(ValueError, match="collector"):
            check_collector_url(bad)
    with pytest.raises(ValueError, match="collector"):
        ReportSender("http://host:notaport")


class _Endless(http.server.BaseHTTPRequestHandler):
    """Answers every POST with a body that never ends (a hostile or broken endpoint)."""

    def do_POST(self):  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        chunk = b" " * 65536
        try:
            while True:
                self.wfile.write(chunk)
        except OSError:
            pass

    def log_message(self, *args):
        pass


def test_an_endless_answer_is_read_no_further_than_the_bound():
    """The sender's and ``nanwatch push``'s one connection reads at most MAX_ANSWER_BYTES of an answer."""
    from nanwatch.hooks.report.transport import MAX_ANSWER_BYTES, KeepAliveHttp

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Endless)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        http_ = KeepAliveHttp(f"http://127.0.0.1:{server.server_address[1]}", token="t", timeout_s=30)
        with pytest.raises(OSError, match=f"over {MAX_ANSWER_BYTES} bytes"):
            http_.request("POST", "/v1/reports", b"{}")
    finally:
        server.shutdown()


class _Instant(http.server.BaseHTTPRequestHandler):
    """A collector (or a proxy) that answers every directive long-poll at once, counting them."""

    polls = 0

    def do_GET(self):  # noqa: N802
        type(self).polls += 1
        payload = b'{"run_id": "quick", "version": 0, "mode": "none", "apply_at_step": 0}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


def test_the_poller_backs_off_from_a_collector_that_answers_every_poll_at_once():
    """#37 finding 9: facing a collector that did not hold the long-poll, the poller looped with no pause
    (~22 requests a second). Now a floor between answers that bring nothing new, doubling with jitter: over
    3 s it polls at most 1 + 1 (after >= 1 s) + 1 (after >= 2 more) times, not hundreds."""
    _Instant.polls = 0
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Instant)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        poller = DirectivePoller(f"http://127.0.0.1:{server.server_address[1]}", "quick", wait_s=30)
        time.sleep(3.0)
        poller.close()
        assert 1 <= _Instant.polls <= 3, _Instant.polls
    finally:
        server.shutdown()


def test_a_real_collector_holds_the_poll_so_the_poller_sends_one(tmp_path):
    """The collector's long-poll holds as documented (GET /v1/directives/{run}?wait=): the poller's first poll
    is still waiting there, and answered by the next directive at once."""
    import httpx
    from support import background_collector

    with background_collector(tmp_path) as srv:
        polls = srv.app.state.resources.polls
        poller = DirectivePoller(srv.url, "held", wait_s=30)
        deadline = time.monotonic() + 10
        while polls.waiting() == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(1.0)
        assert polls.waiting() == 1 and poller.latest is None  # held, not answered and re-sent
        httpx.put(f"{srv.url}/v1/directives/held", json={"mode": "fp32"})
        while poller.latest is None and time.monotonic() < deadline + 10:
            time.sleep(0.02)
        assert poller.latest is not None and poller.latest.mode == "fp32"
        poller.close()
