"""[reward]: how responses are scored."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from spmd_rl.config.checks import Rule, need

if TYPE_CHECKING:
    from spmd_rl.config.run_config import Config

CHOICES: dict[str, tuple[str, ...]] = {
    "gsm8k_method": ("strict", "flexible"),
    "on_error": ("fail", "zero"),
}
"""Each key that takes one of a few values: its values (checked by Config.check_choices)."""


@dataclass
class RewardConfig:
    custom_function: str = ""
    """A user scorer, "package.module:function" (importable) or "path/to/file.py:function" (a file,
    relative to the working directory), called as fn(data_source, response_text, ground_truth,
    extra_info) -> float or dict with key "score" (and "acc"); empty = the built-in rule scorers
    chosen by each row's data_source (GSM8K's, the synthetic tasks'). docs/own-task.md,
    examples/my_task/reward.py."""
    gsm8k_method: str = "strict"
    """GSM8K answer extraction: "strict" (the "#### N" line) or "flexible" (last number)."""
    format_bonus: float = 0.0
    """Added to the score when the response has the expected answer format (0 = off)."""
    overlong_buffer: int = 0
    """DAPO overlong reward shaping (Yu et al. 2025): responses longer than
    data.max_response_length - overlong_buffer tokens get a penalty growing linearly to
    -overlong_penalty_factor at the limit (0 = off)."""
    overlong_penalty_factor: float = 1.0
    """DAPO: the penalty at data.max_response_length tokens."""
    rule_weight: float = 1.0
    """The rule or custom reward (or a multi-turn environment's, where it gives one) counts this
    much in the score: score = rule_weight * rule + reward_model.weight * reward model (without a
    reward model: rule_weight * rule). It is computed whatever the weight (reward/acc, reward/rule_mean)."""
    on_error: str = "fail"
    """What a scorer that raises or returns a non-number does: "fail" stops the run with one line
    naming the data source, row and response; "zero" scores that response 0 and counts it in the
    metric reward/errors."""
    warn_error_share: float = 0.05
    """With on_error = "zero": one warning line when the scorer fails on more than this share of a
    training step's responses, naming the count, the share, the first failure and the fix; said again
    only when the share doubles or after 50 steps (the rule: spmd_rl/telemetry/reward_errors.py).
    0 = warn at any failure; 1 = never."""

    def check(self, max_response_length: int) -> None:
        """DAPO's overlong shaping within `max_response_length` = data.max_response_length."""
        need(self.overlong_penalty_factor >= 0,
              f"reward.overlong_penalty_factor = {self.overlong_penalty_factor} must be >= 0 (DAPO uses 1.0)")
        need(0 <= self.overlong_buffer < max_response_length,
              "reward.overlong_buffer must be in [0, data.max_response_length) (0 = off)")

    def ranges(self, cfg: Config) -> list[Rule]:
        return [("format_bonus", self.format_bonus >= 0, ">= 0 (0 = off)"),
                ("rule_weight", self.rule_weight >= 0, ">= 0 (0 = the reward model alone)"),
                ("warn_error_share", 0 <= self.warn_error_share <= 1, "in [0, 1] (1 = never warn)")]
