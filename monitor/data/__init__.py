"""Data: what the collector holds, in memory (the state as plain data: runs, ranks, counter totals) and on
disk (the durable store's interface and its SQLite implementation), the one metric table, event records,
directive versions, principals and the memory budget, and who is live (``liveness``, asked by writers and
readers alike). Only ``nanwatch.monitor.write`` changes the state. Imports nothing else of
``nanwatch.monitor``.
"""

__all__ = ["auth", "directive_log", "durable", "event_log", "liveness", "long_poll", "memory", "metric_table", "refusal", "rollout_figures",
           "schema", "state", "store"]
