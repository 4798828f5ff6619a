"""deploy/nginx/nginx.conf in front of a real collector (issue #19, connection hygiene and TLS): Debian's
nginx as a non-root user on loopback, the shipped file rendered with loopback ports and temporary paths
(nothing else changed), a self-signed certificate made by ``openssl req``, and a real ``nanwatch serve``
as its upstream. Each test is an attack the bare collector loses, answered by nginx before the collector
sees it.

    python tests/deploy/test_nginx.py   # the latency nginx adds to a trainer POST (direct vs through nginx)
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # support, when run as a script
from support import ADMIN, JSON, TOKEN, CollectorProcess, free_port, require_tool, scrape, step_report  # noqa: E402

from nanwatch.wire import ReportBatch  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "deploy" / "nginx" / "nginx.conf"
INGEST_H = {"Authorization": f"Bearer {TOKEN}", **JSON}
ADMIN_H = {"Authorization": f"Bearer {ADMIN}", **JSON}
#: deadlines for waiting, far above the shipped timeouts (header and body 10 s, keep-alive 15 s)
DEADLINE_S = 90.0


def render(text: str, *, ingest_port: int, admin_port: int, upstream_port: int, tls_dir: Path, tmp: Path) -> str:
    """The shipped config with loopback ports and temporary paths: the only words that name a place. Each
    must be there, so a renamed path fails here instead of silently testing another config."""
    swaps = {"/tmp/": f"{tmp}/", "listen 8443 ssl": f"listen {ingest_port} ssl", "listen 9443 ssl": f"listen {admin_port} ssl",
             "server 127.0.0.1:8000": f"server 127.0.0.1:{upstream_port}", "/etc/nginx/tls/": f"{tls_dir}/"}
    for old, new in swaps.items():  # /tmp/ first: the others may be under it
        assert old in text, f"deploy/nginx/nginx.conf no longer says {old!r}"
        text = text.replace(old, new)
    return text


def self_signed(folder: Path) -> Path:
    """tls.crt and tls.key for 127.0.0.1, as deploy/secrets/README.md makes them."""
    openssl = require_tool("openssl")
    subprocess.run([openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-days", "2", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
                    "-keyout", str(folder / "tls.key"), "-out", str(folder / "tls.crt")],
                   check=True, capture_output=True)
    return folder / "tls.crt"


def _port_open(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
        return True
    return False


@contextlib.contextmanager
def nginx_in_front(upstream_port: int):
    """nginx with the shipped config on two free loopback ports: (ingest url, admin url, CA file, its log:
    the access log and errors). As root
    (CI), nginx runs as ``nobody`` through setpriv, in a folder it owns: the config needs no root."""
    binary = shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if os.access(p, os.X_OK)), None)
    if binary is None:
        if os.environ.get("NANWATCH_REQUIRE_TOOLS") == "1":
            pytest.fail("nginx is not installed and NANWATCH_REQUIRE_TOOLS=1")
        pytest.skip("nginx is not installed (Debian: apt-get install nginx)")
    home = Path(tempfile.mkdtemp(prefix="nanwatch-nginx-"))
    (home / "tls").mkdir()
    ca = self_signed(home / "tls")
    ingest, admin = free_port(), free_port()
    conf = home / "nginx.conf"
    conf.write_text(render(CONF.read_text(), ingest_port=ingest, admin_port=admin, upstream_port=upstream_port,
                           tls_dir=home / "tls", tmp=home))
    # nginx reopens its stdout (access_log /dev/stdout): the log file must be its user's too
    log = open(home / "nginx.log", "wb")  # noqa: SIM115 (closed below, after the process)
    cmd = [binary, "-p", str(home), "-c", str(conf), "-e", "stderr", "-g", "daemon off;"]
    if os.geteuid() == 0:
        nobody = pwd.getpwnam("nobody")
        os.chmod(home, 0o755)
        for path in (home, *home.rglob("*")):
            os.chown(path, nobody.pw_uid, nobody.pw_gid)
        cmd = ["setpriv", f"--reuid={nobody.pw_uid}", f"--regid={nobody.pw_gid}", "--clear-groups", *cmd]
    proc = subprocess.Popen(cmd, stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + DEADLINE_S
        while not (_port_open(ingest) and _port_open(admin)):
            assert proc.poll() is None, f"nginx exited: {(home / 'nginx.log').read_text()}"
            assert time.monotonic() < deadline, "nginx did not listen"
            time.sleep(0.05)
        yield f"https://127.0.0.1:{ingest}", f"https://127.0.0.1:{admin}", ca, home / "nginx.log"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """A collector with tokens on loopback and nginx in front of it."""
    db = tmp_path_factory.mktemp("nginx") / "nanwatch.db"
    env = {"NANWATCH_TOKEN": TOKEN, "NANWATCH_ADMIN_TOKEN": ADMIN}
    with CollectorProcess(db_path=db, env=env) as c, nginx_in_front(c.port) as (url, admin_url, ca, log):
        c.https, c.admin_https, c.ca, c.nginx_log = url, admin_url, ca, log
        yield c


def _tls(stack, port_url: str | None = None) -> ssl.SSLSocket:
    """A raw TLS connection to nginx's ingest port, verified against the test's certificate."""
    port = int((port_url or stack.https).rsplit(":", 1)[1])
    ctx = ssl.create_default_context(cafile=str(stack.ca))
    sock = ctx.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=DEADLINE_S),
                           server_hostname="127.0.0.1")
    sock.settimeout(DEADLINE_S)
    return sock


def _answer_head(sock: ssl.SSLSocket) -> bytes:
    """Bytes until the end of one answer's head (or the close)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def _closed_within(sock: ssl.SSLSocket, deadline_s: float) -> bool:
    """Whether the server closes the connection before the deadline (anything it sends first is drained)."""
    sock.settimeout(deadline_s)
    end = time.monotonic() + deadline_s
    try:
        while time.monotonic() < end:
            if not sock.recv(65536):
                return True
    except (ConnectionResetError, ssl.SSLEOFError, BrokenPipeError):
        return True
    except TimeoutError:
        return False
    return False


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def _logged(stack, text: str) -> str:
    """The last line of nginx's access log that holds ``text``, once there is one. The log's last field is
    the upstream's response time: ``-`` when the collector never saw the request."""
    deadline = time.monotonic() + DEADLINE_S
    while not (lines := [x for x in stack.nginx_log.read_text().splitlines() if text in x]):
        assert time.monotonic() < deadline, stack.nginx_log.read_text()[-2000:]
        time.sleep(0.1)
    return lines[-1]


