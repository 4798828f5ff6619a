"""nanwatch.monitor: the collector service. Never imports torch."""

__all__: list[str] = []
