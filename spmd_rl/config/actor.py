"""[actor]: policy optimisation, and the batch layout the actor and the critic share
(TrainedModel.check_batches)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from spmd_rl.config.checks import AUTO, Auto, Rule, need

if TYPE_CHECKING:
    from spmd_rl.config.run_config import Config

CHOICES: dict[str, tuple[str, ...]] = {
    "lr_schedule": ("constant", "cosine"),
    "loss_agg_mode": ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"),
    "kl_loss_type": ("k1", "k2", "k3", "low_var_kl", "abs"),
    "policy_loss": ("vanilla", "ppo", "gspo", "cispo"),
    "router_replay": ("engine", "off"),
}
"""Each key that takes one of a few values: its values (checked by Config.check_choices)."""


class TrainedModel:
    """What the actor and critic sections share: the layout of a PPO update (Config.micro_batching)."""

    def mini_batch_rows(self, n: int, ranks: int) -> int:
        """Sequences of one of its mini-batches on each of `ranks` ranks: ppo_mini_batch_size
        prompts x `n` samples (rollout.n), split evenly (check_batches: they divide). The update
        splits them over the data-parallel ranks (world / trainer.ulysses_size: a sequence-parallel
        group shares its rows); the rank balancing before that share, over all ranks."""
        return self.ppo_mini_batch_size * n // ranks

    def check_batches(self, cfg: Config, role: str, world_size: int) -> None:
        """`role`'s mini-batches divide the step and the ranks, its micro-batches the mini-batch;
        its token budgets hold the longest sequence."""
        d, r, m = cfg.data, cfg.rollout, cfg.model
        mini = self.ppo_mini_batch_size
        need(mini > 0 and d.train_batch_size % mini == 0,
              f"{role}.ppo_mini_batch_size = {mini} must divide data.train_batch_size = {d.train_batch_size}")
        seqs = mini * r.n
        need(seqs % world_size == 0,
              f"{role}.ppo_mini_batch_size * rollout.n = {seqs} sequences do not divide by the {world_size} ranks: "
              f"make {role}.ppo_mini_batch_size a multiple of {world_size}")
        sp = max(cfg.trainer.ulysses_size, 1)  # the ranks of a sequence-parallel group share their rows
        per_rank = self.mini_batch_rows(r.n, world_size // sp)  # check_ulysses: sp divides the world
        rows = cfg.micro_batching(role).rows
        inherited = " (actor.micro_batch_size_per_gpu, taken as critic.micro_batch_size_per_gpu = 0)" if (
            role == "critic" and not self.micro_batch_size_per_gpu) else ""
        ranks = "ranks" if sp == 1 else "data-parallel ranks"
        need(rows > 0 and per_rank % rows == 0,
              f"{role}.micro_batch_size_per_gpu = {rows}{inherited} must divide the "
              f"{per_rank} sequences per rank of a mini-batch ({role}.ppo_mini_batch_size * rollout.n / {ranks})")
        need(self.ppo_epochs >= 1, f"{role}.ppo_epochs must be >= 1")
        budgets = {"max_token_len_per_gpu": self.max_token_len_per_gpu}
        budgets.update({k: getattr(self, k) for k in ("logprob_max_token_len_per_gpu", "forward_max_token_len_per_gpu")
                        if hasattr(self, k)})
        if role == "critic" and self.max_token_len_per_gpu == -1:  # the actor's, checked as the actor's
            budgets.pop("max_token_len_per_gpu")
        longest = d.max_prompt_length + d.max_response_length
        for key, budget in budgets.items():
            if budget == AUTO:  # chosen at start (preflight.speed_settings), within these rules
                continue
            floor = -1 if (role, key) == ("critic", "max_token_len_per_gpu") else 0
            need(budget >= floor, f"{role}.{key} must be >= 0 (0 = off)" + (", or -1 = the actor's" if floor else ""))
            if budget:
                need(m.remove_padding, f"{role}.{key} = {budget} builds micro-batches by tokens, which needs packed "
                      "sequences: set model.remove_padding = true (or the budget to 0)")
                if sp == 1:
                    need(budget >= longest, f"{role}.{key} = {budget} is below the longest possible sequence "
                          f"(data.max_prompt_length + data.max_response_length = {longest}): raise it to at least "
                          f"{longest}")
                else:  # a micro-batch of an SP group holds sp GPUs' budgets
                    need(budget * sp >= longest, f"{role}.{key} = {budget} x trainer.ulysses_size = {sp} is below "
                          f"the longest possible sequence (data.max_prompt_length + data.max_response_length = "
                          f"{longest}): raise it to at least {-(-longest // sp)}")


@dataclass
class ActorConfig(TrainedModel):
    lr: float = 1e-6
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas."""
    warmup_steps: int = 0
    """Linear warm-up steps of the learning rate."""
    lr_schedule: str = "constant"
    """"constant" or "cosine" (to `min_lr_ratio` * lr at `trainer.total_steps`)."""
    min_lr_ratio: float = 0.0
    """Final learning rate of the cosine schedule, as a fraction of lr."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0 = no clipping)."""
    ppo_mini_batch_size: int = 8
    """Prompts per optimizer step, global (times `rollout.n` sequences). Must divide
    `data.train_batch_size`."""
    micro_batch_size_per_gpu: int = 4
    """Sequences per forward/backward on one GPU (gradient accumulation makes up the rest)."""
    ppo_epochs: int = 1
    """Passes over each step's rollouts."""
    clip_ratio_low: float = 0.2
    """PPO ratio clip below 1 (ratio >= 1 - clip_ratio_low)."""
    clip_ratio_high: float = 0.2
    """PPO ratio clip above 1 (ratio <= 1 + clip_ratio_high; DAPO's clip-higher uses 0.28)."""
    clip_ratio_c: float = 3.0
    """Dual-clip constant for negative advantages (> 1; 0 = no dual clip)."""
    loss_agg_mode: str = "token-mean"
    """token-mean, seq-mean-token-sum or seq-mean-token-mean, over the global mini-batch."""
    entropy_coeff: float = 0.0
    """Entropy bonus weight (the loss subtracts entropy_coeff * entropy)."""
    use_kl_loss: bool = False
    """Add a KL(actor || reference) loss term (GRPO style) instead of / besides a reward penalty."""
    kl_loss_coef: float = 0.001
    """Weight of the KL loss."""
    kl_loss_type: str = "low_var_kl"
    """KL estimator for the loss: k1, k2, k3 / low_var_kl (k3 clamped to [-10, 10]), abs."""
    max_token_len_per_gpu: int | Auto = 0
    """Token budget of one actor-update micro-batch on one GPU (verl's dynamic batch size): each
    mini-batch is cut into as few micro-batches as keep every one within this many real tokens,
    sequences balanced across them, the same count on every rank. Needs model.remove_padding.
    0 = micro-batches of `micro_batch_size_per_gpu` sequences. Must be >= data.max_prompt_length
    + data.max_response_length. Take the largest that fits: each micro-batch costs launches and
    idle GPU time, so fewer, larger ones are faster (docs/performance.md, "Why the defaults are
    what they are"). The presets' values are measured for 80 GB GPUs; the start-up memory line
    predicts the peak of a budget before anything loads. "auto": the largest the memory plan
    predicts to fit, up to the tokens of one GPU's mini-batch (docs/training.md, "Speed settings
    chosen at start"); 0 without model.remove_padding or without a GPU."""
    logprob_max_token_len_per_gpu: int | Auto = 0
    """Token budget of the no-grad log-prob passes (old log-probs, reference) per micro-batch;
    0 = twice `max_token_len_per_gpu` (no activations are kept for a backward). "auto": the largest
    the memory plan predicts to fit, up to the tokens of one GPU's share of the step; 0 without
    model.remove_padding or without a GPU."""
    force_old_logprob_pass: bool = False
    """Always compute the old policy's log-probs in a separate no-grad pass before the update. By
    default an on-policy step (ppo_epochs = 1, ppo_mini_batch_size = data.train_batch_size, no
    algorithm.use_kl_in_reward, rollout_mask or rollout_reject_sequences) takes them from the
    update's own forward, detached, and skips the pass (TRL's num_iterations = 1): the same update
    up to rounding (spmd_rl/train/old_logprobs.py). The start-up line says which path a run takes."""
    offload_optimizer: bool | Auto = False
    """Keep the optimizer state (AdamW moments: 8 bytes per parameter, sharded) in CPU memory and
    bring it to the GPU only for each optimizer step: the forward/backward passes get that memory,
    each optimizer step pays two host<->device copies. "auto": on only where the memory plan
    predicts no fit without it; false without a GPU."""
    policy_loss: str = "vanilla"
    """Policy loss: "vanilla" (= "ppo": the clipped PPO surrogate with clip_ratio_low/high/c),
    "gspo" (GSPO, Zheng et al. 2025: one geometric-mean ratio per sequence, clipped per sequence
    with gspo_clip_ratio_low/high; the paper aggregates "seq-mean-token-mean"), or "cispo" (CISPO,
    MiniMax-M1 2025: stop-gradient IS weight min(ratio, 1 + cispo_clip_ratio_high) times log-prob)."""
    gspo_clip_ratio_low: float = 3e-4
    """GSPO: sequence ratio clip below 1 (the GSPO paper's 3e-4)."""
    gspo_clip_ratio_high: float = 4e-4
    """GSPO: sequence ratio clip above 1 (the GSPO paper's 4e-4)."""
    cispo_clip_ratio_high: float = 4.0
    """CISPO: the IS weight is capped at 1 + this (no lower cap, as MiniMax-M1)."""
    router_replay: str = "engine"
    """Mixture-of-experts models: which experts the training forwards (old log-probs, update,
    reference) send each token to. "engine" (rollout routing replay, R3): the experts the rollout
    engine chose for it, weighted by the trainer's own router probabilities at them (so the router
    still learns); a token the engine returned no routing for routes as the trainer decides
    (metric routing/replayed_share). It keeps the trainer's and the engine's token probabilities
    close, which MoE RL runs need to stay stable. "off": the trainer's own routing. On a dense
    model either is a no-op. docs/moe.md, "Routing replay"."""

    router_aux_loss_coef: float = 0.0
    """Mixture-of-experts models: the weight of the router's load-balancing loss (transformers' own,
    over every MoE layer's router probabilities of the micro-batch's real tokens) added to the policy
    loss; logged as actor/router_aux_loss. 0 (default, as in RL recipes): off, and no router logits are
    kept. Pre-training used about 0.001. Refused on a dense model and on sigmoid routers (GLM-4.7-Flash's,
    balanced by their score correction bias). docs/moe.md."""

    def check_loss(self) -> None:
        """The policy loss's clip ratios and the optimizer's betas."""
        need(self.router_aux_loss_coef >= 0, f"actor.router_aux_loss_coef = {self.router_aux_loss_coef} must be >= 0 "
             "(0: off)")
        for side in ("low", "high"):  # 0 freezes the policy on that side: ratio 1 is already clipped
            need(getattr(self, f"clip_ratio_{side}") > 0, f"actor.clip_ratio_{side} = {getattr(self, f'clip_ratio_{side}')} "
                  f"must be > 0: with 0 the clipped loss has no gradient on that side, so the policy can never move "
                  "there (0.2 is usual)")
        need(self.clip_ratio_low < 1, f"actor.clip_ratio_low = {self.clip_ratio_low} must be < 1 (the ratio is positive)")
        need(self.clip_ratio_c == 0 or self.clip_ratio_c > 1, "actor.clip_ratio_c must be > 1 (or 0 to turn dual clip off)")
        need(len(self.betas) == 2, "actor.betas must be two numbers, e.g. [0.9, 0.999]")
        for key in ("gspo_clip_ratio_low", "gspo_clip_ratio_high", "cispo_clip_ratio_high"):
            need(getattr(self, key) >= 0, f"actor.{key} = {getattr(self, key)} must be >= 0")

    def ranges(self, cfg: Config) -> list[Rule]:
        return [
            ("lr", self.lr > 0, "> 0"), ("weight_decay", self.weight_decay >= 0, ">= 0"),
            ("betas", all(0 <= b < 1 for b in self.betas), "in [0, 1) each"),
            ("warmup_steps", self.warmup_steps >= 0, ">= 0"),
            ("min_lr_ratio", 0 <= self.min_lr_ratio <= 1, "in [0, 1]"),
            ("grad_clip", self.grad_clip >= 0, ">= 0 (0 = no clipping)"),
            ("entropy_coeff", self.entropy_coeff >= 0, ">= 0"), ("kl_loss_coef", self.kl_loss_coef >= 0, ">= 0"),
        ]