def _batch(*reports) -> str:
    return ReportBatch(reports=list(reports)).model_dump_json()


def test_a_trainer_report_over_tls_reaches_the_collector(stack, monkeypatch):
    """A report through nginx is counted; /metrics is read through it too, trusting the self-signed
    certificate the documented way (SSL_CERT_FILE, which Python's http.client and urllib read)."""
    with httpx.Client(verify=ssl.create_default_context(cafile=str(stack.ca)), timeout=30) as client:
        r = client.post(f"{stack.https}/v1/reports", content=_batch(step_report(run_id="tls", seq=0)),
                        headers=INGEST_H)
        assert r.status_code == 200, r.text
        assert client.get(f"{stack.https}/v1/directives/tls", params={"wait": 0}, headers=INGEST_H).status_code == 200
    monkeypatch.setenv("SSL_CERT_FILE", str(stack.ca))
    s = scrape(stack.https)
    assert any(name == "nanwatch_sdpa_calls_total" and ("run_id", "tls") in labels and value > 0
               for (name, labels), value in s.items()), "the report was not counted"


def test_directives_change_only_through_the_admin_port(stack):
    """The ingest port refuses PUT/DELETE before the collector sees them (so a NetworkPolicy can keep the
    admin port to operators); the admin port passes them on, and the token decides."""
    ctx = ssl.create_default_context(cafile=str(stack.ca))
    with httpx.Client(verify=ctx, timeout=30) as client:
        assert client.put(f"{stack.https}/v1/directives/adm", json={"mode": "fp32"}, headers=ADMIN_H).status_code == 403
        assert client.delete(f"{stack.https}/v1/directives/adm", headers=ADMIN_H).status_code == 403
        r = client.put(f"{stack.admin_https}/v1/directives/adm", json={"mode": "fp32"}, headers=ADMIN_H)
        assert r.status_code == 200, r.text
        assert client.put(f"{stack.admin_https}/v1/directives/adm", json={"mode": "fp32"},
                          headers=INGEST_H).status_code == 403


def test_chunked_trailers_never_reach_the_collector(stack):
    """64 MiB of chunked trailers after a one-byte body (finding 1: the bare collector keeps them all in
    memory): nginx answers or drops the connection, and the collector's memory does not move."""
    before = _rss_kib(stack.proc.pid)
    sock = _tls(stack)
    head = (f"POST /v1/reports HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {TOKEN}\r\n"
            "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n1\r\n{\r\n0\r\n").encode()
    line = b"X-Pad: " + b"a" * 8000 + b"\r\n"
    sent = 0
    with contextlib.suppress(OSError):
        sock.sendall(head)
        while sent < 64 * 2**20:
            sock.sendall(line * 64)
            sent += len(line) * 64
        sock.sendall(b"\r\n")
    with contextlib.suppress(OSError):
        answer = _answer_head(sock)
        assert not answer or answer.startswith((b"HTTP/1.1 4", b"HTTP/1.0 4")), answer[:200]
    sock.close()
    assert httpx.get(stack.url + "/healthz").status_code == 200
    grown = _rss_kib(stack.proc.pid) - before
    assert grown < 16 * 1024, f"the collector grew by {grown} KiB"


