"""The RL math: masked statistics, KL estimators, PPO losses, advantage estimators, KL control.

Every per-token tensor is [B, L] and aligned to the *full* sequence (prompt + response + right
padding); `mask` is 1.0 on response tokens and 0.0 on prompt and padding. Prompt lengths differ
per row, so response start columns differ per row; nothing here assumes responses start at a fixed
column. Position t of a value / log-prob tensor refers to token t.

Precision: every function computes in the promotion of its floating inputs with float32, so
bf16 inputs are upcast, float32 stays float32 and float64 stays float64 (the tests use the latter).
Advantage estimators and reward shaping run under `torch.no_grad()`: their outputs are targets,
never something to differentiate through.

Formulas follow verl (volcengine/verl, `core_algos.py`) unless a docstring says otherwise.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

from spmd_rl.runtime.distributed import all_reduce_sum

Denom = float | torch.Tensor | None

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
KL_KINDS = ("k1", "k2", "k3", "low_var_kl", "abs")
WHITEN_EPS = 1e-8

# --------------------------------------------------------------------------- dtype helpers


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float32 promoted with every floating input (bf16 -> float32, float64 stays float64)."""
    dtype = torch.float32
    for t in tensors:
        if t.is_floating_point():
            dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x if x.dtype == dtype else x.to(dtype)


# --------------------------------------------------------------------------- masked statistics


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of `x * mask`, over everything (`dim=None`) or along `dim`."""
    dtype = _compute_dtype(x)
    prod = _as(x, dtype) * _as(mask, dtype)
    return prod.sum() if dim is None else prod.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `x` over the positions where the (0/1) `mask` is set; 0 where nothing is set.

    The count is clamped to 1 rather than offset by an epsilon: an empty selection then gives an
    exact 0 (and a 0 gradient) instead of NaN, and non-empty ones are not biased.
    """
    dtype = _compute_dtype(x)
    m = _as(mask, dtype)
    total = masked_sum(x, m, dim)
    count = m.sum() if dim is None else m.sum(dim)
    return total / count.clamp_min(1.0)


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, group: Any = None
) -> torch.Tensor:
    """(x - mean) / sqrt(var + 1e-8) over the masked elements; 0 outside the mask.

    `var` is unbiased (n / (n - 1) correction, as verl). With `shift_mean=False` the mean is added
    back (only the scale is normalised). If `group` is a process group and torch.distributed is
    initialised, the sum, sum of squares and count are all-reduced over it first, so every rank
    whitens with the statistics of the whole global batch (every rank of the group must call this).
    In a single process, or with `group=None`, it is plain masked whitening.

    Degenerate batches do not produce NaN: with no masked element the result is all zeros; with
    one, the variance is taken as 0, so the element's centred value is 0 (the mean if not shifted).
    """
    dtype = _compute_dtype(x)
    keep = mask > 0
    # The moments are accumulated in float64: the one-pass formula var = (sumsq - sum*mean)/(n-1)
    # loses about log10(mean^2/var) digits to cancellation, which float64 can afford and float32
    # cannot. One pass is what lets a single all-reduce of three numbers make the statistics global.
    x64 = torch.where(keep, x.to(torch.float64), 0.0)
    stats = torch.stack([x64.sum(), (x64 * x64).sum(), keep.sum().to(torch.float64)])
    if group is not None and dist.is_available() and dist.is_initialized():
        stats = all_reduce_sum(stats, group=group)  # the batch may be on CPU while NCCL reduces on GPU
    total, total_sq, n = stats.unbind()
    mean = total / n.clamp_min(1.0)
    var = ((total_sq - total * mean) / (n - 1.0).clamp_min(1.0)).clamp_min(0.0)
    mean, var = _as(mean, dtype), _as(var, dtype)
    whitened = (_as(x, dtype) - mean) * torch.rsqrt(var + WHITEN_EPS)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(keep, whitened, 0.0)


