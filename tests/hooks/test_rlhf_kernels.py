"""``Monitor.rlhf()`` in a handful of device ops: its op count (a count, never a time), no host sync and no
host->device copy in a call, and the decoded figures equal to a straightforward reference.

The reference writes each figure's slot with its own reduction (the recording of old, ~160 kernels a call) into
a dict, and is decoded by the same ``decode_rlhf``: equal decodes mean equal figures, and equal non-finite key
sets mean the same slots were written (an argument never given writes none).
"""

from __future__ import annotations

import collections
import math
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import nanwatch
from nanwatch.hooks.measure.rlhf import RLHF_TENSORS, decode_rlhf
from nanwatch.hooks.rollout.compare import EDGES, OUTLIER_FACTOR, OUTLIER_FLOOR

#: ops that launch no device work: views, aliases, allocations (``empty`` allocates, it does not fill)
_FREE = {"detach", "alias", "empty", "empty_strided", "empty_like", "lift_fresh", "_reshape_alias", "view",
         "_unsafe_view", "unsqueeze", "squeeze", "expand", "slice", "select", "as_strided", "unbind", "t",
         "transpose", "permute", "reshape", "flatten", "split", "split_with_sizes", "narrow"}

#: the stated bounds: device ops of one ``rlhf()`` call of a 4x255 batch, the ``rlhf.logprobs`` site's read
#: (one ``aminmax``) included; before the rows, the same calls took 230, 242, 128 and 26
BOUNDS = {"all": 63, "all_k3_ratio": 67, "no_rollout": 32, "logprobs_mask": 18}


