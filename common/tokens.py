"""Bearer tokens: the one place that reads a token from the environment or a file and checks its form.

The trainer (``NANWATCH_TOKEN`` / ``NANWATCH_TOKEN_FILE``), the collector's settings (every token kind and
its ``*_FILE``) and ``nanwatch status`` all read tokens here, with the same checks and the same errors.
Standard library only: importing it costs neither side a dependency.

Example usage::

    token = token_from_env("NANWATCH_TOKEN")    # $NANWATCH_TOKEN, else the file $NANWATCH_TOKEN_FILE names
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

__all__ = ["VISIBLE_ASCII", "check_token", "read_token_file", "token_from_env"]

#: HTTP carries header bytes: a token of visible ASCII matches whatever encoding a client uses.
VISIBLE_ASCII = re.compile(r"[\x21-\x7e]+")


def check_token(name: str, value: str) -> str:
    """``value`` if it is a usable bearer token, else a ValueError naming ``name`` and the rule."""
    if not VISIBLE_ASCII.fullmatch(value):
        raise ValueError(f"the {name} token must be visible ASCII (letters, digits, punctuation; no spaces): "
                         "HTTP carries header bytes, and a non-ASCII token would match only one encoding")
    return value


def read_token_file(name: str, path: str | os.PathLike[str]) -> str:
    """The token held in ``path`` (surrounding whitespace stripped), checked; a ValueError that names the
    file if it cannot be read, is empty or holds something that is not a token."""
    try:
        text = Path(path).read_text().strip()
    except OSError as e:
        raise ValueError(f"cannot read the {name} token file {str(path)!r}: {e}") from e
    if not text:
        raise ValueError(f"the {name} token file {str(path)!r} is empty")
    return check_token(name, text)


def token_from_env(var: str, env: Mapping[str, str] | None = None) -> str | None:
    """``$var``, else the file ``$var_FILE`` names (a mounted secret), else None; checked either way."""
    env = os.environ if env is None else env
    token = env.get(var)
    if token:
        return check_token(var, token)
    path = env.get(f"{var}_FILE")
    return read_token_file(f"{var}_FILE", path) if path else None
