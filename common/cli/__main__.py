"""``python -m nanwatch.cli``: the ``nanwatch`` command."""

import sys

from nanwatch.cli import main

sys.exit(main())
