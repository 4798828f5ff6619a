"""nanwatch's public API, declared in one place: the names users import and the commands they run. Anything
else is internal, free to move or change between 0.x releases without notice (CHANGELOG.md says what
moved). docs/api.md lists exactly these, each with what it is for (tests/test_public_api.py checks
it, imports each name, and holds the public packages' ``__all__`` and the CLI's commands to them).

The names are data, imported by nothing at run time: reading this module imports neither torch nor the web
stack.
"""

from __future__ import annotations

__all__ = ["COMMANDS", "NAMES"]

#: every public dotted name: the trainer side first, then a rollout worker's, then the collector's
NAMES: tuple[str, ...] = (
    "nanwatch.attach",
    "nanwatch.fingerprint",
    "nanwatch.hooks.Monitor",
    "nanwatch.hooks.MonitorConfig",
    "nanwatch.hooks.rollout_logprobs",
    "nanwatch.hooks.integrations.transformers.NanwatchCallback",
    "nanwatch.hooks.integrations.lightning.NanwatchCallback",
    "nanwatch.weight_sync.post_weights",
    "nanwatch.weight_sync.WeightSyncRefused",
    "nanwatch.monitor.create_app",
    "nanwatch.monitor.Settings",
    "nanwatch.monitor.get_settings",
    "nanwatch.policy.Rule",
)

#: the ``nanwatch`` command's subcommands, in the order ``nanwatch --help`` lists them
COMMANDS: tuple[str, ...] = (
    "serve",
    "status",
    "directive",
    "push",
    "demo",
    "bench",
    "replay",
)
