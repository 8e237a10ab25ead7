"""What changed in the config since the run being resumed, and whether it can still resume.

At resume the saved `<run_dir>/config.toml` (written by the run that made the checkpoint) is
compared key by key with the new config: every changed key is logged, and changes that make
the checkpoint meaningless or unloadable are refused before any model loads, naming the key.
The engine's arguments (rollout.*, rollout.engine_kwargs entries) may change: the engine is
built afresh and gets its weights from the actor.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from spmd_rl.config.older_configs import with_missing_keys
from spmd_rl.config.run_config import Config
from spmd_rl.config.toml_io import to_dict, tomllib
from spmd_rl.errors import ConfigError

log = logging.getLogger("spmd_rl")

# Keys whose change makes the checkpoint unusable: another architecture or vocabulary (the
# tensors do not fit), another master dtype (optimizer states), another starting model (the
# reference model and, for random init, <run_dir>/init_model would silently differ), or another
# LoRA adapter (its tensors, the layers holding them, or the policy they give).
FIXED_KEYS = {
    "model.path": "the model (architecture and starting weights)",
    "model.init": "how the starting weights are made",
    "model.arch": "the architecture",
    "model.tokenizer": "the vocabulary",
    "model.dtype": "the dtype of the weights and optimizer states in the checkpoint",
    "critic.path": "the critic's architecture",
    "model.lora_rank": "the LoRA adapter's shape (0: none)",
    "model.lora_target_modules": "the layers that hold the LoRA adapter",
    "model.lora_alpha": "the scale of the LoRA adapter's update (the policy the checkpoint holds)",
}
FIXED_WITH_RANDOM_INIT = {"model.seed": "the random starting weights (and so the reference model)"}


def flatten(cfg: dict[str, Any]) -> dict[str, Any]:
    """section.key -> value; a table-valued key (rollout.engine_kwargs) gives one section.key.entry
    per entry, so a change is listed as the entry that changed (and an empty table as nothing)."""
    out: dict[str, Any] = {}

    def add(prefix: str, values: dict[str, Any]) -> None:
        for k, v in values.items():
            if isinstance(v, dict):
                add(f"{prefix}{k}.", v)
            else:
                out[prefix + k] = v

    for section, values in cfg.items():
        if isinstance(values, dict):
            add(f"{section}.", values)
    return out


def config_changes(old: dict[str, Any], new: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """key -> (old, new) for every key whose value differs (keys unknown to one side included).
    `old` is a saved config.toml: a key its version did not have reads as that version behaved
    (older_configs)."""
    a, b = with_missing_keys(flatten(old), flatten(to_dict(Config()))), flatten(new)
    missing = object()
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b))
            if a.get(k, missing) != b.get(k, missing)}


def refuse_incompatible(changes: dict[str, tuple[Any, Any]], new_cfg: Config) -> None:
    fixed = dict(FIXED_KEYS)
    if new_cfg.model.init == "random":
        fixed.update(FIXED_WITH_RANDOM_INIT)
    for key, what in fixed.items():
        if key in changes:
            old, new = changes[key]
            raise ConfigError(f"cannot resume with {key} changed ({old!r} -> {new!r}): it changes {what} of the "
                              f"checkpoint; set it back, or start a new trainer.run_dir")
    if "algorithm.adv_estimator" in changes:
        old, new = changes["algorithm.adv_estimator"]
        if (old == "gae") != (new == "gae"):
            raise ConfigError(f"cannot resume with algorithm.adv_estimator changed ({old!r} -> {new!r}): it turns the "
                              "critic " + ("off" if old == "gae" else "on") + ", which the checkpoint "
                              + ("has" if old == "gae" else "lacks") + "; set it back, or start a new trainer.run_dir")


def resumed_run_dir(cfg: Config) -> str | None:
    """The run directory whose checkpoint this run will resume from, or None for a fresh start."""
    t = cfg.trainer
    if t.resume == "none":
        return None
    if t.resume != "auto":
        from spmd_rl.checkpoint.reading import run_dir_of

        return run_dir_of(t.resume)
    ckpt = cfg.checkpoint_dir
    has_checkpoint = os.path.isdir(ckpt) and any(d.startswith("step_") and not d.endswith(".tmp") for d in os.listdir(ckpt))
    return cfg.run_dir if has_checkpoint else None


def check_resume_config(cfg: Config, is_main: bool = True) -> dict[str, tuple[Any, Any]]:
    """Log the keys changed since the resumed run and refuse those that cannot resume.
    Returns the changes ({} for a fresh start or an unchanged config)."""
    run_dir = resumed_run_dir(cfg)
    saved = os.path.join(run_dir, "config.toml") if run_dir else ""
    if not run_dir or not os.path.isfile(saved):
        return {}
    with open(saved, "rb") as f:
        old = tomllib.load(f)
    changes = config_changes(old, to_dict(cfg))
    refuse_incompatible(changes, cfg)
    if changes and is_main:
        log.warning("resuming %s with a changed config: %s", run_dir,
                    "; ".join(f"{k}: {o!r} -> {n!r}" for k, (o, n) in changes.items()))
    return changes