# --------------------------------------------------------------------------- KL estimators


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(actor || reference) from the sampled tokens' log-probs.

    "k1": logprob - ref (unbiased, high variance, can be negative); "abs": |logprob - ref|;
    "k2": 0.5 * (logprob - ref)^2; "k3" / "low_var_kl": exp(ref - logprob) - (ref - logprob) - 1
    (Schulman's unbiased, non-negative estimator), clamped to [-10, 10] as verl does.
    """
    dtype = _compute_dtype(logprob, ref_logprob)
    diff = _as(logprob, dtype) - _as(ref_logprob, dtype)
    if kind == "k1":
        return diff
    if kind == "abs":
        return diff.abs()
    if kind == "k2":
        return 0.5 * diff.square()
    if kind in ("k3", "low_var_kl"):
        # Clamping the log-ratio first keeps exp() finite (and its gradient free of inf - inf);
        # it changes no value, because |log-ratio| >= 20 already lies beyond the outer clamp.
        log_ratio = (-diff).clamp(-20.0, 20.0)
        return (torch.exp(log_ratio) - log_ratio - 1.0).clamp(-10.0, 10.0)
    raise ValueError(f"unknown KL estimator {kind!r}: choose one of {', '.join(KL_KINDS)}")


# --------------------------------------------------------------------------- loss aggregation


def loss_denominator(mask: torch.Tensor, mode: str) -> torch.Tensor:
    """What `agg_loss` divides by by default for this batch: its token count for "token-mean",
    its number of rows for the "seq-mean-*" modes. Sum it over the micro-batches (and all-reduce
    it over ranks) to get the global `denom` of a mini-batch."""
    _check_agg_mode(mode)
    if mode == "token-mean":
        return (mask > 0).sum().to(torch.float64)
    return torch.tensor(float(mask.shape[0]), dtype=torch.float64, device=mask.device)


def agg_loss(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str, denom: Denom = None) -> torch.Tensor:
    """Reduce a [B, L] per-token loss to a scalar.

    - "token-mean": sum(loss * mask) / denom, default denom = number of masked tokens.
    - "seq-mean-token-sum": sum over rows of each row's token sum / denom, default = rows.
    - "seq-mean-token-mean": sum over rows of (row token sum / row token count) / denom,
      default = rows; a row with no tokens contributes 0.

    `denom` is for gradient accumulation: the trainer splits a mini-batch into micro-batches (and
    over ranks) and passes every micro-batch the *global* mini-batch count (`loss_denominator`
    summed over all micro-batches and ranks), so that the sum of the micro-batch losses equals
    the loss of the whole mini-batch in every mode -- whatever the micro-batches' token counts.
    Note the gradient of that sum is then already the global one: if the data-parallel gradient
    reduction averages over ranks (FSDP's default), scale the loss by the world size.
    """
    _check_agg_mode(mode)
    dtype = _compute_dtype(loss_mat)
    m = _as(mask, dtype)
    if isinstance(denom, torch.Tensor):
        denom = _as(denom, dtype)  # a float64 count must not promote a float32 loss
    if mode == "token-mean":
        total = masked_sum(loss_mat, m)
        return total / (m.sum().clamp_min(1.0) if denom is None else denom)
    row_sums = masked_sum(loss_mat, m, dim=-1)
    if mode == "seq-mean-token-mean":
        row_sums = row_sums / m.sum(-1).clamp_min(1.0)
    return row_sums.sum() / (loss_mat.shape[0] if denom is None else denom)


def _check_agg_mode(mode: str) -> None:
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r}: choose one of {', '.join(LOSS_AGG_MODES)}")


# --------------------------------------------------------------------------- PPO losses


def _token_ratio(log_ratio: torch.Tensor) -> torch.Tensor:
    """Per-token ratio pi / pi_old = exp(log_ratio), the log-ratio clamped to [-20, 20] so one bad
    token cannot overflow."""
    return torch.exp(log_ratio.clamp(-20.0, 20.0))


def _clipped_surrogate(
    adv: torch.Tensor, ratio: torch.Tensor, clip_ratio_low: float, clip_ratio_high: float, clip_ratio_c: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """PPO's clipped surrogate, per token: pg = max(-A * ratio, -A * clip(ratio, 1 - low, 1 + high));
    with `clip_ratio_c` > 0 (dual clip), pg = min(pg, -A * clip_ratio_c) where A < 0. Returns pg,
    where the clipped branch was the max, and where dual clip was active (None without it)."""
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    pg = torch.maximum(pg_unclipped, pg_clipped)
    clipped = pg_clipped > pg_unclipped
    if clip_ratio_c > 0:
        pg_dual = -adv * clip_ratio_c
        dual = (adv < 0) & (pg > pg_dual)
        return torch.where(dual, pg_dual, pg), clipped, dual
    return pg, clipped, None


def policy_loss(
    logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float,
    loss_agg_mode: str,
    denom: Denom = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate with asymmetric clip and dual clip (Ye et al. 2020, as verl).

    The token ratio (`_token_ratio`) through the clipped surrogate (`_clipped_surrogate`); for A < 0
    and `clip_ratio_c` > 1, pg = min(pg, -A * clip_ratio_c), which bounds the loss of a token whose
    ratio exploded (0 turns dual clip off). Aggregated with `agg_loss(mode, denom)`.

    Metrics (detached 0-dim tensors, plain masked means over this micro-batch, so no device
    sync happens here): "clipfrac" (the clipped branch was the max), "clipfrac_lower" (dual clip
    was active), "ppo_kl" (mean of old_logprob - logprob).
    """
    if 0 < clip_ratio_c <= 1:
        raise ValueError(f"clip_ratio_c = {clip_ratio_c} must be > 1 (or 0 to turn dual clip off)")
    dtype = _compute_dtype(logprob, old_logprob, advantages)
    logprob, old_logprob, adv = (_as(t, dtype) for t in (logprob, old_logprob, advantages))

    log_ratio = logprob - old_logprob
    pg, clipped, dual = _clipped_surrogate(adv, _token_ratio(log_ratio), clip_ratio_low, clip_ratio_high, clip_ratio_c)
    if dual is None:
        dual = torch.zeros_like(clipped)

    loss = agg_loss(_weighted(pg, is_weights), mask, loss_agg_mode, denom)
    with torch.no_grad():
        metrics = {
            "clipfrac": masked_mean(clipped.to(dtype), mask),
            "clipfrac_lower": masked_mean(dual.to(dtype), mask),
            "ppo_kl": masked_mean(-log_ratio, mask),
        }
    return loss, metrics


def _weighted(per_token: torch.Tensor, is_weights: torch.Tensor | None) -> torch.Tensor:
    """Per-token loss times the rollout-correction IS weights (data: no gradient flows into them)."""
    return per_token if is_weights is None else per_token * _as(is_weights, per_token.dtype).detach()


def gspo_loss(
    logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    loss_agg_mode: str,
    denom: Denom = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"), token form GSPO-token.

    The sequence ratio s_i = exp(mean over the row's tokens of (logprob - old_logprob)) (a
    geometric mean of token ratios) is clipped per sequence: per token
    pg = max(-A * s, -A * clip(s, 1 - low, 1 + high)), with s_t = sg[s_i] * pi_t / sg[pi_t], whose
    value is s_i and whose gradient is s_i * grad log pi_t (as verl; log s clamped to <= 10).
    The paper clips with tiny ranges (3e-4 / 4e-4) and aggregates "seq-mean-token-mean".
    Metrics: "clipfrac" (tokens of clipped sequences), "ppo_kl".
    """
    dtype = _compute_dtype(logprob, old_logprob, advantages)
    logprob, old_logprob, adv = (_as(t, dtype) for t in (logprob, old_logprob, advantages))
    m = _as(mask, dtype)
    log_ratio = (logprob - old_logprob) * m
    seq_log_ratio = log_ratio.sum(-1) / m.sum(-1).clamp_min(1.0)
    log_s = (logprob - logprob.detach() + seq_log_ratio.detach()[:, None]).clamp(max=10.0)
    pg, clipped, _ = _clipped_surrogate(adv, torch.exp(log_s), clip_ratio_low, clip_ratio_high)
    loss = agg_loss(_weighted(pg, is_weights), mask, loss_agg_mode, denom)
    with torch.no_grad():
        metrics = {"clipfrac": masked_mean(clipped.to(dtype), mask),
                   "ppo_kl": masked_mean(-log_ratio, mask)}
    return loss, metrics


def cispo_loss(
    logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_ratio_high: float,
    loss_agg_mode: str,
    denom: Denom = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO (MiniMax-M1 report, 2025): per token pg = -sg[min(ratio, 1 + high)] * A * logprob.

    Every token keeps a gradient (unlike PPO, where clipped tokens get none); only the
    importance weight is truncated, and it carries no gradient. No lower bound, as MiniMax-M1.
    Metrics: "clipfrac" (tokens whose weight was capped), "ppo_kl".
    """
    dtype = _compute_dtype(logprob, old_logprob, advantages)
    logprob, old_logprob, adv = (_as(t, dtype) for t in (logprob, old_logprob, advantages))
    log_ratio = logprob - old_logprob
    ratio = _token_ratio(log_ratio.detach())
    weight = ratio.clamp(max=1.0 + clip_ratio_high)
    pg = -adv * weight * logprob
    loss = agg_loss(_weighted(pg, is_weights), mask, loss_agg_mode, denom)
    with torch.no_grad():
        metrics = {"clipfrac": masked_mean((ratio > 1.0 + clip_ratio_high).to(dtype), mask),
                   "ppo_kl": masked_mean(-log_ratio, mask)}
    return loss, metrics


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str,
    denom: Denom = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss 0.5 * max((v - R)^2, (old + clamp(v - old, -c, c) - R)^2), as verl.

    c = `cliprange_value`; 0 means no clipping (plain 0.5 * (v - R)^2). Metric "vf_clipfrac":
    masked mean of where the clipped term was the larger (detached 0-dim tensor).
    """
    dtype = _compute_dtype(values, old_values, returns)
    values, old_values, returns = (_as(t, dtype) for t in (values, old_values, returns))
    loss_unclipped = (values - returns).square()
    if cliprange_value > 0:
        v_clipped = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)
        loss_clipped = (v_clipped - returns).square()
        per_token = torch.maximum(loss_unclipped, loss_clipped)
        clipped = loss_clipped > loss_unclipped
    else:
        per_token = loss_unclipped
        clipped = torch.zeros_like(loss_unclipped, dtype=torch.bool)
    loss = 0.5 * agg_loss(per_token, mask, loss_agg_mode, denom)
    with torch.no_grad():
        metrics = {"vf_clipfrac": masked_mean(clipped.to(dtype), mask)}
    return loss, metrics


# --------------------------------------------------------------------------- rewards


@torch.no_grad()
def scores_to_token_rewards(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B] sequence scores -> [B, L] token rewards: each score at its row's last response token.

    A row with no response token has nowhere to put its score and gets all zeros.
    """
    keep = mask > 0
    dtype = _compute_dtype(scores)
    cols = torch.arange(keep.shape[1], device=keep.device)
    last = torch.where(keep, cols, -1).amax(dim=1)  # -1 for rows with no response token
    at_last = (cols[None, :] == last[:, None]) & keep
    return torch.where(at_last, _as(scores, dtype).reshape(-1, 1), 0.0)


@torch.no_grad()
def apply_kl_penalty(
    token_scores: torch.Tensor,
    logprob: torch.Tensor,
    ref_logprob: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float,
    kind: str,
) -> tuple[torch.Tensor, float]:
    """Token rewards = token_scores - kl_coef * kl_penalty(kind) on the response tokens.

    Also returns the batch KL the adaptive controller steers by (verl's "actor/reward_kl_penalty"):
    the masked mean of the penalty per sequence, then the mean over sequences, as a float.
    """
    dtype = _compute_dtype(token_scores, logprob, ref_logprob)
    m = _as(mask, dtype)
    kld = kl_penalty(logprob, ref_logprob, kind) * m
    rewards = _as(token_scores, dtype) - kl_coef * kld
    mean_kl = masked_mean(kld, m, dim=-1).mean()
    return rewards, float(mean_kl)


@torch.no_grad()
def overlong_penalty(response_lens: torch.Tensor, max_length: int, buffer: int, factor: float) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025), added to each sequence's score: 0 up to
    max_length - buffer tokens, then linear down to -factor at max_length (and beyond)."""
    if buffer <= 0:
        return torch.zeros(response_lens.shape, dtype=torch.float32)
    over = response_lens.to(torch.float64) - (max_length - buffer)
    return (-factor * (over / buffer).clamp(0.0, 1.0)).float()


# --------------------------------------------------------------------------- advantages


def _response_columns(keep: torch.Tensor) -> range:
    """Columns from the last to the first that hold any response token (reverse order), so the
    reverse-time loops skip the prompt-only and padding-only columns of the batch."""
    cols = keep.any(dim=0).nonzero().flatten()
    if cols.numel() == 0:
        return range(0)
    first, last = int(cols[0]), int(cols[-1])
    return range(last, first - 1, -1)


@torch.no_grad()
def gae_advantages(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
    whiten_group: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over each row's response tokens.

    The recursion delta_t = r_t + gamma * V_next - V_t, A_t = delta_t + gamma * lam * A_next runs
    backwards over the masked positions only: at an unmasked position the next value and the
    running advantage are carried through unchanged, so prompt and padding never leak in, and the
    value after a row's last response token is 0. returns = A + V (before whitening); then A is
    whitened with `masked_whiten(group=whiten_group)`. Both are 0 outside the mask.
    """
    dtype = _compute_dtype(token_rewards, values)
    rewards, values = _as(token_rewards, dtype), _as(values, dtype)
    keep = mask > 0
    batch = rewards.shape[0]
    next_value = rewards.new_zeros(batch)
    running = rewards.new_zeros(batch)
    adv = torch.zeros_like(rewards)
    for t in _response_columns(keep):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        step = delta + gamma * lam * running
        k = keep[:, t]
        running = torch.where(k, step, running)
        next_value = torch.where(k, values[:, t], next_value)
        adv[:, t] = running
    adv = torch.where(keep, adv, 0.0)
    returns = torch.where(keep, adv + values, 0.0)
    return masked_whiten(adv, keep, group=whiten_group), returns


@torch.no_grad()
def reinforce_plus_plus_advantages(
    token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float, whiten_group: Any = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025): returns G_t = r_t + gamma * G_next over each row's response tokens
    (unmasked positions skipped as in GAE), advantages = masked_whiten(G) over the (global) batch."""
    dtype = _compute_dtype(token_rewards)
    rewards = _as(token_rewards, dtype)
    keep = mask > 0
    running = rewards.new_zeros(rewards.shape[0])
    returns = torch.zeros_like(rewards)
    for t in _response_columns(keep):
        running = torch.where(keep[:, t], rewards[:, t] + gamma * running, running)
        returns[:, t] = running
    returns = torch.where(keep, returns, 0.0)
    return masked_whiten(returns, keep, group=whiten_group), returns


def _group_stats(
    scores: torch.Tensor, group_ids: torch.Tensor | Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(group index of each row, size of each group, sum of scores of each group)."""
    ids = torch.as_tensor(group_ids, device=scores.device).reshape(-1)
    if ids.numel() != scores.numel():
        raise ValueError(f"group_ids has {ids.numel()} entries for {scores.numel()} scores")
    uniq, inverse = torch.unique(ids, return_inverse=True)
    zeros = scores.new_zeros(uniq.numel())
    counts = zeros.index_add(0, inverse, torch.ones_like(scores))
    sums = zeros.index_add(0, inverse, scores)
    return inverse, counts, sums


def _broadcast_to_tokens(row_values: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    adv = torch.where(mask > 0, row_values.reshape(-1, 1), 0.0)
    return adv, adv.clone()


@torch.no_grad()
def grpo_advantages(
    scores: torch.Tensor,
    group_ids: torch.Tensor | Sequence[int],
    mask: torch.Tensor,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantages: (score - group mean) / (group std + eps) on every response token.

    Rows with the same `group_ids` entry are samples of one prompt (all of a group must be in this
    call). std is unbiased (torch.std's default). `norm_by_std=False` is Dr. GRPO (mean-centring
    only). A group of one sample gets mean 0 and std 1, as verl. returns = advantages.
    """
    s = _as(scores, _compute_dtype(scores)).reshape(-1)
    inverse, counts, sums = _group_stats(s, group_ids)
    mean = sums / counts
    sq_dev = s.new_zeros(counts.numel()).index_add(0, inverse, (s - mean[inverse]).square())
    std = (sq_dev / (counts - 1.0).clamp_min(1.0)).sqrt()
    single = counts == 1
    mean = torch.where(single, 0.0, mean)
    std = torch.where(single, 1.0, std)
    adv = s - mean[inverse]
    if norm_by_std:
        adv = adv / (std[inverse] + eps)
    return _broadcast_to_tokens(adv, mask)


@torch.no_grad()
def rloo_advantages(
    scores: torch.Tensor, group_ids: torch.Tensor | Sequence[int], mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO (Ahmadian et al. 2024): score minus the mean score of the *other* samples of the same
    prompt, on every response token; a group of one sample gets 0. returns = advantages."""
    s = _as(scores, _compute_dtype(scores)).reshape(-1)
    inverse, counts, sums = _group_stats(s, group_ids)
    n = counts[inverse]
    baseline = (sums[inverse] - s) / (n - 1.0).clamp_min(1.0)
    adv = torch.where(n > 1, s - baseline, 0.0)
    return _broadcast_to_tokens(adv, mask)


# --------------------------------------------------------------------------- KL controllers


class FixedKLController:
    """A constant reward-penalty coefficient."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Nothing to adapt."""

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Proportional control of the coefficient towards `target_kl` (Ziegler et al. 2019, as verl):
    e = clip(current_kl / target_kl - 1, -0.2, 0.2); value *= 1 + e * n_steps / horizon.

    `n_steps` is the number of samples the KL was measured on (horizon is in samples)."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(f"adaptive KL control needs target_kl > 0 and horizon > 0, "
                             f"got target_kl={target_kl}, horizon={horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        # Only the coefficient is state: target and horizon come from the config of the resumed run.
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


def build_kl_controller(
    kind: str, kl_coef: float, target_kl: float = 0.1, horizon: int = 10000
) -> FixedKLController | AdaptiveKLController:
    """The controller named by `algorithm.kl_ctrl` ("fixed" or "adaptive")."""
    if kind == "fixed":
        return FixedKLController(kl_coef)
    if kind == "adaptive":
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"unknown kl_ctrl {kind!r}: choose fixed or adaptive")


__all__ = [
    "masked_sum", "masked_mean", "masked_whiten", "kl_penalty", "loss_denominator", "agg_loss",
    "policy_loss", "gspo_loss", "cispo_loss", "value_loss", "overlong_penalty",
    "scores_to_token_rewards", "apply_kl_penalty",
    "gae_advantages", "reinforce_plus_plus_advantages", "grpo_advantages", "rloo_advantages",
    "FixedKLController", "AdaptiveKLController", "build_kl_controller",
]
