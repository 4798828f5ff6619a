"""Read: what the collector shows (the Prometheus exporter, rendered from ``data.metric_table``, and the
scrape's views of the state). Reads only: nothing here changes the state, except the renderer's own
bookkeeping of which series it has shown. Imports ``data`` only.
"""

__all__ = ["exporter", "views"]
