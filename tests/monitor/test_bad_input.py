"""Bad input gets a 4xx that names the problem, never a 5xx, and leaves other runs' state alone."""

import contextlib
import json
import socket
import time

import httpx
import pytest
from support import ADMIN, TOKEN, scrape, step_report

from nanwatch.wire import ReportBatch

AUTH = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}


def _good(**kw) -> dict:
    return json.loads(step_report(run_id="victim", seq=kw.pop("seq", 0), layers=1).model_dump_json()) | kw


def _batch(*reports) -> bytes:
    return json.dumps({"reports": list(reports)}).encode()


CASES = {
    "malformed JSON": (b'{"reports": [', 400, "not valid JSON"),
    "not an object": (b"[1, 2]", 422, "model_type"),
    "wrong type": (_batch(_good(step="five")), 422, "step"),
    "bool for a count": (_batch(_good(dropped_reports=False)), 422, "dropped_reports"),
    "missing run_id": (_batch({k: v for k, v in _good().items() if k != "run_id"}), 422, "run_id"),
    "negative step": (_batch(_good(step=-1)), 422, "step"),
    "step too large to store": (_batch(_good(step=2**70)), 422, "step"),
    "too many reports": (_batch(*[_good(seq=i, sites=[], sdpa=[], logits=[]) for i in range(257)]), 422, "reports"),
    "too many warnings": (_batch(_good(warnings=["w"] * 65)), 422, "warnings"),
    "unknown schema version": (_batch(_good(v="2.0")), 400, "'2.0'"),
    "unknown field": (_batch(_good(surprise=1)), 422, "surprise"),
    "newline in run_id": (_batch(_good(run_id="vic\ntim")), 422, "run_id"),
    "quote in run_id": (_batch(_good(run_id='vic"tim')), 422, "run_id"),
    "10 kB site name": (_batch(_good(sites=[{**_good()["sites"][0], "site": "x" * 10_000}])), 422, "site"),
    "newline in site name": (_batch(_good(sites=[{**_good()["sites"][0], "site": "a\nb"}])), 422, "site"),
    "empty batch": (_batch(), 422, "reports"),
}


@pytest.fixture(scope="module")
def bystander(collector):
    """Another run with known state: no bad request may change it."""
    body = ReportBatch(reports=[step_report(run_id="bystander", rank=r, seq=0, nan_at="model.layers.0.self_attn",
                                            nan=5) for r in range(2)]).model_dump_json()
    assert httpx.post(f"{collector.url}/v1/reports", content=body, headers=AUTH).status_code == 200
    return lambda: {k: v for k, v in scrape(collector.url).items() if ("run_id", "bystander") in k[1]
                    and k[0] != "nanwatch_last_report_timestamp_seconds"}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_report_is_refused_by_name(collector, bystander, case):
    body, status, needle = CASES[case]
    before = bystander()
    resp = httpx.post(f"{collector.url}/v1/reports", content=body, headers=AUTH)
    assert resp.status_code == status, resp.text
    assert needle in resp.text
    assert bystander() == before
    assert httpx.get(f"{collector.url}/v1/runs/victim", headers=AUTH).status_code == 404


@pytest.mark.parametrize("chunked", [False, True])
def test_oversized_body_gets_413_naming_the_limit(collector, bystander, chunked):
    before = bystander()
    body = _batch(*[_good(seq=i) for i in range(250)]) + b" " * (300 * 1024)
    content = (body[i:i + 65536] for i in range(0, len(body), 65536)) if chunked else body
    resp = httpx.post(f"{collector.url}/v1/reports", content=content, headers=AUTH)
    assert resp.status_code == 413
    assert "262144-byte limit" in resp.json()["detail"]
    assert bystander() == before


