"""Write: a validated batch folded into changes, the directive rules turning them into intents, and the ledger that
applies both in one transaction (the one door for writes). Imports ``data`` only.
"""

__all__ = ["caps", "counting", "directive_rules", "events", "exposure", "fold", "ledger", "lifetimes", "memory_sync", "rank_views",
           "requests", "weight_compare"]
