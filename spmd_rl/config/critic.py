"""[critic]: the value model of PPO with GAE (algorithm.adv_estimator = "gae")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from spmd_rl.config.checks import Rule

if TYPE_CHECKING:
    from spmd_rl.config.run_config import Config
from spmd_rl.config.actor import TrainedModel

CHOICES: dict[str, tuple[str, ...]] = {
    "loss_agg_mode": ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"),
}
"""Each key that takes one of a few values: its values (checked by Config.check_choices)."""


@dataclass
class CriticConfig(TrainedModel):
    path: str = ""
    """Model directory for the critic's backbone; empty = the actor's model."""
    lr: float = 1e-5
    """AdamW learning rate of the critic."""
    weight_decay: float = 0.0
    """AdamW weight decay of the critic."""
    warmup_steps: int = 0
    """Linear warm-up steps of the critic's learning rate."""
    grad_clip: float = 1.0
    """Clip the critic's global gradient norm (0 = off)."""
    ppo_mini_batch_size: int = 8
    """Prompts per critic optimizer step, global."""
    micro_batch_size_per_gpu: int = 0
    """Sequences per critic forward/backward on one GPU when micro-batches are counted in
    sequences; 0 = `actor.micro_batch_size_per_gpu`."""
    ppo_epochs: int = 1
    """Passes of the critic over each step's rollouts."""
    cliprange_value: float = 0.5
    """Value clipping around the old values (0 = no clipping)."""
    loss_agg_mode: str = "token-mean"
    """Aggregation of the value loss (same modes as the actor)."""
    max_token_len_per_gpu: int = -1
    """Token budget of one critic-update micro-batch on one GPU (see actor.max_token_len_per_gpu);
    -1 = the actor's (`actor.max_token_len_per_gpu`: the critic is the same size of model on the
    same sequences), 0 = micro-batches of `micro_batch_size_per_gpu` sequences."""
    forward_max_token_len_per_gpu: int = 0
    """Token budget of the no-grad value pass per micro-batch; 0 = twice the critic's update budget
    (after taking the actor's)."""

    def ranges(self, cfg: Config) -> list[Rule]:
        if not cfg.use_critic:
            return []
        return [("lr", self.lr > 0, "> 0"), ("weight_decay", self.weight_decay >= 0, ">= 0"),
                ("warmup_steps", self.warmup_steps >= 0, ">= 0"), ("grad_clip", self.grad_clip >= 0, ">= 0"),
                ("cliprange_value", self.cliprange_value >= 0, ">= 0 (0 = no clipping)")]
