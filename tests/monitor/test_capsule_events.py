"""Where the on-call sees an incident's capsule (issue #20, wire 1.7 ``Incident.capsule``), on a real collector
(``BackgroundServer``): the incident event and ``GET /v1/runs/{id}`` carry it, ``nanwatch status`` shows it
with the replay to run, the dashboard's info series holds it; and the silent-data-corruption signal: the
per-host count of not-reproducible incidents, across runs, born at zero, kept over a restart, its host label
bounded and cleaned."""

from __future__ import annotations

import httpx
import pytest
from support import AUTH, background_collector, post_reports, run_view, sample, scrape, step_report

from nanwatch.cli import main
from nanwatch.wire import Incident, ReportBatch

NOT_REPRO = "nanwatch_not_reproducible_incidents_total"
INFO = "nanwatch_latest_incident_info"


def _incident(run_id: str, seq: int, cls: str, host: str, capsule: str | None = None, *, rank: int = 0):
    """A report of step ``seq`` on ``rank`` carrying an incident of class ``cls`` seen on ``host``."""
    inc = Incident(cls=cls, step=seq, site="model.layers.0.self_attn", phase="forward", host=host, capsule=capsule,
                   birth="model.layers.0.self_attn", birth_kind="attention", birth_elements=12)
    return step_report(run_id=run_id, rank=rank, seq=seq, step=seq, dtype="float16", nan_at="model.layers.0.self_attn",
                       nan=3).model_copy(update={"incident": inc})


def _by_host(scraped: dict) -> dict[str, float]:
    """``sum by (host)`` of the not-reproducible counter, as the alert reads it."""
    out: dict[str, float] = {}
    for (name, labels), v in scraped.items():
        if name == NOT_REPRO:
            host = dict(labels)["host"]
            out[host] = out.get(host, 0) + v
    return out


def test_the_capsule_is_in_the_event_the_run_view_the_status_and_the_dashboard_series(tmp_path, capsys):
    capsule = "/data/capsules/qk run/step7.rank3.nwcap"
    with background_collector(tmp_path) as srv:
        post_reports(srv.url, _incident("cap", 7, "precision", "gpu-node-12 rank 3", capsule, rank=3))
        events = [e for e in run_view(srv.url, "cap")["events"] if e["kind"] == "incident"]
        assert len(events) == 1 and events[0]["detail"]["capsule"] == capsule, events
        assert events[0]["detail"]["host"] == "gpu-node-12 rank 3"
        s = scrape(srv.url)
        assert sample(s, INFO, run_id="cap", **{"class": "precision"}, host="gpu-node-12", rank="3",
                      capsule=capsule) == 1
        assert sample(s, NOT_REPRO, run_id="cap", namespace="*", host="gpu-node-12") is None  # a precision incident is no SDC sign
        assert main(["status", "cap", "--url", srv.url]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("  incident at step 7"))
    assert f"capsule {capsule}" in line, out
    # the path has a space: the command is quoted so that it can be pasted as it is
    assert f"nanwatch replay '{capsule}' --try same,fp32,math" in line, out


def test_an_incident_without_a_capsule_says_none_and_still_shows_its_class(tmp_path, capsys):
    with background_collector(tmp_path) as srv:
        post_reports(srv.url, _incident("bare", 2, "data_mask", "h1 rank 0"))
        assert sample(scrape(srv.url), INFO, run_id="bare", **{"class": "data_mask"}, host="h1", rank="0",
                      capsule="") == 1
        assert main(["status", "bare", "--url", srv.url]) == 0
    out = capsys.readouterr().out
    assert "class data_mask" in out and "nanwatch replay" not in out, out


def test_not_reproducible_incidents_are_counted_per_host_across_runs_born_at_zero(tmp_path):
    with background_collector(tmp_path) as srv:
        post_reports(srv.url, _incident("a", 1, "not_reproducible", "GPU-7 rank 3", "/c/a1", rank=3),
                     _incident("a", 2, "precision", "gpu-7 rank 3", "/c/a2", rank=3),
                     _incident("a", 3, "data_mask", "gpu-7 rank 3", rank=3),
                     _incident("a", 4, "not_classified", "gpu-8 rank 0", rank=0))
        first = scrape(srv.url, settled=False)  # born at zero: increase() sees the first one
        assert sample(first, NOT_REPRO, run_id="a", namespace="*", host="gpu-7") == 0
        assert _by_host(scrape(srv.url, settled=False)) == {"gpu-7": 1}  # no other class counts
        post_reports(srv.url, _incident("b", 5, "not_reproducible", "gpu-7 rank 1", "/c/b5", rank=1),
                     _incident("b", 6, "not_reproducible", "gpu-8 rank 0", "/c/b6", rank=0))
        s = scrape(srv.url)
        assert _by_host(s) == {"gpu-7": 2, "gpu-8": 1}
        assert sample(s, NOT_REPRO, run_id="b", namespace="*", host="gpu-7") == 1
        # the latest not-reproducible incident of run b is gpu-8's: one series per run and class
        infos = [dict(lab) for name, lab in s if name == INFO and dict(lab)["run_id"] == "b"]
        assert infos == [{"run_id": "b", "class": "not_reproducible", "host": "gpu-8", "rank": "0", "capsule": "/c/b6"}]
    with background_collector(tmp_path) as srv:  # the same store: the counts are kept over a restart
        post_reports(srv.url, step_report(run_id="a", seq=9), step_report(run_id="b", seq=9))
        assert _by_host(scrape(srv.url)) == {"gpu-7": 2, "gpu-8": 1}