class _Ops(TorchDispatchMode):
    """Every ATen op dispatched, by name; ``kernels`` leaves out those that launch no device work."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()
        #: stacks of several dtypes: one copy per input on a GPU (CUDA's ``cat`` batches one dtype only)
        self.mixed: list[set[torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.ops[name if not func.is_view else "view"] += 1
        if name in ("cat", "stack") and len(dtypes := {t.dtype for t in args[0]}) > 1:
            self.mixed.append(dtypes)
        return func(*args, **(kwargs or {}))

    @property
    def kernels(self) -> int:
        return sum(n for name, n in self.ops.items() if name not in _FREE and name != "view")


@pytest.fixture
def mon():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # no attention in a Linear
        m = nanwatch.attach(torch.nn.Linear(2, 2), run_id="rlhf-kernels")
    yield m
    m.close()


def _batch(seed=0, b=4, t=33, *, rollout=True, poison=True):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(b, t, generator=g) * 3 - 0.01
    kw = dict(logprobs=lp, old_logprobs=lp + 0.2 * torch.randn(b, t, generator=g),
              ref_logprobs=lp + 0.4 * torch.randn(b, t, generator=g), advantages=torch.randn(b, t, generator=g),
              mask=torch.rand(b, t, generator=g) > 0.25)
    if rollout:
        ro = lp + 0.05 * torch.randn(b, t, generator=g)
        ro[1] -= 2.5  # an outlier sequence, truncated tokens
        kw["rollout_logprobs"] = ro
    if poison:  # NaN and ±inf inside and outside the mask, in every tensor
        m = kw["mask"]
        inside, outside = torch.nonzero(m), torch.nonzero(~m)
        for k, name in enumerate(n for n in RLHF_TENSORS if n in kw):
            t_ = kw[name] = kw[name].clone()
            t_[tuple(inside[k])] = (math.nan, math.inf, -math.inf)[k % 3]
            for j in (k, k + 5):  # two outside, one inside: the counts tell the padding from the mask
                t_[tuple(outside[j])] = (-math.inf, math.nan, math.inf)[(j + k) % 3]
    return kw


def _reference(calls, kl=None):
    """The slots each call writes, one reduction a figure, accumulated over ``calls`` as the step would."""
    slots: dict[tuple[str, tuple[str, str]], float] = {}

    def add(name, v):
        k = ("sum", ("rlhf", name))
        slots[k] = slots.get(k, 0.0) + float(v)

    def mx(name, v):
        k = ("max", ("rlhf", name))
        slots[k] = max(slots.get(k, -math.inf), float(v))

    def vmax(x, ok):
        return x[ok].max() if ok.any() else -math.inf

    for kw in calls:
        lp = kw["logprobs"].float()
        m = kw.get("mask")
        m = torch.ones_like(lp, dtype=torch.bool) if m is None else m.bool()
        adv = kw.get("advantages")
        if adv is not None and adv.dim() == 1 and kw.get("mask") is not None and m.dim() == 2 \
                and adv.shape[0] == m.shape[0]:
            adv = adv[:, None].expand_as(m)
        tensors = {"logprobs": lp, "ref_logprobs": kw.get("ref_logprobs"), "old_logprobs": kw.get("old_logprobs"),
                   "advantages": adv, "rollout_logprobs": kw.get("rollout_logprobs")}
        for name, t in tensors.items():
            if t is None:
                continue
            bad = ~torch.isfinite(t)
            if t.shape == m.shape:
                add(name, (bad & m).sum())
                add(name + "_pad", (bad & ~m).sum())
            else:
                add(name, bad.sum())
        ok = m & torch.isfinite(lp)
        add("tokens", m.sum())
        mx("neg_logprob_min", vmax(-lp, ok))
        ratio = None
        if kw.get("old_logprobs") is not None:
            ratio = torch.exp(lp - kw["old_logprobs"].float())
            rok = ok & torch.isfinite(ratio)
            add("ratio_n", rok.sum())
            add("clipped", (rok & ((ratio - 1).abs() > kw.get("clip_eps", 0.2))).sum())
            mx("ratio_max", vmax(ratio, rok))
        if kw.get("ref_logprobs") is not None:
            d = kw["ref_logprobs"].float() - lp
            k3 = torch.exp(d) - d - 1
            kok = ok & torch.isfinite(k3)
            add("kl_n", kok.sum())
            add("k1_sum", (-d)[kok].double().sum())
            add("k3_sum", k3[kok].double().sum())
            mx("k1_max", vmax(-d, kok))
            mx("k3_max", vmax(k3, kok))
            if kl == "k3_ratio":
                k3r = k3 if ratio is None else k3 * ratio
                rok = kok & torch.isfinite(k3r)
                add("k3r_n", rok.sum())
                add("k3r_sum", k3r[rok].double().sum())
        if adv is not None:
            a = adv.float()
            aok = torch.isfinite(a) & (m if a.shape == m.shape else True)
            add("adv_n", aok.sum())
            add("adv_sum", a[aok].double().sum())
            add("adv_sq", (a * a)[aok].double().sum())
        if kw.get("rollout_logprobs") is not None:
            _reference_rollout(add, mx, lp, kw["rollout_logprobs"].float(), m, kw.get("rollout_cap", 2.0))
    return slots


def _reference_rollout(add, mx, lp, r, m, cap):
    if lp.dim() < 2:
        lp, r, m = lp.reshape(1, -1), r.reshape(1, -1), m.reshape(1, -1)
    ok = m & torch.isfinite(lp) & torch.isfinite(r)
    x, y = torch.where(ok, lp, 0.0), torch.where(ok, r, 0.0)  # float32, as the moments always were
    px, py = torch.where(ok, x.exp(), 0.0), torch.where(ok, y.exp(), 0.0)
    d = (x - y).double()
    a = d.abs()
    add("ro_n", ok.sum())
    for name, v in (("d", d), ("abs", a), ("sq", d * d), ("k3", torch.expm1(d) - d), ("x", x), ("y", y),
                    ("xx", x * x), ("xy", x * y), ("px", px), ("py", py), ("pxx", px * px), ("pyy", py * py),
                    ("pxy", px * py)):
        add("ro_" + name, v[ok].double().sum())
    add("ro_trunc", (ok & (a > math.log(cap))).sum())
    seq_n = ok.sum(1)
    has = seq_n > 0
    seq_d = torch.where(ok, d, 0.0).sum(1)
    seq_abs = torch.where(ok, a, 0.0).sum(1) / seq_n.clamp(min=1)
    add("ro_seqs", has.sum())
    if has.any():
        typical = seq_abs[has].median()  # torch's median: the lower of the two middle values, as nanmedian
        add("ro_outliers", (has & (seq_abs > max(OUTLIER_FACTOR * float(typical), OUTLIER_FLOOR))).sum())
    else:
        add("ro_outliers", 0)
    for i, edge in enumerate((0.0, *EDGES)):
        hi = EDGES[i] if i < len(EDGES) else math.inf
        add(f"ro_h{i:02d}", (ok & (a >= edge) & (a < hi)).sum())
    mx("ro_abs_max", a[ok].max() if ok.any() else -math.inf)
    mx("ro_seq_max", seq_d[has].max() if has.any() else -math.inf)
    mx("ro_neg_seq_min", (-seq_d)[has].max() if has.any() else -math.inf)
    mx("ro_seq_abs_max", seq_abs[has].max() if has.any() else -math.inf)
    mx("ro_log_cap", math.log(cap))


def _assert_same(got, want):
    for field in type(want).model_fields:
        g, w = getattr(got, field), getattr(want, field)
        if field == "rollout":
            assert (g is None) == (w is None)
            if w is not None:
                _assert_same(g, w)
        elif isinstance(w, float) and isinstance(g, float):
            assert g == pytest.approx(w, rel=2e-6, abs=1e-9), field
        else:
            assert g == w, field


def _check(mon, calls, kl=None):
    with mon.step(0):
        for kw in calls:
            mon.rlhf(**kw, kl_optimised=kl)
    got = mon.last_report().rlhf
    slots = _reference(calls, kl)
    want = decode_rlhf(lambda kind, key, default=0.0: slots.get((kind, key), default), kl)
    _assert_same(got, want)
    return got


def test_every_argument_with_nonfinite_values_masked_and_padded(mon):
    got = _check(mon, [_batch()], kl="k3_ratio")
    assert got.nonfinite == {t + p: n for t in RLHF_TENSORS for p, n in (("", 1), ("_pad", 2))}
    assert got.rollout.outlier_sequences == 1 and got.rollout.truncated_fraction > 0


def _fresh(run_id="rlhf-kernels"):
    """A new monitor: slots, once written, stay in its buffer (a key seen once reads 0 in later steps)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # no attention in a Linear
        return nanwatch.attach(torch.nn.Linear(2, 2), run_id=run_id)


