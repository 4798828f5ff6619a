"""nanwatch.hooks: trainer-side instrumentation. Never imports the web stack.

``attach(model, run_id=...)`` returns a :class:`Monitor`; see its docstring for an example.
"""

from nanwatch.hooks.config import MonitorConfig
from nanwatch.hooks.facade import Monitor, attach

__all__ = ["Monitor", "MonitorConfig", "attach"]
