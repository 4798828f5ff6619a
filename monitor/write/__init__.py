"""Write: a validated batch folded into changes, the rules turning them into intents, and the ledger that
applies both in one transaction (the one door for writes). Imports ``model`` only.
"""

__all__ = ["fold", "ledger", "rules"]
