"""The HTTP edge attacked as a hostile client would (issue #19, findings 1-3 and 17): trailers, bodies sent
before any token, connections that outlive their answer, secrets in the access log, the API documents
without a token, and TLS without a proxy. Each against a real ``nanwatch serve`` child on loopback."""

from __future__ import annotations

import contextlib
import json
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from support import ADMIN, JSON, TOKEN, CollectorProcess, free_port, require_tool, step_report

from nanwatch.wire import ReportBatch

INGEST_H = {"Authorization": f"Bearer {TOKEN}", **JSON}
TOKENS = {"NANWATCH_TOKEN": TOKEN, "NANWATCH_ADMIN_TOKEN": ADMIN}


def _batch(*reports) -> bytes:
    return ReportBatch(reports=list(reports)).model_dump_json().encode()


def _rss_bytes(pid: int) -> int:
    """The process's resident set (VmRSS) in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _connect(port: int, timeout_s: float = 30.0) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port))
    s.settimeout(timeout_s)
    return s


def _closed_by_server(s: socket.socket, deadline_s: float) -> bool:
    """Whether the server closes ``s`` within ``deadline_s``, whatever it answered before."""
    end = time.monotonic() + deadline_s
    with contextlib.suppress(ConnectionResetError, BrokenPipeError):
        while time.monotonic() < end:
            s.settimeout(max(0.05, end - time.monotonic()))
            try:
                if s.recv(65536) == b"":
                    return True
            except TimeoutError:
                return False
        return False
    return True


def _head(method: str, path: str, headers: dict[str, str]) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _status(s: socket.socket) -> int:
    """The status code of the answer on ``s`` (reads its first line)."""
    got = b""
    while b"\r\n" not in got:
        chunk = s.recv(4096)
        if not chunk:
            raise ConnectionResetError("closed before an answer")
        got += chunk
    return int(got.split(b" ", 2)[1])


# ---- finding 1: chunked trailers are neither kept nor unbounded -------------------------------------------

def test_request_trailers_are_not_kept_and_a_flood_of_them_closes_the_connection(tmp_path):
    """64 MiB of trailers after a chunked body: the collector's RSS does not grow by them (before: it kept
    every trailer line in the request's headers, after the head limit stopped counting), the connection is
    closed, and a trainer is served."""
    with CollectorProcess(db_path=tmp_path / "c.db", env=TOKENS) as c:
        httpx.post(f"{c.url}/v1/reports", content=_batch(step_report(run_id="warm", seq=0)), headers=INGEST_H)
        before = _rss_bytes(c.proc.pid)
        s = _connect(c.port)
        s.sendall(_head("POST", "/v1/reports", {**INGEST_H, "Transfer-Encoding": "chunked"}) + b"2\r\n{}\r\n0\r\n")
        line = b"X-Pad: " + b"a" * (16 * 1024 - 9) + b"\r\n"
        sent = 0
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # cut off once over the limit
            while sent < 64 << 20:
                s.sendall(line * 64)
                sent += len(line) * 64
        grown = _rss_bytes(c.proc.pid) - before
        assert _closed_by_server(s, 30), "the connection was left open"
        s.close()
        assert grown < 16 << 20, f"RSS grew by {grown / 2**20:.0f} MiB under 64 MiB of trailers"
        ok = httpx.post(f"{c.url}/v1/reports", content=_batch(step_report(run_id="trainer", seq=0)), headers=INGEST_H)
        assert ok.status_code == 200, ok.text


# ---- finding 2: authorise before buffering; a budget per credential ----------------------------------------

BODY = 512 * 1024  # NANWATCH_MAX_BODY_BYTES in these tests; 16 of them are the whole buffered budget
BUDGET = {"NANWATCH_MAX_BODY_BYTES": str(BODY), "NANWATCH_MAX_BUFFERED_BYTES": str(16 * BODY)}


def _partial_bodies(port: int, n: int, headers: dict[str, str]) -> list[socket.socket]:
    """``n`` connections, each with a body one byte short of its Content-Length (the largest allowed):
    held open, they would hold the whole buffered budget but 16 bytes."""
    conns = []
    for _ in range(n):
        s = _connect(port)
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # refused and closed before the body
            s.sendall(_head("POST", "/v1/reports", {**headers, "Content-Length": str(BODY)}) + b" " * (BODY - 1))
        conns.append(s)
    time.sleep(1.0)  # let the collector read what was sent (no assertion rests on the time)
    return conns


def test_bodies_without_a_token_are_refused_before_a_byte_is_read(tmp_path):
    """16 unauthenticated partial bodies held open: each gets 401 and is closed, and a trainer posting with
    the real token meanwhile gets 200 (before: the bodies were buffered first and every trainer got 503)."""
    with CollectorProcess(db_path=tmp_path / "c.db", env={**TOKENS, **BUDGET}) as c:
        attackers = _partial_bodies(c.port, 16, {**JSON, "Authorization": "Bearer not-a-token"})
        try:
            ok = httpx.post(f"{c.url}/v1/reports", content=_batch(step_report(run_id="trainer", seq=0)),
                            headers=INGEST_H, timeout=30)
            assert ok.status_code == 200, ok.text
            for s in attackers:
                assert _status(s) == 401
                assert _closed_by_server(s, 30)
        finally:
            for s in attackers:
                s.close()


def test_one_tokens_flood_of_partial_bodies_does_not_shed_another_token(tmp_path):
    """Team A holds 16 partial bodies open (its own budget takes four); team B's POST gets 200 (before:
    team A's bodies filled the one shared budget and team B got 503)."""
    tokens = {"team-a": {"token": "team-a-secret", "runs": "team-a-*"},
              "team-b": {"token": "team-b-secret", "runs": "team-b-*"}}
    env = {**BUDGET, "NANWATCH_ADMIN_TOKEN": ADMIN, "NANWATCH_TOKENS": json.dumps(tokens),
           "NANWATCH_MAX_BUFFERED_BYTES_PER_TOKEN": str(4 * BODY)}
    with CollectorProcess(db_path=tmp_path / "c.db", env=env) as c:
        flood = _partial_bodies(c.port, 16, {**JSON, "Authorization": "Bearer team-a-secret"})
        try:
            ok = httpx.post(f"{c.url}/v1/reports", content=_batch(step_report(run_id="team-b-run", seq=0)),
                            headers={**JSON, "Authorization": "Bearer team-b-secret"}, timeout=30)
            assert ok.status_code == 200, ok.text
        finally:
            for s in flood:
                s.close()


