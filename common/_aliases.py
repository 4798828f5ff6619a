"""Old module paths, kept working: importing one imports its new home under the old name too, with a
DeprecationWarning once per path.

The code moved into subpackages by concern (``nanwatch.hooks.measure``, ``...report``,
``nanwatch.monitor.write``, ...); users' imports of the old flat paths (``nanwatch.hooks.transport``,
``nanwatch.integrations.trl``) must not break. One table and one finder do it, installed by the root package,
so that no stub file per old module clutters the tree. Imports only the standard library.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from types import ModuleType

__all__ = ["MOVED", "install"]

#: old dotted module name -> where it lives now
MOVED: dict[str, str] = {
    "nanwatch.demo": "nanwatch.cli.demo",
    "nanwatch.hooks.call_stack": "nanwatch.hooks.measure.call_stack",
    "nanwatch.hooks.capsule": "nanwatch.hooks.remedies.capsule",
    "nanwatch.hooks.capsule_replay": "nanwatch.hooks.remedies.replay",
    "nanwatch.hooks.collective": "nanwatch.hooks.measure.collective",
    "nanwatch.hooks.compiled": "nanwatch.hooks.measure.compiled",
    "nanwatch.hooks.directive_agreement": "nanwatch.hooks.directives.agreement",
    "nanwatch.hooks.directive_decision": "nanwatch.hooks.directives.decision",
    "nanwatch.hooks.directive_state": "nanwatch.hooks.directives.directive_state",
    "nanwatch.hooks.dtypes": "nanwatch.hooks.measure.dtypes",
    "nanwatch.hooks.eval_windows": "nanwatch.hooks.instrument.eval_windows",
    "nanwatch.hooks.fingerprint": "nanwatch.hooks.measure.inputs",
    "nanwatch.hooks.guards": "nanwatch.hooks.remedies.optimizer_hooks",
    "nanwatch.hooks.install": "nanwatch.hooks.instrument.install",
    "nanwatch.hooks.job_report": "nanwatch.hooks.report.job",
    "nanwatch.hooks.job_stats": "nanwatch.hooks.report.job_stats",
    "nanwatch.hooks.kept_forward": "nanwatch.hooks.measure.kept_forward",
    "nanwatch.hooks.local_log": "nanwatch.hooks.report.local_log",
    "nanwatch.hooks.local_rules": "nanwatch.hooks.directives.local_rules",
    "nanwatch.hooks.logit": "nanwatch.hooks.measure.logit",
    "nanwatch.hooks.loss_scaling": "nanwatch.hooks.remedies.loss_scaling",
    "nanwatch.hooks.mode_effects": "nanwatch.hooks.directives.mode_effects",
    "nanwatch.hooks.observations": "nanwatch.hooks.measure.observations",
    "nanwatch.hooks.optimizer_check": "nanwatch.hooks.measure.optimizer_check",
    "nanwatch.hooks.optimizer_discovery": "nanwatch.hooks.remedies.optimizer_discovery",
    "nanwatch.hooks.param_sweep": "nanwatch.hooks.measure.param_sweep",
    "nanwatch.hooks.patching": "nanwatch.hooks.instrument.patching",
    "nanwatch.hooks.probes": "nanwatch.hooks.instrument.probes",
    "nanwatch.hooks.recorder": "nanwatch.hooks.measure.recorder",
    "nanwatch.hooks.remedies.guards": "nanwatch.hooks.remedies.optimizer_hooks",
    "nanwatch.hooks.replay": "nanwatch.hooks.remedies.rerun",
    "nanwatch.hooks.report_flow": "nanwatch.hooks.report.flow",
    "nanwatch.hooks.reporter": "nanwatch.hooks.report.reporter",
    "nanwatch.hooks.rlhf": "nanwatch.hooks.measure.rlhf",
    "nanwatch.hooks.sdpa_backend": "nanwatch.hooks.measure.sdpa_backend",
    "nanwatch.hooks.sdpa_probe": "nanwatch.hooks.instrument.sdpa_probe",
    "nanwatch.hooks.sdpa_rules": "nanwatch.hooks.measure.sdpa_rules",
    "nanwatch.hooks.slot_buffer": "nanwatch.hooks.measure.slot_buffer",
    "nanwatch.hooks.structure": "nanwatch.hooks.measure.structure",
    "nanwatch.hooks.transport": "nanwatch.hooks.report.transport",
    "nanwatch.hooks.weight_guard": "nanwatch.hooks.remedies.weight_guard",
    "nanwatch.integrations": "nanwatch.hooks.integrations",
    "nanwatch.integrations.transformers": "nanwatch.hooks.integrations.transformers",
    "nanwatch.integrations.trl": "nanwatch.hooks.integrations.trl",
    "nanwatch.monitor.auth": "nanwatch.monitor.data.auth",
    "nanwatch.monitor.body": "nanwatch.monitor.web.body",
    "nanwatch.monitor.deps": "nanwatch.monitor.web.deps",
    "nanwatch.monitor.directive_log": "nanwatch.monitor.data.directive_log",
    "nanwatch.monitor.event_log": "nanwatch.monitor.data.event_log",
    "nanwatch.monitor.exception_handlers": "nanwatch.monitor.web.exception_handlers",
    "nanwatch.monitor.exporter": "nanwatch.monitor.read.exporter",
    "nanwatch.monitor.ingest": "nanwatch.monitor.write.fold",
    "nanwatch.monitor.ledger": "nanwatch.monitor.write.ledger",
    "nanwatch.monitor.long_poll": "nanwatch.monitor.data.long_poll",
    "nanwatch.monitor.memory": "nanwatch.monitor.data.memory",
    "nanwatch.monitor.metric_names": "nanwatch.monitor.data.metric_table",
    "nanwatch.monitor.middleware": "nanwatch.monitor.web.middleware",
    "nanwatch.monitor.openapi": "nanwatch.monitor.web.openapi",
    "nanwatch.monitor.protocol": "nanwatch.monitor.web.protocol",
    "nanwatch.monitor.refusal": "nanwatch.monitor.data.refusal",
    "nanwatch.monitor.routers": "nanwatch.monitor.web.routers",
    "nanwatch.monitor.rules": "nanwatch.monitor.write.directive_rules",
    "nanwatch.monitor.schemas": "nanwatch.monitor.web.schemas",
    "nanwatch.monitor.state": "nanwatch.monitor.data.state",
    "nanwatch.monitor.store": "nanwatch.monitor.data.store",
    "nanwatch.status_view": "nanwatch.cli.status_view",
    "nanwatch.tiny_models": "nanwatch.bench.tiny_models",
}


class _Alias(importlib.abc.Loader):
    """Loads an old name as the module at its new home (the same object: one module, two names)."""

    def __init__(self, new: str) -> None:
        self.new = new
        self._spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(f"{spec.name} moved to {self.new}; the old path will be removed",
                      DeprecationWarning, stacklevel=3)
        module = importlib.import_module(self.new)
        self._spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run (the module at the new home has run already); the import system gave the module
        the old name's spec, so its own is put back: it stays one module, reloadable and picklable."""
        module.__spec__ = self._spec


def _new_name(name: str) -> str | None:
    """Where ``name`` lives now: its own entry, or its moved package's (``nanwatch.monitor.routers.runs``)."""
    head, rest = name, ""
    while head:
        if head in MOVED:
            return MOVED[head] + rest
        head, _, leaf = head.rpartition(".")
        rest = f".{leaf}{rest}"
    return None


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path=None, target=None) -> importlib.machinery.ModuleSpec | None:
        new = _new_name(name)
        return None if new is None else importlib.util.spec_from_loader(name, _Alias(new))


def install() -> None:
    """Put the finder first on ``sys.meta_path``, once: an old submodule path of a moved package
    (``nanwatch.integrations.trl``) must not be found through the package's ``__path__`` as a second copy."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
