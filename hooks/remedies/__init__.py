"""Remedies: what keeps a bad step out of the weights (the weight guard and the optimizers' guards, loss
scaling), and what explains it afterwards (the differential rerun, the incident capsule and its replay).
Imports ``measure``, ``directives`` and ``instrument``; nothing above it.
"""

__all__ = ["capsule", "guards", "loss_scaling", "optimizer_discovery", "replay", "rerun", "weight_guard"]
