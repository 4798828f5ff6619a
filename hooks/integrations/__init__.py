"""nanwatch.hooks.integrations: nanwatch inside the training stacks people run. Each module imports its
framework lazily, inside the functions that need it; importing the package costs nothing.

* :mod:`nanwatch.hooks.integrations.transformers`: ``NanwatchCallback`` for HF ``Trainer`` (and so TRL).
* :mod:`nanwatch.hooks.integrations.lightning`: ``NanwatchCallback`` for a Lightning ``Trainer``.
* :mod:`nanwatch.hooks.integrations.trl`: the GRPO adapter the callback applies to a TRL ``GRPOTrainer``.
"""

__all__: list[str] = []
