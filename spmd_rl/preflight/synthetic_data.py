"""A synthetic task's data placed under the run's directory (called by preflight.validate; written
by rank 0 at start: build.build_data, spmd_rl/data/synthetic.py)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from spmd_rl.config.checks import need
from spmd_rl.data.synthetic import RECIPE_FILE, recipe, recorded_recipe, run_data_files
from spmd_rl.errors import ConfigError

if TYPE_CHECKING:
    from spmd_rl.config.run_config import Config


def synthetic_recipe(cfg: Config) -> dict:
    """What data.synthetic_task writes (spmd_rl/data/synthetic.py records it beside the files)."""
    d = cfg.data
    return recipe(d.synthetic_task, d.synthetic_size, max(1, d.synthetic_size // 4), cfg.trainer.seed)


def place_synthetic(cfg: Config) -> None:
    """With data.synthetic_task: the data files become the run's own (<run_dir>/data/train.parquet and
    val.parquet). A file named in data.train_files / data.val_files that is not the run's own is
    refused, so no user file is ever written or trained on in its place; so is a run directory whose
    synthetic files were written with another task, size or seed."""
    d, run_dir = cfg.data, cfg.run_dir
    if not d.synthetic_task:
        return
    own = run_data_files(run_dir)
    for key, files, path in (("data.train_files", d.train_files, own[0]),
                             ("data.val_files", d.val_files, own[1])):
        foreign = [f for f in files if os.path.abspath(f) != os.path.abspath(path)]
        if foreign:
            raise ConfigError(f"{key} names {foreign[0]!r} but data.synthetic_task = {d.synthetic_task!r} trains "
                              f"on synthetic data the run writes under its own directory ({path}): to train on your "
                              f'files set data.synthetic_task="" (the preset sets it); for synthetic data leave '
                              f"{key} empty")
    d.train_files, d.val_files = [own[0]], [own[1]]
    recorded, want = recorded_recipe(run_dir), synthetic_recipe(cfg)
    need(recorded is None or recorded == want,
         f"{os.path.join(os.path.dirname(own[0]), RECIPE_FILE)} says this run's synthetic data was written as "
         f"{recorded}, but the config asks for {want} (data.synthetic_task, data.synthetic_size, trainer.seed): "
         "set them back, or start a new trainer.run_dir")
