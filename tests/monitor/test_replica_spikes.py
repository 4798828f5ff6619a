"""What the collector does with issue #29's reports (wire 1.9), on a real collector (``BackgroundServer``):
a ``replica_divergence`` incident (replicas that silently stopped agreeing) is folded as the other classes
(the incidents-by-class counter, once per step; the per-host view the not-reproducible incidents feed, one
count per host named; the event log; the info series), never turned into a directive, and shown by ``GET
/v1/runs/{id}`` and ``nanwatch status``; spikes (a site k x over its running baseline, finite) count in
``nanwatch_spikes_total{run_id, site_kind}`` once per step and kind, from run-level reports only, born at zero,
are logged bounded (the first per site and pass, at most ``MAX_SPIKE_EVENTS``) and shown by ``nanwatch status``
from the collector and from a local record alike."""

from __future__ import annotations

from support import background_collector, post_reports, run_view, sample, scrape, step_report

from nanwatch.cli import main
from nanwatch.monitor.write.directive_rules import MAX_SPIKE_EVENTS
from nanwatch.wire import Incident, Spike, StepReport

INCIDENTS = "nanwatch_incidents_total"
HOSTS = "nanwatch_not_reproducible_incidents_total"
INFO = "nanwatch_latest_incident_info"
SPIKES = "nanwatch_spikes_total"
PARAM = "model.layers.1.mlp.down_proj.weight"


def _divergence(run_id: str, seq: int, *, rank: int = 0, world: int = 3, ranks=(1,), hosts=("gpu-9 rank 1",),
                repaired: bool | None = True, half_nan: bool = False) -> StepReport:
    """Rank ``rank``'s report of step ``seq`` carrying the replica check's verdict: ``ranks`` on ``hosts``
    disagree with the majority. ``half_nan``: the step also saw a NaN in a float16 attention site, which
    alone would get a precision directive."""
    inc = Incident(cls="replica_divergence", step=seq, host=f"gpu-0 rank {rank}", ranks=list(ranks),
                   hosts=list(hosts), params=[PARAM, f"{PARAM}:exp_avg"], repaired=repaired,
                   note="weights differ across data-parallel replicas")
    r = step_report(run_id=run_id, rank=rank, world_size=world, seq=seq, step=seq, dtype="float16",
                    nan_at="model.layers.0.self_attn" if half_nan else None, nan=2 if half_nan else 0)
    return r.model_copy(update={"incident": inc})


def _spiky(run_id: str, seq: int, *, rank: int = 0, world: int = 1, scope: str = "rank",
           spikes: list[Spike] | None = None) -> StepReport:
    """Rank ``rank``'s report of step ``seq`` with spikes: an MLP's output ×50 and its gradient ×12."""
    found = spikes if spikes is not None else [
        Spike(site="model.layers.0.mlp", phase="forward", kind="mlp", value=175.0, baseline=3.5, factor=50.0),
        Spike(site="model.layers.0.mlp", phase="backward", kind="mlp", value=0.12, baseline=0.01, factor=12.0)]
    r = step_report(run_id=run_id, rank=rank, world_size=world, seq=seq, step=seq)
    return r.model_copy(update={"spikes": found, "scope": scope})


def _events(url: str, run_id: str, kind: str) -> list[dict]:
    return [e for e in run_view(url, run_id)["events"] if e["kind"] == kind]


