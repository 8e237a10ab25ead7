"""[algorithm]: advantage estimation, the KL reward penalty, rollout correction, dynamic sampling."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from spmd_rl.config.checks import Rule, need

if TYPE_CHECKING:
    from spmd_rl.config.run_config import Config

CHOICES: dict[str, tuple[str, ...]] = {
    "adv_estimator": ("gae", "grpo", "rloo", "reinforce_plus_plus"),
    "kl_penalty": ("k1", "k2", "k3", "low_var_kl", "abs"),
    "kl_ctrl": ("fixed", "adaptive"),
    "rollout_is": ("", "token", "sequence", "geometric"),
    "rollout_mask": ("", "token", "sequence", "geometric"),
}
"""Each key that takes one of a few values: its values (checked by Config.check_choices)."""


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"
    """gae (PPO with critic), grpo, rloo or reinforce_plus_plus."""
    gamma: float = 1.0
    """Discount (GAE, REINFORCE++)."""
    lam: float = 1.0
    """GAE lambda."""
    norm_adv_by_std_in_grpo: bool = True
    """GRPO: divide by the group's std; false = Dr. GRPO (mean-centring only)."""
    use_kl_in_reward: bool = False
    """Subtract kl_coef * KL(actor || reference) from the token rewards."""
    kl_penalty: str = "k1"
    """KL estimator of the reward penalty: k1, k2, k3 / low_var_kl, abs."""
    kl_ctrl: str = "fixed"
    """Reward-penalty coefficient controller: fixed or adaptive (Ziegler et al.)."""
    kl_coef: float = 0.001
    """(Initial) KL penalty coefficient."""
    target_kl: float = 0.1
    """Adaptive controller: the KL it steers towards."""
    kl_horizon: int = 10000
    """Adaptive controller: horizon (in samples) of its proportional update."""
    rollout_is: str = ""
    """Rollout-mismatch correction, truncated importance sampling (TIS, Yao et al. 2025): the
    actor's loss is weighted by min(pi_old / pi_engine, rollout_is_threshold) of each "token", of
    each "sequence" (product of token ratios) or "geometric" (their geometric mean); "" = off."""
    rollout_is_threshold: float = 2.0
    """Cap C of the truncated IS weight (TIS uses 2)."""
    rollout_mask: str = ""
    """Rollout-mismatch correction, masked IS (ICE-POP style): drop from the actor's loss (numerator
    and denominator) each "token", "sequence" or "geometric" (sequence by geometric mean) whose ratio
    pi_old / pi_engine lies outside [rollout_mask_low, rollout_mask_high]; "" = off."""
    rollout_mask_low: float = 0.5
    """Lower bound of the kept ratio (IcePop uses 0.5)."""
    rollout_mask_high: float = 2.0
    """Upper bound of the kept ratio (IcePop uses 2)."""
    rollout_reject_sequences: bool = False
    """Drop every sequence holding any token whose ratio is outside [rollout_mask_low,
    rollout_mask_high] (verl's token veto), with or without rollout_mask."""
    dynamic_sampling: bool = False
    """DAPO dynamic sampling (Yu et al. 2025): drop prompt groups whose rewards are all equal (no
    GRPO signal) and generate more batches until data.train_batch_size informative groups are
    collected (the surplus is discarded)."""
    dynamic_sampling_max_rounds: int = 10
    """DAPO: most generation rounds per step (1 = no extra round); when reached, the step is
    filled up with uninformative groups (metric dynamic_sampling/padded_groups) and a warning."""
    overlong_filtering: bool = False
    """DAPO overlong filtering: responses cut at data.max_response_length leave the actor's loss."""

    def check(self, n: int) -> None:
        """The estimator fits `n` = rollout.n samples per prompt; discounts, rollout-correction bounds
        and DAPO dynamic sampling in range."""
        if self.adv_estimator in ("grpo", "rloo"):
            need(n >= 2, f"algorithm.adv_estimator = {self.adv_estimator!r} compares samples of one prompt: "
                  f"set rollout.n >= 2 (got {n})")
        need(0 <= self.gamma <= 1 and 0 <= self.lam <= 1, "algorithm.gamma and algorithm.lam must be in [0, 1]")
        need(self.rollout_is_threshold > 0, "algorithm.rollout_is_threshold must be > 0 (TIS uses 2)")
        need(0 < self.rollout_mask_low <= 1,
              f"algorithm.rollout_mask_low = {self.rollout_mask_low} must be in (0, 1] (IcePop uses 0.5)")
        need(self.rollout_mask_high >= 1,
              f"algorithm.rollout_mask_high = {self.rollout_mask_high} must be >= 1 (IcePop uses 2)")
        need(self.dynamic_sampling_max_rounds >= 1, "algorithm.dynamic_sampling_max_rounds must be >= 1")
        if self.dynamic_sampling:
            need(self.adv_estimator in ("grpo", "rloo"), "algorithm.dynamic_sampling filters prompt groups: use "
                  f"algorithm.adv_estimator = grpo or rloo (got {self.adv_estimator!r})")

    def ranges(self, cfg: Config) -> list[Rule]:
        return [("kl_coef", self.kl_coef >= 0, ">= 0"), ("target_kl", self.target_kl > 0, "> 0"),
                ("kl_horizon", self.kl_horizon > 0, "> 0")]