# ---- finding 3: no connection outlives its keep-alive after an answer ---------------------------------------

@pytest.mark.parametrize("method,path,headers", [
    ("GET", "/healthz", {}),  # 200, its body never read
    ("GET", "/v1/runs", {}),  # 401, its body never read
    ("POST", "/nowhere", JSON),  # 404
    ("POST", "/v1/reports", {"Authorization": f"Bearer {TOKEN}", "Content-Type": "text/plain"}),  # 415
], ids=["200", "401", "404", "415"])
def test_a_connection_that_keeps_sending_after_its_answer_is_closed_at_the_keep_alive(tmp_path, method, path,
                                                                                      headers):
    """The answer comes before the request's body was read; the client then keeps sending bytes of it.
    The connection is closed at the keep-alive timeout (before: uvicorn cancelled its keep-alive timer on
    the first byte and never re-armed it, so the connection stayed open for ever)."""
    env = {**TOKENS, "NANWATCH_KEEP_ALIVE_S": "1"}
    with CollectorProcess(db_path=tmp_path / "c.db", env=env) as c:
        s = _connect(c.port)
        s.sendall(_head(method, path, {**headers, "Content-Length": "100000"}))
        assert _status(s) in (200, 401, 404, 415)
        end = time.monotonic() + 15  # the keep-alive is 1 s: a generous margin
        closed = False
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            while time.monotonic() < end and not closed:
                s.sendall(b"x")  # one more byte of the unread body, again and again
                closed = _closed_by_server(s, 0.3)
        closed = closed or _closed_by_server(s, 0.1)
        s.close()
        assert closed, "the connection outlived its keep-alive"
        assert httpx.get(f"{c.url}/healthz").status_code == 200


