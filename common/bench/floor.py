"""The floor of ``nanwatch bench``: the least a hook-based monitor that reads each monitored tensor once
can cost.

Plain PyTorch hooks on the same modules nanwatch measures do one ``torch.aminmax`` of each output in forward
and of its gradient in backward as nanwatch's defaults do, every step: the input embedding, attention, the
output head and the other coarse localisation sites; attention modules one more of their input (nanwatch reads
each call's query too); with ``param_check_every`` (off, as nanwatch's default) every step one ``aminmax`` of
the same rotating share of the parameters; and after
each optimizer step one of every parameter it updated (nanwatch's optimizer check). A tensor met twice in a row is read once, as
nanwatch does. Nothing is kept, decoded or reported: these are the reads nanwatch's defaults promise, and
their time is the least any monitor that makes the same promises can cost.

The floor is the time spent in those reads, summed per step with a clock around each (and a device sync
on CUDA): read where nanwatch reads, with the caches as the step leaves them, in the same interleaved
rounds as every other variant. A whole-step difference would bury it in the machine's noise.
"""

from __future__ import annotations

import contextlib
import statistics
import time
import weakref
from collections.abc import Callable, Iterator
from functools import partial

import torch

from nanwatch.hooks.config import default_is_attention
from nanwatch.hooks.instrument.probes import first_tensor
from nanwatch.hooks.measure.structure import coarse_sites

__all__ = ["Floor"]


class Floor:
    """``round()`` attaches the floor's hooks for a round; ``step()`` reads this step's parameter share.
    ``reads`` counts the tensors read in the last step; ``step_ms`` is each step's time spent reading."""

    def __init__(self, model: torch.nn.Module, *, param_check_every: int = 0,
                 optimizer: torch.optim.Optimizer | None = None) -> None:
        self.model = model
        self.every = param_check_every
        self.optimizer = optimizer
        self.reads = 0
        self.step_ms: list[float] = []
        self.step_reads: list[int] = []
        self._seconds = 0.0
        self._sweep = 0
        self._last: Callable[[], torch.Tensor | None] = lambda: None
        cuda = next(model.parameters()).is_cuda
        self._sync = torch.cuda.synchronize if cuda else (lambda: None)

    def summary(self) -> dict:
        """The floor: the mean milliseconds a step spends reading, and the mean reads a step (means: a step that
        reads more than the others, the parameter sweep's, must count at its rate)."""
        return {"ms": statistics.fmean(self.step_ms) if self.step_ms else 0.0,
                "reads": statistics.fmean(self.step_reads) if self.step_reads else 0.0, "steps": len(self.step_ms)}

    def _modules(self) -> tuple[list[torch.nn.Module], list[torch.nn.Module], list[tuple[str, torch.nn.Module]]]:
        """(attention modules, the output head, the coarse sites with their kinds), chosen as ``Monitor``
        chooses them."""
        model = self.model
        fqns = {id(m): name or type(m).__name__ for name, m in model.named_modules()}
        hits = [(n, m) for n, m in model.named_modules() if default_is_attention(n, m)]
        attn = [m for n, m in hits if not any(o.startswith(n + ".") for o, _ in hits)]
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        others = [head] if isinstance(head, torch.nn.Module) else []
        skip = {id(m) for m in attn + others}
        return attn, others, [(kind, m) for _, kind, m in coarse_sites(model, fqns, skip)]

    def _read(self, x) -> None:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.numel():
            self.reads += 1
            if self._last() is x:  # the same gradient into a block and its MLP: read once, as nanwatch does
                return
            self._last = weakref.ref(x)
            self._sync()
            t0 = time.perf_counter()
            torch.aminmax(x.detach())
            self._sync()
            self._seconds += time.perf_counter() - t0

    def _output(self, kind: str, module, args, output) -> None:
        """A site of ``kind``: its output, and its gradient in backward."""
        x = first_tensor(output)
        self._read(x)
        if isinstance(x, torch.Tensor) and x.requires_grad:
            x.register_hook(self._read)

    def _input(self, module, args, kwargs) -> None:
        self._read(first_tensor(args) if args else kwargs.get("hidden_states"))

    def _after_update(self, optimizer, args, kwargs) -> None:
        with torch.no_grad():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        self._read(p)

    @contextlib.contextmanager
    def round(self) -> Iterator[None]:
        attn, head, coarse = self._modules()
        sites = [("attention", m) for m in attn] + [("logits", m) for m in head] + coarse
        handles = [m.register_forward_pre_hook(self._input, with_kwargs=True) for m in attn]
        handles += [m.register_forward_hook(partial(self._output, kind)) for kind, m in sites]
        if self.optimizer is not None:
            handles.append(self.optimizer.register_step_post_hook(self._after_update))
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    @contextlib.contextmanager
    def step(self, _: int) -> Iterator[None]:
        self.reads, self._seconds = 0, 0.0
        params = list(self.model.parameters()) if self.every else []  # the sweep: off by default, as nanwatch's
        share = -(-len(params) // self.every) if params else 0
        start = self._sweep % len(params) if params else 0
        self._sweep = start + share
        for p in (params + params)[start : start + share]:
            self._read(p)
        yield
        self.step_ms.append(self._seconds * 1e3)
        self.step_reads.append(self.reads)