@pytest.mark.parametrize("method,path,token,status", [
    ("POST", "/v1/reports", None, 401), ("POST", "/v1/reports", "wrong", 401),
    ("POST", "/v1/reports", ADMIN, 403), ("PUT", "/v1/directives/bystander", TOKEN, 403),
    ("PUT", "/v1/directives/bystander", None, 401), ("DELETE", "/v1/directives/bystander", "wrong", 401),
    ("GET", "/v1/directives/bystander", None, 401), ("GET", "/v1/runs", "wrong", 401),
])
def test_wrong_or_missing_token_is_refused(collector, bystander, method, path, token, status):
    before = bystander()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    body = ReportBatch(reports=[step_report(run_id="bystander", seq=99)]).model_dump_json() \
        if method == "POST" else json.dumps({"mode": "fp32"})
    resp = httpx.request(method, f"{collector.url}{path}", content=None if method in ("GET", "DELETE") else body,
                         headers=headers)
    assert resp.status_code == status, resp.text
    assert "token" in resp.json()["detail"] and resp.headers["WWW-Authenticate"] == "Bearer"
    assert bystander() == before


@pytest.mark.parametrize("body,needle", [({"mode": "turbo"}, "mode"), ({"mode": "fp32", "apply_at_step": "5"},
                                         "apply_at_step"), ({"mode": "fp32", "apply_at_step": -1}, "apply_at_step")])
def test_bad_directive_is_refused_by_name(collector, body, needle):
    resp = httpx.put(f"{collector.url}/v1/directives/bystander", json=body,
                     headers={"Authorization": f"Bearer {ADMIN}"})
    assert resp.status_code == 422 and needle in resp.text


@pytest.mark.parametrize("path", ["/v1/runs/bad%0Aid", "/v1/directives/" + "x" * 200, "/v1/directives/a?index=-1"])
def test_bad_path_or_query_is_refused(collector, path):
    resp = httpx.get(collector.url + path, headers=AUTH)
    assert resp.status_code == 422, resp.text


def _hold(collector, length: int, sent: bytes = b"") -> socket.socket:
    """A POST whose headers promise ``length`` body bytes, of which only ``sent`` are sent."""
    s = socket.create_connection(("127.0.0.1", collector.port))
    s.sendall(b"POST /v1/reports HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              b"Authorization: Bearer " + TOKEN.encode() + b"\r\nContent-Length: " + str(length).encode()
              + b"\r\n\r\n" + sent)
    return s


def test_slow_senders_take_no_slot_from_trainers(collector):
    """Fifty requests whose bodies never come do not shed a trainer's report (they were: issue #11.5)."""
    held = [_hold(collector, 100, b"{") for _ in range(50)]
    try:
        time.sleep(0.3)
        resp = httpx.post(f"{collector.url}/v1/reports", content=_batch(_good()), headers=AUTH)
        assert resp.status_code == 200, resp.text
    finally:
        for s in held:
            s.close()


def test_overload_sheds_by_bytes_with_503_and_retry_after(collector):
    """Bodies being received may hold 384 KiB in all here: a second large body on top of one held open is
    refused with 503 and Retry-After, and once the first goes, ingest works again."""
    first = _hold(collector, 260_000, b" " * 250_000)
    try:
        time.sleep(0.3)  # the server reads what was sent
        second = _hold(collector, 200_000, b" " * 200_000)
        second.settimeout(10)
        answer = b""
        with contextlib.suppress(ConnectionResetError):  # closed with the rest of our body unread
            while chunk := second.recv(65536):  # the collector closes the connection after answering
                answer += chunk
        second.close()
        assert answer.startswith(b"HTTP/1.1 503"), answer[:200]
        assert b"retry-after: 1" in answer.lower()  # (the body may be cut by the reset: counted below)
    finally:
        first.close()
    time.sleep(0.3)
    resp = httpx.post(f"{collector.url}/v1/reports", content=_batch(_good()), headers=AUTH)
    assert resp.status_code == 200, resp.text
    s = scrape(collector.url)
    assert s[("nanwatch_collector_requests_rejected_total", frozenset({("reason", "overloaded")}))] >= 1
