"""Read: what the collector shows (the Prometheus exporter and its one table of metric names). Imports
``data`` only.
"""

__all__ = ["exporter", "views"]
