"""[data]: the prompt files, synthetic tasks, and sequence lengths."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from spmd_rl.config.checks import Rule, need

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

    def check(self) -> None:
        """The data files exist (with `synthetic_task`: the run's own, written at start and placed in
        these keys by spmd_rl/preflight/synthetic_data.py) and the sizes are positive."""
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
