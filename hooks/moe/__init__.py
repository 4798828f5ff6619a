"""MoE routing, one room (#39): the routers found (``routers``), measured and replayed in the step (``taps``),
rollout routes lined up and recorded (``routes``), and the step's record decoded into the report with its events
(``report``). Imports ``instrument`` and ``measure`` below it; ``report`` and the facade import it.
"""

__all__ = ["report", "routers", "routes", "taps"]