def test_a_replica_divergence_is_counted_once_per_step_per_host_named_and_logged(tmp_path):
    with background_collector(tmp_path) as srv:
        # every rank of the job learnt the verdict from the same collective: each may report it
        post_reports(srv.url, *(_divergence("dp", 5, rank=k, ranks=(1, 2), hosts=("GPU-9 rank 1", "gpu-4 rank 2"))
                                for k in range(3)))
        first = scrape(srv.url, settled=False)  # born at zero: the page's increase() sees the first one
        assert sample(first, INCIDENTS, run_id="dp", **{"class": "replica_divergence"}) == 0
        assert sample(first, HOSTS, run_id="dp", namespace="*", host="gpu-9") == 0
        s = scrape(srv.url)
        assert sample(s, INCIDENTS, run_id="dp", **{"class": "replica_divergence"}) == 1
        assert sample(s, HOSTS, run_id="dp", namespace="*", host="gpu-9") == 1
        assert sample(s, HOSTS, run_id="dp", namespace="*", host="gpu-4") == 1
        assert sample(s, HOSTS, run_id="dp", namespace="*", host="gpu-0") is None  # the poster's host is no suspect
        assert sample(s, INFO, run_id="dp", **{"class": "replica_divergence"}, host="gpu-9,gpu-4", rank="1,2",
                      capsule="") == 1
        events = _events(srv.url, "dp", "incident")
        assert len(events) == 1, events
        d = events[0]["detail"]
        assert (d["cls"], d["ranks"], d["hosts"], d["params"][0], d["repaired"]) == (
            "replica_divergence", [1, 2], ["GPU-9 rank 1", "gpu-4 rank 2"], PARAM, True), d
        assert events[0]["site"] == PARAM
        # the next check's divergence is another incident
        post_reports(srv.url, _divergence("dp", 9, ranks=(1,), hosts=("gpu-9 rank 1",), repaired=False))
        s = scrape(srv.url)
        assert sample(s, INCIDENTS, run_id="dp", **{"class": "replica_divergence"}) == 2
        assert sample(s, HOSTS, run_id="dp", namespace="*", host="gpu-9") == 2
    with background_collector(tmp_path) as srv:  # kept over a restart
        post_reports(srv.url, step_report(run_id="dp", seq=10))
        assert sample(scrape(srv.url), HOSTS, run_id="dp", namespace="*", host="gpu-9") == 2


def test_a_replica_divergence_never_gets_a_precision_directive(tmp_path):
    with background_collector(tmp_path) as srv:
        # control: the same half-precision attention NaN without the verdict gets the fp32 fallback
        post_reports(srv.url, step_report(run_id="nan", seq=3, dtype="float16", nan_at="model.layers.0.self_attn",
                                          nan=2))
        assert run_view(srv.url, "nan")["directive"]["mode"] == "fp32"
        post_reports(srv.url, _divergence("sdc", 3, half_nan=True))
        view = run_view(srv.url, "sdc")
        assert view["directive"]["mode"] == "none", view["directive"]
        assert _events(srv.url, "sdc", "directive_set") == []


def test_status_shows_the_divergence_ranks_hosts_parameters_and_repair_from_the_collector_and_a_file(
        tmp_path, capsys):
    r = _divergence("st", 7, rank=0, ranks=(1,), hosts=("gpu-9 rank 1",), repaired=None)
    (tmp_path / "st.rank0.a.jsonl").write_text(r.model_dump_json() + "\n")
    assert main(["status", "st", "--file", str(tmp_path / "st.rank0.a.jsonl")]) == 0
    with background_collector(tmp_path) as srv:
        post_reports(srv.url, r)
        assert main(["status", "st", "--url", srv.url]) == 0
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("  incident at step 7")]
    assert len(lines) == 2 and lines[0] == lines[1], lines
    assert ("class replica_divergence; rank 1 on gpu-9 rank 1 disagree with their replicas (the replicas now "
            f"train different models); first differing {PARAM}, {PARAM}:exp_avg; repair off") in lines[0], lines


