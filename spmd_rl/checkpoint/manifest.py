"""manifest.json: what a checkpoint records about itself, its format version, and the upgrade of
a checkpoint of an older format.

Every complete checkpoint has `manifest.json`: `format` (FORMAT when written), `spmd_rl_version`
(the package that wrote it), `step`, `world_size`, `run_dir` (where its config.toml is) and
`files` (every file and its size, checked by the resume's verification). `read` returns it at
today's format: a checkpoint of an older format goes through one upgrade step per format change
(UPGRADES, applied to what is read; the files on disk stay as written), and one of a newer
format is refused in one line naming both versions. What "compatible" promises, and what a
change of the checkpoint's layout adds here: docs/checkpoints.md.

Formats:
1. spmd_rl 0.1.0 without a `format` field: `step`, `world_size`, `run_dir`, `files`; the oldest
   checkpoints have no manifest at all.
2. adds `format` and `spmd_rl_version`.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Callable

from spmd_rl import __version__

MANIFEST = "manifest.json"
FORMAT = 2
"""The format this version writes and reads; one more for every change of what a checkpoint
holds or how it is laid out, with its upgrade step in UPGRADES."""


class NewerFormat(Exception):
    """A checkpoint written by a later version, in a format this one cannot read."""


def written(step: int, world_size: int, run_dir: str, files: dict[str, int]) -> dict[str, Any]:
    """The manifest of a checkpoint this version writes."""
    return {"format": FORMAT, "spmd_rl_version": __version__, "step": step, "world_size": world_size,
            "run_dir": run_dir, "files": files}


def _from_format_1(manifest: dict[str, Any], path: str) -> dict[str, Any]:
    """Format 1 -> 2. Every format-1 checkpoint was written by spmd_rl 0.1.0. A checkpoint without
    a manifest gets what its directory tells: its ranks (one trainer state each), its run directory
    (RUN for RUN/checkpoints/step_N), its step from its name, and no file sizes to check."""
    out = {"step": None, "world_size": None, "run_dir": None, "files": {}, **manifest}
    if out["world_size"] is None:
        out["world_size"] = sum(1 for n in os.listdir(path) if re.fullmatch(r"trainer_state_rank\d+\.pt", n))
    if out["run_dir"] is None:
        out["run_dir"] = os.path.dirname(os.path.dirname(os.path.abspath(path)))
    if out["step"] is None:
        m = re.fullmatch(r"step_(\d+)", os.path.basename(os.path.abspath(path)))
        out["step"] = int(m.group(1)) if m else None
    return {**out, "format": 2, "spmd_rl_version": "0.1.0"}


UPGRADES: dict[int, Callable[[dict[str, Any], str], dict[str, Any]]] = {1: _from_format_1}
"""format N -> the step that turns a manifest of format N into one of format N + 1."""


def read(path: str) -> dict[str, Any]:
    """The manifest of checkpoint `path` at today's format (FORMAT). Raises OSError/ValueError for
    an unreadable manifest.json, NewerFormat for a checkpoint of a later version."""
    mpath = os.path.join(path, MANIFEST)
    manifest: dict[str, Any] = {}
    if os.path.isfile(mpath):
        with open(mpath) as f:
            manifest = json.load(f)
        if not isinstance(manifest, dict):
            raise ValueError(f"{MANIFEST} holds no JSON object")
    fmt = manifest.get("format", 1)
    if not isinstance(fmt, int) or fmt > FORMAT:
        raise NewerFormat(f"checkpoint {path} was written by spmd_rl {manifest.get('spmd_rl_version', '?')} in "
                          f"checkpoint format {fmt}; this spmd_rl {__version__} reads formats up to {FORMAT}: resume "
                          "it with that version or a later one, or start a new trainer.run_dir")
    while fmt < FORMAT:
        manifest = UPGRADES[fmt](manifest, path)
        fmt = manifest["format"]
    return manifest
