"""Instrument: the hooks installed on a model (module probes, the SDPA wrapper, eval windows) and their
installation. Imports ``measure`` and ``directives``; nothing above it.
"""

__all__ = ["eval_windows", "install", "patching", "probes", "sdpa_probe"]
