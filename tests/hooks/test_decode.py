"""The decode of a step's host copy is a pure function: a hand-written site table and value list in, named
fields out. Every slot and row holds a value no other one holds, so a field read from the wrong place fails."""

from __future__ import annotations

import math

import torch

from nanwatch.hooks.measure.decode import Offender, decode_step
from nanwatch.hooks.measure.recorder import (
    GUARD_SKIPPED,
    NONFINITE_RANK,
    ForwardMeta,
    ParamBatch,
    SiteMeta,
    StepState,
)
from nanwatch.hooks.measure.slot_buffer import SlotBuffer

ATTN = ("model.layers.0.self_attn", "forward", "train")
HEAD = ("lm_head", "forward", "train")
EVAL = ("model.layers.1.mlp", "forward", "eval")
LAYER = "model.layers.0.self_attn"


def _step() -> tuple[StepState, list[float], SlotBuffer]:
    """Three sites (one eval-stage) in one observation buffer; max rows in two buffers: a layer's two heads
    from two calls, a forward's fully masked rows; one optimizer batch; slots for the guard, the reduction,
    a forward's count, an RLHF sum and a slot only a higher module knows."""
    fwd = ForwardMeta(0, position_ids="2d", mask="none", packed_checked=True, plain_causal=True)
    batch = ParamBatch(pos=3, phase="optimizer", owner="AdamW", names=["w", "b"], dtypes=["float32", "float32"],
                       numels=[6, 2], values=torch.zeros(2))
    state = StepState(
        order=[EVAL, ATTN, HEAD], layout=[("train", "buf0", 3)],
        # the eval-stage site is non-finite first: a training step's first offender is still the head
        rows=[(EVAL, "train", "buf0", 2), (ATTN, "train", "buf0", 0), (HEAD, "train", "buf0", 1)],
        sites={EVAL: SiteMeta("mlp", torch.float32, calls=1, numel=8),
               ATTN: SiteMeta("attention", torch.float16, calls=2, numel=10),
               HEAD: SiteMeta("logits", torch.bfloat16, calls=1, numel=12)},
        sdpa={(LAYER, "flash", "flash", True, "float16", "1x2x4x8", None, "train"): 3},
        logits={(LAYER, "lse"): ("lse", 2)}, forwards=[fwd], rlhf="k3", batches=[batch], flat_batches=1,
        max_layout=[("f32", 4), ("f64", 1)],
        maxes={("lse", LAYER, 2): [("f32", 2), ("f32", 0)], fwd.key("masked_rows"): [("f64", 0)]})
    buf = SlotBuffer("cpu")
    slots = {("max", GUARD_SKIPPED): 1.0, ("max", NONFINITE_RANK): -3.0, ("sum", fwd.key("resets")): 2.0,
             ("sum", ("rlhf", "tokens")): 11.0,
             ("max", ("scaler", "scale")): 1024.0}
    for kind, key in slots:
        buf.slot(kind, key)
    values = [-2.0, 3.0,  # row 0 (attention): finite
              math.nan, 1.0,  # row 1 (head): NaN
              -math.inf, 0.5,  # row 2 (the eval-stage site): Inf
              5.0, 1.0, 2.0, 7.0,  # the layer's heads, one call a row: the max is [5, 7]
              4.0,  # the forward's fully masked rows
              1.0, math.inf]  # the batch: "b" is Inf
    values += [slots[(kind, key)] for kind, key in _by_index(buf, slots)]
    state.slots = buf
    return state, values, buf


def _by_index(buf: SlotBuffer, slots: dict) -> list:
    return sorted(slots, key=lambda k: buf.index(*k))


def test_each_field_is_decoded_from_its_own_slot_and_row():
    state, values, _ = _step()
    stats = decode_step(state, values)
    by_name = {s.site: s for s in stats.sites}
    assert [s.site for s in stats.sites] == [EVAL[0], ATTN[0], HEAD[0], "b"]  # first-call order, then params
    attn = by_name[ATTN[0]]
    assert (attn.nan, attn.inf, attn.amax, attn.calls, attn.numel, attn.dtype) == (0, 0, 3.0, 2, 10, "float16")
    assert attn.headroom == 3.0 / torch.finfo(torch.float16).max
    assert (by_name[HEAD[0]].nan, by_name[HEAD[0]].inf, by_name[EVAL[0]].inf) == (1, 0, 1)
    param = by_name["b"]
    assert (param.kind, param.phase, param.inf, param.numel) == ("param", "optimizer", 1, 2)
    assert stats.first_offender == Offender(*HEAD) and stats.first_offender.site == HEAD[0]
    assert [s.bad for s in stats.batches] == [[(1, False)]]
    assert stats.step_skipped is True
    assert stats.nonfinite_rank == 3
    (sdpa,) = stats.sdpa
    assert (sdpa.site, sdpa.backend, sdpa.calls, sdpa.stage) == (LAYER, "flash", 3, "train")
    (logit,) = stats.logits
    assert (logit.layer, logit.source, logit.bound, logit.per_head) == (LAYER, "lse", 7.0, [5.0, 7.0])
    (fp,) = stats.fingerprints
    assert (fp.packed, fp.fully_masked_rows, fp.cross_doc_leak, fp.mask) == (True, 4, True, "none")
    assert stats.rlhf_slots == {("sum", "tokens"): 11.0}
    assert stats.rlhf is not None and stats.rlhf.kl_optimised == "k3"
    assert stats.slot("max", ("scaler", "scale"), -1.0) == 1024.0


def test_a_max_figure_is_the_max_of_its_rows_and_a_nan_row_wins():
    state, values, _ = _step()
    values[7] = math.nan  # the second head of the second call's row
    (logit,) = decode_step(state, values).logits
    assert logit.per_head[0] == 5.0 and math.isnan(logit.per_head[1])
    state.maxes.pop(("lse", LAYER, 2))  # no call wrote the figure: unset, as an unwritten slot read
    (logit,) = decode_step(state, values).logits
    assert logit.per_head == [-math.inf, -math.inf]


def test_a_slot_missing_from_the_copy_reads_as_its_default():
    state, values, buf = _step()
    buf.slot("max", ("late", "slot"))  # allocated after the copy was taken
    stats = decode_step(state, values)
    assert stats.slot("max", ("late", "slot"), -1.0) == -1.0
    assert stats.slot("sum", ("never", "written")) == 0.0
    quiet = decode_step(StepState(), [])
    assert (quiet.step_skipped, quiet.nonfinite_rank, quiet.first_offender, quiet.rlhf) == (None, None, None, None)


def test_an_eval_step_names_its_own_first_offender():
    state, values, _ = _step()
    state.stage = "eval"
    assert decode_step(state, values).first_offender == Offender(*EVAL)


def test_a_batch_recorded_before_a_row_is_the_first_offender():
    state, values, _ = _step()
    state.batches[0].pos = 1  # read between the attention row and the head's
    assert decode_step(state, values).first_offender == Offender("b", "optimizer", "train")