@pytest.mark.parametrize("request_head", [
    # the bare collector answers without waiting for the body, and then held the connection for ever
    b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n",
    # a body the collector never reads (no token: 401)
    b"POST /v1/reports HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    b"Content-Length: 100\r\n\r\n" + b"x" * 100,
], ids=["get-with-unsent-body", "401-unread-body"])
def test_one_more_byte_after_an_answer_does_not_hold_the_connection(stack, request_head):
    """Finding 3: after an answer to a request whose body the collector never reads, one more byte from the
    client kept the bare collector's connection open for ever (its keep-alive timer is not re-armed). nginx
    reads bodies itself and times a stalled body or the next request's head out (10 s each)."""
    sock = _tls(stack)
    sock.sendall(request_head)
    time.sleep(0.5)
    sock.sendall(b"G")
    assert _closed_within(sock, DEADLINE_S), "nginx kept the connection open"
    sock.close()


def test_an_idle_connection_ends_at_its_keepalive_timeout(stack):
    sock = _tls(stack)
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    assert _answer_head(sock).startswith(b"HTTP/1.1 200")
    assert _closed_within(sock, DEADLINE_S), "nginx kept an idle connection open"
    sock.close()


def test_a_slow_body_times_out_in_nginx_and_never_reaches_the_collector(stack):
    """A body that stops after one byte: nginx ends it at client_body_timeout (10 s) with 408, which it
    logs and answers by closing the connection (nginx sends no page for a timed-out request); the
    collector, which would hold it for its own 30 s, never saw it (no upstream time in the log)."""
    sock = _tls(stack)
    sock.sendall(f"POST /v1/reports?slow-body HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {TOKEN}\r\n"
                 "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{".encode())
    assert _closed_within(sock, DEADLINE_S), "nginx held a stalled body"
    sock.close()
    assert _logged(stack, '"POST /v1/reports" 408 ').endswith(" -"), "the request reached the collector"


def test_one_address_holds_at_most_64_requests_and_the_next_gets_429(stack):
    """Finding 3's lock-out (held connections until the collector ran out of descriptors): a client that
    keeps 64 requests open (bodies never finished) gets 429 for the next, and the collector saw none of them."""
    held = []
    try:
        for _ in range(64):
            sock = _tls(stack)
            sock.sendall(b"POST /v1/reports HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n{")
            held.append(sock)
        time.sleep(0.5)  # nginx has read every head
        sock = _tls(stack)
        held.append(sock)
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert _answer_head(sock).startswith(b"HTTP/1.1 429")
        assert _logged(stack, '"GET /healthz" 429 ').endswith(" -"), "the request reached the collector"
    finally:
        for sock in held:
            sock.close()


# ---- the latency nginx adds to a trainer POST: a benchmark for the README, not an assertion -------------

def _latencies(client: httpx.Client, url: str, run_id: str, n: int) -> list[float]:
    out = []
    for seq in range(n):
        body = _batch(step_report(run_id=run_id, seq=seq))
        t0 = time.perf_counter()
        r = client.post(f"{url}/v1/reports", content=body, headers=INGEST_H)
        out.append(time.perf_counter() - t0)
        assert r.status_code == 200, r.text
    return out


def main(n: int = 1000) -> None:
    """p50/p99 of a trainer POST (one report, a kept-alive connection), direct and through nginx, in turns
    of 100 so both see the same machine load."""
    with tempfile.TemporaryDirectory() as tmp, \
            CollectorProcess(db_path=Path(tmp) / "c.db", env={"NANWATCH_TOKEN": TOKEN}) as c, \
            nginx_in_front(c.port) as (https, _, ca, _log), \
            httpx.Client(timeout=30) as direct, \
            httpx.Client(verify=ssl.create_default_context(cafile=str(ca)), timeout=30) as proxied:
        times: dict[str, list[float]] = {"direct": [], "nginx": []}
        _latencies(direct, c.url, "warm-d", 50), _latencies(proxied, https, "warm-n", 50)
        for turn in range(n // 100):
            times["direct"] += _latencies(direct, c.url, f"direct-{turn}", 100)
            times["nginx"] += _latencies(proxied, https, f"nginx-{turn}", 100)
        for name, t in times.items():
            q = statistics.quantiles(t, n=100)
            print(f"{name:>6}: n={len(t)} p50={q[49] * 1e3:.2f} ms p99={q[98] * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
