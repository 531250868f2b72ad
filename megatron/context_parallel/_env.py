"""The one rule for reading this package's on/off environment variables.

Every ``MCP_*`` switch (``MCP_FORCE_CUDA_BUILD``, ``MCP_SKIP_CUDA_BUILD``,
``MCP_REQUIRE_EXTENSION``, ``MCP_DISABLE_EXTENSION``) is read by :func:`env_flag`, so each means
the same thing wherever it is read: ``1``, ``true``, ``yes``, ``on`` turn it on; ``0``,
``false``, ``no``, ``off``, empty or unset leave it off (any case, surrounding spaces ignored);
anything else is an error naming the variable, because guessing would silently flip a switch
(``MCP_REQUIRE_EXTENSION=false`` once turned the requirement on).

``setup.py`` runs before the package can be imported and loads this file by its path, so it
must import nothing but the standard library.
"""

from __future__ import annotations

import os
from typing import Mapping, Optional

__all__ = ["env_flag"]

_ON = frozenset({"1", "true", "yes", "on"})
_OFF = frozenset({"", "0", "false", "no", "off"})


def env_flag(name: str, environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether the on/off environment variable ``name`` is on.

    Args:
        name: the variable, e.g. ``"MCP_REQUIRE_EXTENSION"``.
        environ: where to look it up; ``os.environ`` by default.

    Returns:
        True for ``1/true/yes/on``, False for ``0/false/no/off``, empty or unset.

    Raises:
        ValueError: any other value, with the variable's name and value in the message.
    """
    value = (os.environ if environ is None else environ).get(name)
    if value is None:
        return False
    word = value.strip().lower()
    if word in _ON:
        return True
    if word in _OFF:
        return False
    raise ValueError(
        f"environment variable {name}={value!r} is neither on (1, true, yes, on) nor off "
        "(0, false, no, off, empty)"
    )
