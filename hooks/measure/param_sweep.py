"""The rotating parameter check: every parameter (and, with a weight guard, every optimizer-state tensor)
is read once every ``param_check_every`` steps, a share at each step start, before any forward, so that a
tensor already non-finite before the step is named as the birth site rather than the first activation it
poisons. The list is built again at the start of each full cycle (new optimizer state, a changed model),
not every step. Training thread only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

__all__ = ["ParamSweep"]


class ParamSweep:
    """Which tensors to read at this step start.

    Example usage::

        sweep = ParamSweep(weakref.ref(model), optimizers=lambda: [opt], every=8)
        probes.check_tensors(sweep.share())   # at each step start
    """

    def __init__(self, model: Callable[[], torch.nn.Module | None], *,
                 optimizers: Callable[[], Iterable[torch.optim.Optimizer]], every: int) -> None:
        self._model = model
        self._optimizers = optimizers
        self._every = every
        self._at = 0  # the rotation's place
        self._tensors: list[tuple[str, torch.Tensor]] = []  # what it rotates over, listed once per cycle

    def share(self) -> list[tuple[str, torch.Tensor]]:
        """This step's share (all of them every ``every`` steps): one aminmax each, in forward order."""
        if self._at >= len(self._tensors):
            self._tensors, self._at = self._list(), 0
        if not self._tensors:
            return []
        n = -(-len(self._tensors) // self._every)
        start, self._at = self._at, self._at + n
        return self._tensors[start : start + n]

    def _list(self) -> list[tuple[str, torch.Tensor]]:
        model = self._model()
        if model is None:
            return []
        tensors = [(name, p) for name, p in model.named_parameters()]
        names = {id(p): name for name, p in tensors}
        for opt in self._optimizers():
            for p, state in opt.state.items():
                tensors += [(f"optimizer.{names.get(id(p), '?')}.{k}", v) for k, v in state.items()
                            if isinstance(v, torch.Tensor) and v.dim() > 0]
        return [(name, t) for name, t in tensors if t.is_floating_point()]
