"""What every section's checks share: the range-rule type and the one-line refusal."""

from __future__ import annotations

import os
from typing import Literal

from spmd_rl.errors import ConfigError

AUTO = "auto"
"""The value of a setting that trades memory for speed, chosen at start by the memory plan
(spmd_rl/preflight/speed_settings.py)."""
Auto = Literal["auto"]
"""The type of AUTO, in a key's annotation beside its own type (`bool | Auto`)."""

Rule = tuple[str, bool, str]
"""A range rule of a section's key: (key, whether its value is in range, the range in words)."""


def need(ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(msg)


def cannot_write(path: str) -> str | None:
    """Why no directory can be created and written at `path` (None: it can), from the nearest part
    of it that exists. Found here, before the process group exists, not by a makedirs traceback."""
    target = p = os.path.abspath(path)
    while not os.path.exists(p):
        p = os.path.dirname(p)
    if not os.path.isdir(p):
        return "it is a file" if p == target else f"{p!r} is a file"
    if not os.access(p, os.W_OK | os.X_OK):
        return f"{p!r} is not writable"
    return None


def ordinal(k: int) -> str:
    """2 -> "2nd", 8 -> "8th", 11 -> "11th", 21 -> "21st"."""
    suffix = "th" if 10 <= k % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(k % 10, "th")
    return f"{k}{suffix}"
