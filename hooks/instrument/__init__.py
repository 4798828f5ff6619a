"""Instrument: the hooks installed on a model (the shared probes, the module hook bodies, the SDPA wrapper,
what the differential rerun needs of a forward, eval windows) and their installation. Imports ``measure``
and ``directives``; nothing above it.
"""

__all__ = ["eval_windows", "install", "module_hooks", "patching", "probes", "rerun_tap", "sdpa_probe"]
