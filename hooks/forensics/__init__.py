"""Forensics: what explains a bad step afterwards, without changing training: the differential rerun of the
run's first non-finite step (its flags on their way to the host, its one read of every parameter and
optimizer-state tensor), the incident capsule it writes, and ``nanwatch replay``, which re-runs a capsule
anywhere. The rollout attribution, a forensic of the rollout feature, lives in its room
(``nanwatch.hooks.rollout.attribution``) at this stage.

Imports ``measure``, ``directives`` and ``instrument``; nothing above it (``remedies`` runs the rerun at the step
boundary).
"""

__all__ = ["capsule", "incident_tensors", "replay", "rerun", "rerun_flags"]
