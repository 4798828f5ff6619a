"""Remedies: what keeps a bad step out of the weights (the weight guard and the optimizers' other hooks, loss
scaling), and what explains it afterwards (the differential rerun, the incident capsule and its replay).
Imports ``measure``, ``directives`` and ``instrument``; nothing above it.
"""

__all__ = ["capsule", "incident_tensors", "loss_scaling", "optimizer_discovery", "optimizer_hooks", "replay",
           "rerun", "rerun_flags", "weight_guard"]
