"""Data: the collector's state in memory (runs, ranks, counters) and on disk (the SQLite store), the
event and directive logs, the caps, principals and the memory budget. Imports nothing else of ``nanwatch.monitor``.
"""

__all__ = ["auth", "directive_log", "durable", "event_log", "liveness", "long_poll", "memory", "metric_table", "refusal", "rollout_figures",
           "schema", "state", "store"]