def test_per_sequence_advantages_with_a_mask_and_without_one(mon):
    kw = _batch(1, rollout=False, poison=False)
    kw["advantages"] = torch.tensor([0.5, -1.0, math.nan, 2.0])
    got = _check(mon, [kw])
    assert got.nonfinite["advantages"] == int(kw["mask"][2].sum())
    assert got.nonfinite["advantages_pad"] == int((~kw["mask"][2]).sum())  # spread over the padding too
    del kw["mask"]  # nothing to spread them over: counted and summed over their own four elements
    with _fresh() as other:
        got = _check(other, [kw])
    assert got.nonfinite["advantages"] == 1 and "advantages_pad" not in got.nonfinite


def test_an_empty_mask_and_only_logprobs(mon):
    kw = _batch(2)
    kw["mask"] = torch.zeros_like(kw["mask"])
    got = _check(mon, [kw])
    assert got.tokens == 0 and got.logprob_min is None and got.rollout.abs_max is None
    with _fresh() as other:
        got = _check(other, [{"logprobs": _batch(3)["logprobs"]}])
    assert got.ratio_max is None and got.rollout is None  # never given: never invented


def test_absent_arguments_leave_their_slots_unwritten():
    kw = _batch(4)
    with _fresh("absent") as m:
        got = _check(m, [{k: kw[k] for k in ("logprobs", "mask")}])
        assert set(got.nonfinite) == {"logprobs", "logprobs_pad"}
        got = _check(m, [{k: kw[k] for k in ("logprobs", "mask", "old_logprobs")}])  # the next step adds one
        assert set(got.nonfinite) == {"logprobs", "logprobs_pad", "old_logprobs", "old_logprobs_pad"}


