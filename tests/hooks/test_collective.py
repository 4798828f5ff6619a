"""The guard's reduction and the collective-forward check, in one process (the two-rank behaviour is in
test_dist_guard.py): the reduction's encoding of the lowest faulting rank, the report field it becomes,
the rerun declining under a forward that issues collectives, and a reduction that fails becoming a
warning while the rank's own flag still protects its weights."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from support import TinyNet, free_port, token_ids

import nanwatch
from nanwatch.hooks.config import WeightsConfig
from nanwatch.hooks.forensics.rerun import rerun
from nanwatch.hooks.measure import recorder as recorder_module
from nanwatch.hooks.measure.collective import FlagReduction, collective_forward, reduction_active
from nanwatch.hooks.measure.decode import decode_step
from nanwatch.hooks.measure.recorder import NONFINITE_RANK, Recorder


@pytest.fixture
def one_rank_group():
    """A real gloo process group of one rank, destroyed afterwards."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_the_reduction_carries_the_flag_and_the_lowest_faulting_rank(one_rank_group):
    red = FlagReduction()
    flag, lowest = red.reduce(torch.tensor(1.0))
    assert (float(flag), float(lowest)) == (1.0, 0.0)  # -r for rank r = 0
    flag, lowest = red.reduce(torch.tensor(0.0))
    assert float(flag) == 0.0 and float(lowest) == float("-inf")  # no rank
    assert not reduction_active()  # one rank: the guard issues nothing


def test_the_lowest_faulting_rank_is_decoded_from_the_buffer():
    rec = Recorder("cpu")
    for code in (-3.0, -1.0, -2.0):  # three optimizer steps in one nanwatch step: the lowest rank wins
        rec.slot(NONFINITE_RANK, torch.tensor(code), how="max")
    values = rec.flat().tolist()
    assert decode_step(rec.swap(), values).nonfinite_rank == 1
    values = rec.flat().tolist()
    assert decode_step(rec.swap(), values).nonfinite_rank is None  # nothing reduced this step


def test_forwards_that_issue_collectives_are_named():
    assert collective_forward(TinyNet()) is None
    assert "SyncBatchNorm" in collective_forward(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.SyncBatchNorm(4)))
    fsdp2 = type("FSDPModule", (), {})  # fully_shard makes a module's class a subclass of FSDPModule
    sharded = type("FSDPTinyNet", (TinyNet, fsdp2), {})()
    assert "fully_shard" in collective_forward(torch.nn.Sequential(sharded))


def test_the_rerun_declines_under_such_a_forward_and_says_why():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.SyncBatchNorm(4))
    inc = rerun(model=model, probes=None, directive_state=None, kept=[object()], step=3, site="0",
                phase="forward", masked_rows=0, weight_guard_on=True, compiled=False, rank=1)
    assert inc.cls == "not_classified" and "SyncBatchNorm" in inc.note and "hang" in inc.note


def test_process_group_must_be_a_process_group():
    with pytest.raises(ValueError, match="process_group"):
        WeightsConfig(process_group="dp")


def test_a_failed_reduction_is_a_warning_and_the_rank_still_skips_on_its_own_flag(monkeypatch):
    def broken(self, flag):
        raise RuntimeError("gloo: connection closed")

    monkeypatch.setattr(recorder_module, "reduction_active", lambda group=None: True)
    monkeypatch.setattr(FlagReduction, "reduce", broken)
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    ids = token_ids(2, 8, vocab=64)
    with warnings.catch_warnings(record=True) as caught, nanwatch.attach(model, run_id="r", optimizer=opt) as mon:
        warnings.simplefilter("always")
        with mon.step(0):
            model.blocks[0].out.weight.data[0, 0] = float("nan")
            model(ids).sum().backward()
            before = model.head.weight.detach().clone()
            opt.step()
        r = mon.last_report()
    assert r.step_skipped and r.nonfinite_rank is None
    assert torch.equal(model.head.weight, before)
    assert any("connection closed" in str(w.message) for w in caught)
