"""nanwatch.monitor: the collector service. Never imports torch.

Example usage::

    from nanwatch.monitor import Settings, create_app
    app = create_app(Settings(db_path="nanwatch.db", rank_ttl_s=60))
"""

from nanwatch.monitor.app import create_app
from nanwatch.monitor.settings import Rule, Settings, get_settings

__all__ = ["Rule", "Settings", "create_app", "get_settings"]
