"""What the differential rerun (``nanwatch.hooks.remedies.rerun``) needs of a training forward to re-run it:
references to its arguments (nothing is copied) and the RNG state at its start."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["KeptForward", "keep"]


@dataclass(slots=True)
class KeptForward:
    """One training forward of the step: its arguments (references) and the RNG state at its start."""

    args: tuple
    kwargs: dict
    cpu_rng: torch.Tensor
    cuda_rng: list[torch.Tensor] = field(default_factory=list)


def keep(args: tuple, kwargs: dict) -> KeptForward:
    """What a forward needs to be re-run later: references to its arguments, and the RNG state now."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    return KeptForward(args, dict(kwargs), torch.get_rng_state(), cuda)
