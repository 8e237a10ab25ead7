"""[data]: the prompt files, synthetic tasks, and sequence lengths."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from spmd_rl.config.checks import Rule, need
from spmd_rl.errors import ConfigError

if TYPE_CHECKING:
    from spmd_rl.config.run_config import Config

CHOICES: dict[str, tuple[str, ...]] = {
    "synthetic_task": ("", "successor", "arithmetic", "hidden"),
}
"""Each key that takes one of a few values: its values (checked by Config.check_choices)."""


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)
    """Training Parquet files (schema: docs/data.md). Empty with `synthetic_task`: the run's own."""
    val_files: list[str] = field(default_factory=list)
    """Held-out Parquet files for validation; empty = no validation (with `synthetic_task`: the run's
    own validation file)."""
    synthetic_task: str = ""
    """Train on an offline synthetic task instead of files of yours: "successor" (learnable by a tiny
    random model), "arithmetic" (word problems with exact answers) or "hidden" (a random digit only an
    environment reveals: spmd_rl/envs/hidden_digit.py). Rank 0 writes the data under the run
    directory, `<run_dir>/data/train.parquet` and `val.parquet`, before anything else runs, and a
    restart reuses them; nothing outside the run directory is ever written. `train_files` and
    `val_files` must then be empty (or name exactly those files): to train on your own files, set
    this to "" (a preset such as tiny-cpu sets it). scripts/make_synthetic.py writes the same data
    anywhere you choose."""
    synthetic_size: int = 2048
    """Number of training rows written for `synthetic_task` (validation gets a quarter)."""
    train_batch_size: int = 8
    """Prompts per training step, global over all ranks (each prompt gets `rollout.n` samples)."""
    max_prompt_length: int = 512
    """Prompts longer than this many tokens are dropped when the data is loaded (count logged)."""
    max_response_length: int = 256
    """Most tokens generated per response."""
    shuffle: bool = True
    """Reshuffle the training data every epoch (deterministic in `trainer.seed` and the epoch)."""
    apply_chat_template: bool = True
    """Render chat-message prompts with the tokenizer's chat template (plain-text prompts are
    tokenized as they are)."""
    val_batch_size: int = 64
    """Prompts per validation generation call, global."""

    def synthetic_recipe(self, seed: int) -> dict:
        """What `synthetic_task` writes (spmd_rl/data/synthetic.py records it beside the files)."""
        from spmd_rl.data.synthetic import recipe

        return recipe(self.synthetic_task, self.synthetic_size, max(1, self.synthetic_size // 4), seed)

    def place_synthetic(self, run_dir: str, seed: int) -> None:
        """With `synthetic_task`: the data files become the run's own (<run_dir>/data/train.parquet and
        val.parquet). A file named in `train_files` / `val_files` that is not the run's own is refused,
        so no user file is ever written or trained on in its place; so is a run directory whose
        synthetic files were written with another task, size or seed."""
        if not self.synthetic_task:
            return
        from spmd_rl.data.synthetic import RECIPE_FILE, recorded_recipe, run_data_files

        own = run_data_files(run_dir)
        for key, files, path in (("data.train_files", self.train_files, own[0]),
                                 ("data.val_files", self.val_files, own[1])):
            foreign = [f for f in files if os.path.abspath(f) != os.path.abspath(path)]
            if foreign:
                raise ConfigError(f"{key} names {foreign[0]!r} but data.synthetic_task = {self.synthetic_task!r} trains "
                                  f"on synthetic data the run writes under its own directory ({path}): to train on your "
                                  f'files set data.synthetic_task="" (the preset sets it); for synthetic data leave '
                                  f"{key} empty")
        self.train_files, self.val_files = [own[0]], [own[1]]
        recorded, want = recorded_recipe(run_dir), self.synthetic_recipe(seed)
        need(recorded is None or recorded == want,
             f"{os.path.join(os.path.dirname(own[0]), RECIPE_FILE)} says this run's synthetic data was written as "
             f"{recorded}, but the config asks for {want} (data.synthetic_task, data.synthetic_size, trainer.seed): "
             "set them back, or start a new trainer.run_dir")

    def check(self) -> None:
        """The data files exist (with `synthetic_task`: the run's own, written at start) and the sizes
        are positive."""
        need(bool(self.train_files), "data.train_files is empty: list at least one Parquet file, or set "
             "data.synthetic_task for a synthetic task")
        for f in self.train_files + self.val_files:
            need(not os.path.isdir(f), f"data file {f!r} is a directory: list the Parquet files in it in "
                  "data.train_files / data.val_files")
        if not self.synthetic_task:
            for f in self.train_files + self.val_files:
                need(os.path.isfile(f), f"data file {f!r} does not exist: fix data.train_files / data.val_files")
        need(self.train_batch_size > 0, "data.train_batch_size must be > 0")
        need(self.max_prompt_length > 0 and self.max_response_length > 0,
              "data.max_prompt_length and data.max_response_length must be > 0")

    def check_layout(self, world_size: int) -> None:
        need(self.train_batch_size % world_size == 0,
              f"data.train_batch_size = {self.train_batch_size} does not divide by the {world_size} ranks: "
              f"make it a multiple of {world_size}")

    def ranges(self, cfg: Config) -> list[Rule]:
        return [("val_batch_size", self.val_batch_size > 0, "> 0"),
                ("synthetic_size", not self.synthetic_task or self.synthetic_size >= self.train_batch_size,
                 ">= data.train_batch_size (one batch at least)")]