def test_a_replayed_report_counts_its_incident_once(tmp_path):
    with background_collector(tmp_path) as srv:
        r = _incident("once", 1, "not_reproducible", "gpu-3 rank 0", "/c/x")
        post_reports(srv.url, r)
        assert post_reports(srv.url, r)["duplicates"] == 1
        assert _by_host(scrape(srv.url)) == {"gpu-3": 1}


@pytest.mark.parametrize(("host", "label"), [
    ("gpu\u202e7\x1b[2J rank 0", "gpu_7__2j"),  # a bidi override and an escape sequence: cleaned
    ("node-1.cluster.example rank 12", "node-1.cluster.example"),
    ("rank 4", "rank_4"),  # no hostname before " rank "
    (" \u200b rank 0", "_"),  # a zero-width space alone
    ("", "unknown"),
    ("h" * 255, "h" * 253),  # the wire's 255 characters, cut to a DNS name's longest
])
def test_the_host_label_is_bounded_and_safe(tmp_path, host, label):
    with background_collector(tmp_path) as srv:
        post_reports(srv.url, _incident("h", 1, "not_reproducible", host, "/c/\u202ex"))
        s = scrape(srv.url)
        assert _by_host(s) == {label: 1}
        infos = [dict(lab) for name, lab in s if name == INFO]
        assert infos[0]["host"] == label and infos[0]["capsule"] == "/c/\\u202ex", infos  # escaped, not shown raw
        # the raw host stays in the event (JSON-escaped by the API), never in a label
        events = [e for e in run_view(srv.url, "h")["events"] if e["kind"] == "incident"]
        assert events[0]["detail"]["host"] == host


def test_a_capsule_path_with_a_control_character_is_refused_by_the_wire(tmp_path):
    with background_collector(tmp_path) as srv:
        good = _incident("ctl", 1, "precision", "h rank 0", "/c/ok").model_dump(mode="json")
        good["incident"]["capsule"] = "/c/\x1b[2Jevil"
        body = ReportBatch.model_construct(reports=[]).model_dump(mode="json") | {"reports": [good]}
        resp = httpx.post(f"{srv.url}/v1/reports", json=body, headers=AUTH)
        assert resp.status_code == 422, resp.text
        assert httpx.get(f"{srv.url}/v1/runs/ctl", headers=AUTH).status_code == 404


def test_status_from_a_local_record_shows_the_same_capsule_line_as_the_collector(tmp_path, capsys):
    """The trainer's JSONL record (``nanwatch status --file``) and the collector say the same words."""
    r = _incident("both", 4, "not_reproducible", "gpu-5 rank 2", "s3://bucket/caps/both-4.nwcap", rank=2)
    r = r.model_copy(update={"incident": r.incident.model_copy(update={"device": "cuda"})})
    (tmp_path / "both.rank2.a.jsonl").write_text(r.model_dump_json() + "\n")
    assert main(["status", "both", "--file", str(tmp_path / "both.rank2.a.jsonl")]) == 0
    with background_collector(tmp_path) as srv:
        post_reports(srv.url, r)
        assert main(["status", "both", "--url", srv.url]) == 0
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("  incident at step 4")]
    assert len(lines) == 2 and lines[0] == lines[1], lines
    assert ("capsule s3://bucket/caps/both-4.nwcap: replay with `nanwatch replay s3://bucket/caps/both-4.nwcap "
            "--device cuda --try same` on this host and on another") in lines[0]


def test_an_incident_decided_a_step_later_keeps_its_own_step(tmp_path, capsys):
    """On a GPU the rerun decides the faulting step at the next step start (#35): step 8's report carries
    step 7's incident. The event, the run view and ``nanwatch status`` say step 7."""
    late = _incident("late", 8, "precision", "h1 rank 0")
    late = late.model_copy(update={"incident": late.incident.model_copy(update={"step": 7})})
    with background_collector(tmp_path) as srv:
        post_reports(srv.url, late)
        events = [e for e in run_view(srv.url, "late")["events"] if e["kind"] == "incident"]
        assert [e["step"] for e in events] == [7], events
        assert main(["status", "late", "--url", srv.url]) == 0
    out = capsys.readouterr().out
    assert any(x.startswith("  incident at step 7 on rank 0: class precision") for x in out.splitlines()), out
