"""The shipped config presets (configs/*.toml) and `--config NAME` lookup.

The presets live in the repository's top-level `configs/`; a wheel installs the same files as the
package `spmd_rl.configs` (pyproject.toml maps it onto `configs/`), so a non-editable install has
them too. `--config X` means the file X when it exists, else the preset X (with or without .toml).
"""

from __future__ import annotations

import os

from spmd_rl.errors import ConfigError

_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
"""The spmd_rl package directory (this module is spmd_rl/config/presets.py)."""


def presets_dir() -> str:
    """spmd_rl/configs in an installed wheel, else the source checkout's configs/."""
    installed = os.path.join(_PKG, "configs")
    return installed if os.path.isdir(installed) else os.path.join(os.path.dirname(_PKG), "configs")


def preset_names() -> list[str]:
    d = presets_dir()
    return sorted(f[:-len(".toml")] for f in os.listdir(d) if f.endswith(".toml")) if os.path.isdir(d) else []


def resolve_config(arg: str | None) -> str | None:
    """The TOML file `--config arg` means: the path if it exists, else a shipped preset."""
    if not arg or os.path.exists(arg):
        return arg
    name = os.path.basename(arg)
    name = name[:-len(".toml")] if name.endswith(".toml") else name
    path = os.path.join(presets_dir(), name + ".toml")
    if os.path.isfile(path):
        return path
    raise ConfigError(f"config file {arg!r} does not exist and is not a preset: pass an existing TOML file, or one "
                      f"of the presets {', '.join(preset_names())} (python -m spmd_rl.ppo --list-configs)")


def purpose(path: str) -> str:
    """A preset's one-line purpose: its first comment line."""
    with open(path) as f:
        for line in f:
            if line.startswith("#"):
                return line.lstrip("#").strip()
    return ""


def describe_presets() -> str:
    names = preset_names()
    width = max((len(n) for n in names), default=0)
    return "\n".join(f"{n:<{width}}  {purpose(os.path.join(presets_dir(), n + '.toml'))}" for n in names)
