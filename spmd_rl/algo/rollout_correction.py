"""Rollout-mismatch correction: importance weights between the actor and the rollout engine.

The engine samples a token from mu (vLLM kernels, bf16, another batch shape), the actor's FSDP
forward gives pi_old for the same token; the policy loss assumes they are the same distribution.
The per-token log-ratio log(pi_old / mu) = old_logprobs - rollout_logprobs ("actor - engine")
measures the mismatch, and these functions turn it into

- truncated importance sampling (TIS, Yao et al. 2025, "Your Efficient RL Framework Secretly
  Brings You Off-Policy RL Training"): a weight min(ratio, C) multiplying the per-token policy
  loss; per token ("token"), or one weight per sequence from the product of the token ratios
  ("sequence", exp(sum of log-ratios)) or their geometric mean ("geometric", exp(mean));
- masked importance sampling (ICE-POP, Ling team 2025; verl's rollout rejection sampling):
  tokens ("token") or whole sequences ("sequence" / "geometric") whose ratio lies outside
  [low, high] leave the loss; optionally every sequence that holds any such token is rejected.

Masked tokens must leave the loss's denominator as well as its numerator (slime fixed exactly
this bug): the trainer folds `keep` into the response mask of the actor's update, so
`agg_loss` and `update.global_denominator` count only the kept tokens (and kept sequences).

All tensors are [B, L] aligned with input_ids (see spmd_rl/batching/batch.py); `mask` is the response mask.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from spmd_rl.algo.algorithms import kl_penalty, masked_mean, masked_sum
from spmd_rl.batching.batch import Batch
from spmd_rl.runtime.distributed import all_reduce_sum

LEVELS = ("", "token", "sequence", "geometric")
_MAX_LOG = 20.0  # exp(20) ~ 5e8: one absurd token cannot overflow a weight or a metric


@dataclass
class Correction:
    weights: torch.Tensor
    """[B, L] importance weight per token (1 where no IS is asked for; 0 outside the mask)."""
    keep: torch.Tensor
    """[B, L] 1.0 on the response tokens that stay in the loss."""


def log_ratio(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log(pi_old / mu) per token, float32 or wider, 0 outside the mask."""
    dtype = torch.promote_types(torch.float32, torch.promote_types(old_logprobs.dtype, rollout_logprobs.dtype))
    lr = old_logprobs.to(dtype) - rollout_logprobs.to(dtype)
    return torch.where(mask > 0, lr, 0.0)


