"""Write: a validated batch folded into changes, the directive rules turning them into intents, and the ledger that
applies both in one transaction (the one door for writes). Imports ``data`` only.
"""

__all__ = ["caps", "directive_rules", "fold", "ledger", "weight_compare"]