def test_spikes_count_once_per_step_and_kind_from_run_level_reports_born_at_zero(tmp_path):
    with background_collector(tmp_path) as srv:
        # two ranks report the same step's spikes (per-rank mode): one spike step per kind
        post_reports(srv.url, _spiky("sp", 4, rank=0, world=2), _spiky("sp", 4, rank=1, world=2))
        first = scrape(srv.url, settled=False)
        assert sample(first, SPIKES, run_id="sp", site_kind="mlp") == 0
        assert sample(first, SPIKES, run_id="sp", site_kind="grad") == 0
        s = scrape(srv.url)
        assert sample(s, SPIKES, run_id="sp", site_kind="mlp") == 1
        assert sample(s, SPIKES, run_id="sp", site_kind="grad") == 1  # a backward site counts as grad
        r = _spiky("sp", 5, rank=0, world=2)
        post_reports(srv.url, r)
        assert post_reports(srv.url, r)["duplicates"] == 1  # a resend counts nothing
        assert sample(scrape(srv.url), SPIKES, run_id="sp", site_kind="mlp") == 2
        # job mode: the job report counts, the detail report of the same step does not
        post_reports(srv.url, _spiky("job", 8, rank=0, world=2, scope="job"))
        post_reports(srv.url, _spiky("job", 8, rank=1, world=2, scope="detail"),
                     _spiky("job", 9, rank=1, world=2, scope="detail"))
        s = scrape(srv.url)
        assert sample(s, SPIKES, run_id="job", site_kind="mlp") == 1
        # no spike: no series; and a spike is no incident, no directive
        assert sample(s, INCIDENTS, run_id="sp", **{"class": "replica_divergence"}) is None
        assert run_view(srv.url, "sp")["directive"]["mode"] == "none"
        view = run_view(srv.url, "sp")
        assert view["spikes_total"] == {"mlp": 2, "grad": 2}, view["spikes_total"]
        assert [(x["step"], x["site"], x["phase"], x["factor"]) for x in view["latest_spikes"]] == [
            (5, "model.layers.0.mlp", "forward", 50.0), (5, "model.layers.0.mlp", "backward", 12.0)]


def test_spike_events_keep_the_first_per_site_and_pass_and_are_bounded(tmp_path):
    with background_collector(tmp_path) as srv:
        post_reports(srv.url, _spiky("ev", 1), _spiky("ev", 2))
        events = _events(srv.url, "ev", "spike")
        assert [(e["site"], e["step"], e["detail"]["phase"], e["detail"]["factor"]) for e in events] == [
            ("model.layers.0.mlp", 1, "forward", 50.0), ("model.layers.0.mlp", 1, "backward", 12.0)], events
        # a spiky run with many sites: at most MAX_SPIKE_EVENTS spike events, every spike step still counted
        for seq in range(3, 10):
            post_reports(srv.url, _spiky("ev", seq, spikes=[
                Spike(site=f"model.layers.{seq}.h{i}", phase="forward", kind="block", value=50.0, baseline=1.0,
                      factor=50.0) for i in range(20)]))
        view = run_view(srv.url, "ev")
        assert view["event_counts"]["spike"] == MAX_SPIKE_EVENTS, view["event_counts"]
        assert view["spikes_total"]["block"] == 7
        assert sample(scrape(srv.url), "nanwatch_events_total", run_id="ev", kind="spike") == MAX_SPIKE_EVENTS


def test_status_shows_the_latest_spikes_from_the_collector_and_a_file(tmp_path, capsys):
    reports = [_spiky("ss", 3), _spiky("ss", 6)]
    (tmp_path / "ss.rank0.a.jsonl").write_text("".join(r.model_dump_json() + "\n" for r in reports))
    assert main(["status", "ss", "--file", str(tmp_path / "ss.rank0.a.jsonl")]) == 0
    with background_collector(tmp_path) as srv:
        post_reports(srv.url, *reports)
        assert main(["status", "ss", "--url", srv.url]) == 0
    out = capsys.readouterr().out.splitlines()
    for head in ("  spike steps", "  latest spikes"):
        lines = [x for x in out if x.startswith(head)]
        assert len(lines) == 2 and lines[0] == lines[1], (head, out)
    assert "  spike steps (a site over k x its baseline, finite): grad 2, mlp 2" in out, out
    assert ("  latest spikes at step 6 on rank 0: spike at model.layers.0.mlp (forward): 50x its baseline (value "
            "175, baseline 3.5); spike at model.layers.0.mlp (backward): 12x its baseline (value 0.12, baseline "
            "0.01)") in out, out

