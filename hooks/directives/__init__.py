"""Directives: the mode every rank applies now (state), when a new one takes effect (decision), how ranks
agree on the step (agreement), what a mode changes (mode effects), and the trainer's local rules. Imports
``measure`` and nothing above it.
"""

__all__ = ["agreement", "decision", "local_rules", "mode_effects", "directive_state"]
