"""nanwatch.hooks: trainer-side instrumentation. Never imports the web stack."""

__all__: list[str] = []