def level_log_ratio(lr: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """[B, L] log-ratio at `level`: the token's own ("token"), the sum over the sequence's tokens
    ("sequence", log of the product of ratios) or their mean ("geometric"), broadcast to every
    token of the row. Clamped to [-20, 20]."""
    if level == "token":
        out = lr
    elif level in ("sequence", "geometric"):
        seq = masked_sum(lr, mask, dim=-1)
        if level == "geometric":
            seq = seq / mask.sum(-1).clamp_min(1.0).to(seq.dtype)
        out = seq[:, None].expand_as(lr)
    else:
        raise ValueError(f"unknown rollout correction level {level!r}: choose one of {', '.join(LEVELS[1:])}")
    return out.clamp(-_MAX_LOG, _MAX_LOG)


def truncated_is_weights(level_lr: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """TIS weight min(exp(level log-ratio), threshold) (no gradient: the weights are data), 0 outside the mask."""
    w = torch.exp(level_lr.clamp(max=math.log(threshold)))
    return torch.where(mask > 0, w, 0.0)


def is_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor, level: str,
               threshold: float) -> torch.Tensor:
    """[B, L] TIS weights at `level` (what `correct` gives without masking), 0 outside the mask. Each
    row's weights depend on that row alone: any split of the rows (micro-batches) gives the same."""
    lr = log_ratio(old_logprobs, rollout_logprobs, mask)
    return truncated_is_weights(level_log_ratio(lr, mask, level), mask, threshold)


def in_bounds(level_lr: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """[B, L] bool: low <= ratio <= high, compared in log space (no overflow)."""
    return (level_lr >= math.log(low)) & (level_lr <= math.log(high))


def correct(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor, *, is_level: str,
            is_threshold: float, mask_level: str, mask_low: float, mask_high: float,
            reject_sequences: bool) -> tuple[Correction, dict[str, torch.Tensor]]:
    """IS weights and kept tokens of one batch, and per-rank metrics (0-dim tensors):

    is_weight_mean (over kept tokens), is_weight_max, truncated_frac (tokens whose weight was
    capped), token_masked_frac / seq_masked_frac (response tokens / whole sequences removed from
    the loss), chi2_token = mean(ratio^2) - 1 and chi2_seq = mean over sequences of
    prod(ratio)^2 - 1 (sample estimates of chi^2(pi_old || mu) under mu, which sampled the
    tokens), ppl_actor, ppl_engine and ppl_ratio = ppl_actor / ppl_engine (token-mean perplexities).
    """
    keep_b = mask > 0
    lr = log_ratio(old_logprobs, rollout_logprobs, mask)
    keep = keep_b.clone()
    if mask_level:
        keep &= in_bounds(level_log_ratio(lr, mask, mask_level), mask_low, mask_high)
    if reject_sequences:
        token_ok = in_bounds(lr.clamp(-_MAX_LOG, _MAX_LOG), mask_low, mask_high) | ~keep_b
        keep &= token_ok.all(dim=-1, keepdim=True)
    if is_level:
        level_lr = level_log_ratio(lr, mask, is_level)
        weights = truncated_is_weights(level_lr, mask, is_threshold)
        truncated = (level_lr > math.log(is_threshold)) & keep_b
    else:
        weights = keep_b.to(lr.dtype)
        truncated = torch.zeros_like(keep_b)
    keep_f = keep.to(lr.dtype)
    rows = keep_b.any(-1)
    n_rows = rows.sum().clamp_min(1)
    seq_lr = masked_sum(lr, mask, dim=-1).clamp(-_MAX_LOG, _MAX_LOG)
    mean_old = masked_mean(old_logprobs, mask)
    mean_engine = masked_mean(rollout_logprobs, mask)
    metrics = {
        "is_weight_mean": masked_mean(weights, keep_f),
        "is_weight_max": (weights * keep_f).max() if weights.numel() else weights.new_zeros(()),
        "truncated_frac": masked_mean(truncated.to(lr.dtype), mask),
        "token_masked_frac": masked_mean((keep_b & ~keep).to(lr.dtype), mask),
        "seq_masked_frac": (rows & ~keep.any(-1)).sum() / n_rows,
        "chi2_token": masked_mean(torch.exp(2 * lr.clamp(-_MAX_LOG, _MAX_LOG)), mask) - 1.0,
        "chi2_seq": torch.where(rows, torch.exp(2 * seq_lr), 0.0).sum() / n_rows - 1.0,
        "ppl_actor": torch.exp(-mean_old),
        "ppl_engine": torch.exp(-mean_engine),
        "ppl_ratio": torch.exp(mean_engine - mean_old),
    }
    return Correction(weights=torch.where(keep, weights, 0.0), keep=keep_f), metrics


def actor_update_batch(batch: Batch, alg, device: torch.device | None = None,
                       correct_rollout: bool = True) -> tuple[Batch, dict[str, float]]:
    """The batch the actor's update sees: response_mask without the tokens that must leave the
    loss (DAPO overlong filtering: responses cut at the length limit; rollout-correction masks),
    and `rollout_is_weights` when IS is on. The original batch (metrics, critic) is untouched.

    `correct_rollout = False`: the batch has no old log-probs yet (they come from the update's
    forward, spmd_rl/train/old_logprobs.py): no rollout correction here and no rollout_corr/* metrics;
    the update computes the IS weights per micro-batch. Masks cannot wait for the update (they
    change its denominator): asking for one then is an error.

    `alg` is the AlgorithmConfig. Metrics are `rollout_corr/*` averaged over ranks, with
    `rollout_corr/is_weight_max` the max over ranks, and `response/overlong_filtered_frac`.
    """
    mask = batch["response_mask"]
    tensors = dict(batch.tensors)
    local: dict[str, torch.Tensor] = {}
    if alg.overlong_filtering:
        # DAPO: a truncated response has no final answer; its tokens get no learning signal either way
        truncated = ~batch["finished"]
        local["response/overlong_filtered_frac"] = truncated.float().mean()
        mask = mask * (~truncated).to(mask.dtype)[:, None]
    if not correct_rollout and (alg.rollout_mask or alg.rollout_reject_sequences):
        raise ValueError("rollout_mask / rollout_reject_sequences change the update's denominator: they need the old "
                         "log-probs before the update")
    corrects = alg.rollout_is or alg.rollout_mask or alg.rollout_reject_sequences
    if corrects and "has_rollout_logprobs" in batch and not bool(batch["has_rollout_logprobs"].all()):
        raise RuntimeError("rollout correction needs every row's rollout log-probs, and some rows came without: the "
                           "engine was not asked for them (Config.rollout_logprobs_plan)")
    if correct_rollout and corrects:
        corr, m = correct(batch["old_logprobs"], batch["rollout_logprobs"], mask, is_level=alg.rollout_is,
                          is_threshold=alg.rollout_is_threshold, mask_level=alg.rollout_mask,
                          mask_low=alg.rollout_mask_low, mask_high=alg.rollout_mask_high,
                          reject_sequences=alg.rollout_reject_sequences)
        local.update({f"rollout_corr/{k}": v for k, v in m.items()})
        mask = mask * corr.keep.to(mask.dtype)
        if alg.rollout_is:
            tensors["rollout_is_weights"] = corr.weights.float()
    tensors["response_mask"] = mask
    return Batch(tensors, batch.meta), _reduce(local, device or torch.device("cpu"))


def mismatch_metrics(batch: Batch, device: torch.device) -> dict[str, float]:
    """Collective: the engine/actor mismatch of the step over every rank's response tokens of the
    rows that carry the engine's log-probs (`has_rollout_logprobs`: the others have none, with
    rollout.calculate_log_probs off, and are left out): rollout/logprob_diff_mean and
    rollout/logprob_diff_max of |log p(engine) - log p(actor)|, rollout/mismatch_kl the token mean of
    the k3 estimate of KL(engine || actor). {} on every rank when no rank holds such a row."""
    mask = batch["response_mask"] * batch["has_rollout_logprobs"][:, None].to(batch["response_mask"].dtype)
    engine, actor = batch["rollout_logprobs"], batch["old_logprobs"]
    diff = (engine - actor).abs()
    sums = torch.stack([masked_sum(diff, mask), masked_sum(kl_penalty(engine, actor, "k3"), mask), mask.sum()])
    sums = all_reduce_sum(sums.to(device, torch.float64))
    top = all_reduce_sum((diff * mask).amax().reshape(1).to(device, torch.float64), op=dist.ReduceOp.MAX)
    diff_sum, kl_sum, tokens = sums.tolist()
    if tokens == 0:
        return {}
    return {"rollout/logprob_diff_mean": diff_sum / tokens, "rollout/logprob_diff_max": top.item(),
            "rollout/mismatch_kl": kl_sum / tokens}


def _reduce(local: dict[str, torch.Tensor], device: torch.device) -> dict[str, float]:
    """Mean over ranks, except *_max keys: max over ranks (every rank calls this with the same keys)."""
    if not local:
        return {}
    keys = sorted(local)
    vals = torch.tensor([float(local[k]) for k in keys], dtype=torch.float64, device=device)
    is_max = torch.tensor([k.endswith("_max") for k in keys], device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        world = dist.get_world_size()
        means = vals.clone()
        dist.all_reduce(means)
        maxes = vals.clone()
        dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
        vals = torch.where(is_max, maxes, means / world)
    return dict(zip(keys, vals.tolist()))
