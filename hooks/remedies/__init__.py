"""Remedies: what changes training: the weight guard that keeps a bad step out of the weights, the optimizers'
other hooks (the optimizer check, the replica check and its repair), loss scaling seen through, and what runs at
each step boundary in order (``step_remedies``, which also starts the forensics of ``nanwatch.hooks.forensics``).
Imports ``measure``, ``directives``, ``instrument`` and ``forensics``; nothing above it.
"""

__all__ = ["loss_scaling", "optimizer_discovery", "optimizer_hooks", "replica_check", "step_remedies",
           "weight_guard"]
