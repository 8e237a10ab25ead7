"""The user's code the config names, imported and checked (called by preflight.validate): the tools,
tool parser and environment of a multi-turn rollout. (The reward function is imported where it is
built: data.rewards.RewardFunction.)"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from spmd_rl.config.run_config import Config


def check_multi_turn_code(cfg: Config) -> None:
    """The tools, tool parser and environment the rollout keys name import and have what the loop needs."""
    if cfg.rollout.multi_turn:
        from spmd_rl.rollout.multiturn import check_config

        check_config(cfg.rollout)