# ---- finding 17: the access log shows allow-listed query parameters only ----------------------------------

def test_the_access_log_shows_only_allow_listed_query_values(tmp_path):
    log = tmp_path / "collector.log"
    with CollectorProcess(db_path=tmp_path / "c.db", env={"NANWATCH_LOG_LEVEL": "info"}, log_path=log) as c:
        query = "index=0&wait=0&api_key=S3CRET1&jwt=S3CRET2&%74oken=S3CRET3&S3CRET4&x%3Dy=S3CRET5"
        assert httpx.get(f"{c.url}/v1/directives/run-a?{query}").status_code == 200
    lines = [ln for ln in log.read_text().splitlines() if "/v1/directives/run-a" in ln]
    assert lines, log.read_text()
    assert "index=0&wait=0" in lines[0]
    assert "api_key=<redacted>" in lines[0] and "jwt=<redacted>" in lines[0]
    assert "S3CRET" not in log.read_text()


# ---- finding 17: the API documents are off by default, and follow the API's auth when on ---------------------

DOCS = ("/docs", "/redoc", "/openapi.json")


def test_the_api_documents_are_off_by_default(tmp_path):
    with CollectorProcess(db_path=tmp_path / "c.db") as c:
        for path in DOCS:
            assert httpx.get(c.url + path).status_code == 404, path


def test_the_api_documents_need_a_token_when_on(tmp_path):
    env = {**TOKENS, "NANWATCH_METRICS_TOKEN": "reader-secret", "NANWATCH_DOCS": "true"}
    with CollectorProcess(db_path=tmp_path / "c.db", env=env) as c:
        for path in DOCS:
            assert httpx.get(c.url + path).status_code == 401, path
            assert httpx.get(c.url + path, headers={"Authorization": "Bearer wrong"}).status_code == 401, path
            ok = httpx.get(c.url + path, headers={"Authorization": "Bearer reader-secret"})
            assert ok.status_code == 200, path
        assert "/v1/reports" in httpx.get(c.url + "/openapi.json", headers=INGEST_H).json()["paths"]


# ---- TLS without a proxy: nanwatch serve --tls-cert/--tls-key ---------------------------------------------

def test_serve_takes_a_certificate_and_answers_over_https(tmp_path):
    openssl = require_tool("openssl")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    port = free_port()
    env = {**CollectorProcess(db_path=tmp_path / "c.db", env=TOKENS).env}
    proc = subprocess.Popen([sys.executable, "-m", "nanwatch.cli", "serve", "--port", str(port), "--db",
                             str(tmp_path / "c.db"), "--tls-cert", str(cert), "--tls-key", str(key)], env=env)
    trusted = ssl.create_default_context(cafile=str(cert))
    url = f"https://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, "nanwatch serve exited"
            try:
                if httpx.get(url + "/readyz", verify=trusted, timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "not ready over https"
                time.sleep(0.1)
        ok = httpx.post(url + "/v1/reports", content=_batch(step_report(run_id="tls", seq=0)), headers=INGEST_H,
                        verify=trusted)
        assert ok.json() == {"accepted": 1, "duplicates": 0}
        with pytest.raises(httpx.TransportError):  # plain HTTP is not answered on the TLS port
            httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5)
    finally:
        proc.terminate()
        proc.wait(10)


def test_serve_refuses_a_certificate_it_cannot_load_in_one_line(tmp_path, capsys):
    from nanwatch.cli import main

    db = tmp_path / "c.db"
    assert main(["serve", "--db", str(db), "--tls-cert", str(tmp_path / "none.pem"), "--tls-key",
                 str(tmp_path / "none.key")]) == 2
    assert "cannot load the TLS certificate" in capsys.readouterr().err
    assert not db.exists()  # refused before anything was opened