def test_several_calls_accumulate_as_one_step(mon):
    a, b = _batch(5, t=20), _batch(6, t=47)
    b["advantages"] = b["advantages"][:, 0].contiguous()
    c = {k: v for k, v in _batch(7).items() if k in ("logprobs", "mask", "ref_logprobs")}
    _check(mon, [a, b, c], kl="k3_ratio")


def test_bf16_inputs_and_flat_logprobs(mon):
    kw = _batch(8)
    kw16 = {k: (v.bfloat16() if v.is_floating_point() else v) for k, v in kw.items()}
    _check(mon, [kw16])
    flat = {k: v.reshape(-1) for k, v in _batch(9).items()}
    _check(mon, [flat])


def _count(mon, kw):
    """The ops of one call after a first (which may allocate slots and build the slot index)."""
    with mon.step(0):
        mon.rlhf(**kw)
        # new tensors, as each step's: the site reads them again (it skips a tensor read twice, unchanged)
        fresh = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
        ops = _Ops()
        with ops:
            mon.rlhf(**fresh)
    return ops


@pytest.mark.parametrize("arguments", list(BOUNDS))
def test_one_call_is_a_bounded_number_of_kernels_with_no_sync_and_no_copy(mon, arguments):
    kw = _batch(10, b=4, t=255)
    kw["advantages"] = kw["advantages"][:, 0].contiguous()  # GRPO's, per sequence
    bound = BOUNDS[arguments]
    if arguments == "all_k3_ratio":
        kw["kl_optimised"] = "k3_ratio"
    elif arguments == "no_rollout":
        del kw["rollout_logprobs"]
    elif arguments == "logprobs_mask":
        kw = {k: kw[k] for k in ("logprobs", "mask")}
    ops = _count(mon, kw)
    assert ops.kernels <= bound, dict(ops.ops)
    assert ops.kernels >= 5, dict(ops.ops)  # it did measure
    assert ops.mixed == []  # each stack one dtype, so one kernel on a GPU too
    # no host read (``.item()``) and no tensor made from host values in the call (``torch.tensor``)
    assert not {"_local_scalar_dense", "lift_fresh", "lift_fresh_copy", "item"} & set(ops.ops), dict(ops.ops)
    # the reductions: one stacked sum and one stacked amax for the call, and with the rollout one more of each
    # (the sums by sequence added up; the sequences' maxima)
    n = 2 if "rollout_logprobs" in kw else 1
    assert ops.ops["amax"] == n and ops.ops["sum"] == n, dict(ops.ops)
    assert ops.ops["index_add_"] == (2 if "rollout_logprobs" in kw else 1), dict(ops.ops)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_no_host_device_copy_and_no_sync_on_a_gpu():
    kw = {k: v.cuda() for k, v in _batch(11).items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with nanwatch.attach(torch.nn.Linear(2, 2).cuda(), run_id="gpu-rlhf") as m, m.step(0):
            m.rlhf(**kw)  # the first call builds the slot index (its one host->device copy)
            copies = []

            class _Copies(TorchDispatchMode):
                def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                    out = func(*args, **(kwargs or {}))
                    ins = [a for a in args if isinstance(a, torch.Tensor)]
                    if func.overloadpacket.__name__ in ("_to_copy", "copy_") and any(a.device.type == "cpu" and a.dim() for a in ins):
                        copies.append(str(func))
                    return out

            torch.cuda.set_sync_debug_mode("error")
            try:
                with _Copies():
                    m.rlhf(**{k: v.clone() for k, v in kw.items()})
            finally:
                torch.cuda.set_sync_debug_mode("default")
            assert copies == []
