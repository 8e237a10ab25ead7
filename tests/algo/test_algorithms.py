"""spmd_rl.algo.algorithms against independent float64 references written as plain Python loops.

Inputs are random [B, L] batches laid out like the trainer's: per-row prompt lengths, response
lengths and right padding differ, so response start columns differ per row. Each reference
works on `tolist()` copies with Python floats (or, for gradients, float64 scalar tensors one
token at a time); none of them calls the code under test.
"""

from __future__ import annotations

import math
import os
import random
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from spmd_rl.algo import algorithms as alg
from spmd_rl.model import logprob_head
from spmd_rl.runtime.distributed import free_port

SEEDS = [0, 1, 2]
DTYPES = [torch.float32, torch.float64]
MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]


# --------------------------------------------------------------------------- batch helpers


def make_mask(batch: int, length: int, seed: int, empty_row: bool = False) -> torch.Tensor:
    """A [B, L] float mask like the trainer's: prompt (0) + contiguous response (1) + padding (0).

    Row 0 always runs to the last column (no padding); with `empty_row` the last row has no
    response token at all."""
    rng = random.Random(seed)
    mask = torch.zeros(batch, length, dtype=torch.float64)
    for b in range(batch):
        prompt = rng.randint(1, length // 2)
        response = length - prompt if b == 0 else rng.randint(1, length - prompt)
        if empty_row and b == batch - 1:
            response = 0
        mask[b, prompt:prompt + response] = 1.0
    return mask


def randn(shape, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64) * scale


def tol(dtype: torch.dtype) -> dict:
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-10)


def close(actual, expected, dtype: torch.dtype) -> None:
    """`actual` (a tensor from the code under test) equals the reference (nested lists / float)."""
    torch.testing.assert_close(actual.detach().double(), torch.tensor(expected, dtype=torch.float64), **tol(dtype))


def rows_cols(mask_list):
    """(b, t) of every masked position, row by row."""
    return [(b, t) for b, row in enumerate(mask_list) for t, m in enumerate(row) if m]


# --------------------------------------------------------------------------- references


def ref_whiten(x, m, shift_mean=True):
    vals = [x[b][t] for b, t in rows_cols(m)]
    n = len(vals)
    mean = sum(vals) / n
    var = sum((v - mean) ** 2 for v in vals) / (n - 1)
    out = [[0.0] * len(row) for row in x]
    for b, t in rows_cols(m):
        out[b][t] = (x[b][t] - mean) / math.sqrt(var + 1e-8) + (0.0 if shift_mean else mean)
    return out


def ref_agg(per_token, m, mode, denom=None):
    """per_token[b][t] may be floats or float64 scalar tensors (for autograd references)."""
    if mode == "token-mean":
        total, count = 0.0, 0
        for b, t in rows_cols(m):
            total = total + per_token[b][t]
            count += 1
        return total / (denom if denom is not None else count)
    total = 0.0
    for b, row in enumerate(m):
        row_sum, count = 0.0, 0
        for t, keep in enumerate(row):
            if keep:
                row_sum = row_sum + per_token[b][t]
                count += 1
        if mode == "seq-mean-token-mean":
            row_sum = row_sum / count if count else 0.0
        total = total + row_sum
    return total / (denom if denom is not None else len(m))


def ref_policy_terms(lp, old, adv, low, high, c):
    """Per-token PPO loss and (clipped, dual) flags; lp entries may be float64 scalar tensors."""
    exp = torch.exp if isinstance(lp, torch.Tensor) else math.exp
    log_ratio = min(max(lp - old, -20.0), 20.0)
    ratio = exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * min(max(ratio, 1 - low), 1 + high)
    loss = clipped if clipped > unclipped else unclipped
    dual = False
    if c > 1 and adv < 0 and loss > -adv * c:
        loss, dual = -adv * c, True
    return loss, bool(clipped > unclipped), dual


def ref_gae_row(rewards, values, gamma, lam):
    """Textbook GAE on one response (lists), with V = 0 after the last token."""
    n = len(rewards)
    adv = [0.0] * n
    running = 0.0
    for i in reversed(range(n)):
        next_value = values[i + 1] if i + 1 < n else 0.0
        delta = rewards[i] + gamma * next_value - values[i]
        running = delta + gamma * lam * running
        adv[i] = running
    return adv


def ref_gae(r, v, m, gamma, lam):
    """Per row: gather the response tokens, run GAE on them alone, scatter back."""
    adv = [[0.0] * len(row) for row in r]
    ret = [[0.0] * len(row) for row in r]
    for b in range(len(r)):
        cols = [t for t, keep in enumerate(m[b]) if keep]
        row_adv = ref_gae_row([r[b][t] for t in cols], [v[b][t] for t in cols], gamma, lam)
        for t, a in zip(cols, row_adv):
            adv[b][t] = a
            ret[b][t] = a + v[b][t]
    return ref_whiten(adv, m), ret


def ref_group_members(ids):
    groups = {}
    for i, g in enumerate(ids):
        groups.setdefault(g, []).append(i)
    return groups


# --------------------------------------------------------------------------- masked statistics


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_masked_sum_mean(seed, dtype):
    mask = make_mask(6, 17, seed, empty_row=True)
    x = randn((6, 17), seed)
    xs, ms = x.tolist(), mask.tolist()
    total = sum(xs[b][t] for b, t in rows_cols(ms))
    count = len(rows_cols(ms))
    close(alg.masked_sum(x.to(dtype), mask), total, dtype)
    close(alg.masked_mean(x.to(dtype), mask.to(dtype)), total / count, dtype)
    row_means = [sum(xs[b][t] for t in range(17) if ms[b][t]) / max(sum(ms[b]), 1) for b in range(6)]
    close(alg.masked_mean(x.to(dtype), mask, dim=-1), row_means, dtype)
    assert alg.masked_mean(x, torch.zeros_like(mask)).item() == 0.0


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shift_mean", [True, False])
def test_masked_whiten(seed, dtype, shift_mean):
    mask = make_mask(5, 19, seed, empty_row=True)
    x = randn((5, 19), seed, scale=3.0) + 2.0
    out = alg.masked_whiten(x.to(dtype), mask, shift_mean=shift_mean)
    assert out.dtype == dtype
    close(out, ref_whiten(x.tolist(), mask.tolist(), shift_mean), dtype)


def test_masked_whiten_degenerate_batches_give_zeros():
    x = randn((2, 5), 0)
    one = torch.zeros(2, 5)
    one[1, 3] = 1
    assert torch.equal(alg.masked_whiten(x, one), torch.zeros(2, 5, dtype=torch.float64))
    assert torch.equal(alg.masked_whiten(x, torch.zeros(2, 5)), torch.zeros(2, 5, dtype=torch.float64))


# --------------------------------------------------------------------------- KL estimators


def ref_kl(lp, ref, kind):
    d = lp - ref
    if kind == "k1":
        return d
    if kind == "abs":
        return abs(d)
    if kind == "k2":
        return 0.5 * d * d
    k3 = math.exp(ref - lp) - (ref - lp) - 1
    return min(max(k3, -10.0), 10.0)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["k1", "abs", "k2", "k3", "low_var_kl"])
def test_kl_penalty(seed, dtype, kind):
    lp, ref = randn((4, 9), seed, 2.0), randn((4, 9), seed + 100, 2.0)
    lp[0, 0], ref[0, 0] = -30.0, 0.0  # k3 far beyond the clamp (exp(30) - 31 > 10)
    expected = [[ref_kl(a, b, kind) for a, b in zip(ra, rb)] for ra, rb in zip(lp.tolist(), ref.tolist())]
    close(alg.kl_penalty(lp.to(dtype), ref.to(dtype), kind), expected, dtype)


def test_kl_penalty_extreme_inputs_stay_finite_and_unknown_kind_is_refused():
    lp = torch.tensor([-1e4, 0.0, 50.0], requires_grad=True)
    ref = torch.tensor([0.0, -1e4, 0.0])
    kl = alg.kl_penalty(lp, ref, "low_var_kl")
    kl.sum().backward()
    assert torch.isfinite(kl).all() and torch.isfinite(lp.grad).all()
    assert kl.tolist() == [10.0, 10.0, 10.0]
    with pytest.raises(ValueError, match="k1, k2, k3, low_var_kl, abs"):
        alg.kl_penalty(lp, ref, "k4")


# --------------------------------------------------------------------------- aggregation


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", MODES)
def test_agg_loss_matches_reference(seed, dtype, mode):
    mask = make_mask(7, 13, seed, empty_row=True)
    loss = randn((7, 13), seed)
    expected = ref_agg(loss.tolist(), mask.tolist(), mode)
    close(alg.agg_loss(loss.to(dtype), mask, mode), expected, dtype)
    close(alg.agg_loss(loss.to(dtype), mask, mode, denom=3.5), ref_agg(loss.tolist(), mask.tolist(), mode, 3.5), dtype)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", MODES)
def test_agg_loss_micro_batches_with_global_denom_sum_to_full_batch(seed, mode):
    mask = make_mask(9, 15, seed, empty_row=True)
    loss = randn((9, 15), seed).float()
    full = alg.agg_loss(loss, mask, mode)
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, 9), 3))
    bounds = list(zip([0] + cuts, cuts + [9]))
    denom = sum(alg.loss_denominator(mask[a:b], mode) for a, b in bounds)
    parts = [alg.agg_loss(loss[a:b], mask[a:b], mode, denom=denom) for a, b in bounds]
    assert sum(parts).dtype == torch.float32  # the float64 count must not promote the loss
    torch.testing.assert_close(sum(parts), full, rtol=1e-6, atol=1e-6)


def test_agg_loss_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="token-mean"):
        alg.agg_loss(torch.zeros(1, 1), torch.ones(1, 1), "seq-sum")


# --------------------------------------------------------------------------- policy loss


POLICY_CASES = [  # (clip_ratio_low, clip_ratio_high, clip_ratio_c)
    (0.2, 0.2, 3.0),
    (0.2, 0.28, 1.5),
    (0.1, 0.3, 0.0),
]


def policy_inputs(seed):
    mask = make_mask(6, 14, seed, empty_row=True)
    old = -randn((6, 14), seed).abs() - 0.1
    lp = old + randn((6, 14), seed + 1, 1.0)  # ratios spread well beyond the clip range
    adv = randn((6, 14), seed + 2, 1.5)
    for b in range(3):  # a few exploded ratios with A < 0, so dual clip is exercised in every case
        t = int(mask[b].nonzero()[0])
        lp[b, t], adv[b, t] = old[b, t] + 1.5, -abs(adv[b, t]) - 0.1
    return lp, old, adv, mask


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("low,high,c", POLICY_CASES)
def test_policy_loss_value_and_metrics(seed, dtype, mode, low, high, c):
    lp, old, adv, mask = policy_inputs(seed)
    L, O, A, M = lp.tolist(), old.tolist(), adv.tolist(), mask.tolist()
    terms = [[ref_policy_terms(L[b][t], O[b][t], A[b][t], low, high, c) for t in range(14)] for b in range(6)]
    positions = rows_cols(M)
    expected_loss = ref_agg([[term[0] for term in row] for row in terms], M, mode)
    expected_clipfrac = sum(terms[b][t][1] for b, t in positions) / len(positions)
    expected_lower = sum(terms[b][t][2] for b, t in positions) / len(positions)
    expected_kl = sum(O[b][t] - L[b][t] for b, t in positions) / len(positions)

    loss, metrics = alg.policy_loss(lp.to(dtype), old.to(dtype), adv.to(dtype), mask, low, high, c, mode)
    close(loss, expected_loss, dtype)
    close(metrics["clipfrac"], expected_clipfrac, dtype)
    close(metrics["clipfrac_lower"], expected_lower, dtype)
    close(metrics["ppo_kl"], expected_kl, dtype)
    assert 0 < expected_clipfrac < 1  # the inputs exercise both branches
    if c > 1:
        assert expected_lower > 0


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("low,high,c", POLICY_CASES)
def test_policy_loss_gradient(seed, mode, low, high, c):
    lp, old, adv, mask = policy_inputs(seed)
    O, A, M = old.tolist(), adv.tolist(), mask.tolist()
    denom = 11.0  # a micro-batch normalised by some global count

    ref_lp = lp.clone().requires_grad_(True)  # float64, one scalar op at a time
    per_token = [[ref_policy_terms(ref_lp[b, t], O[b][t], A[b][t], low, high, c)[0] for t in range(14)] for b in range(6)]
    ref_agg(per_token, M, mode, denom).backward()

    lp32 = lp.float().requires_grad_(True)
    loss, _ = alg.policy_loss(lp32, old.float(), adv.float(), mask.float(), low, high, c, mode, denom=denom)
    loss.backward()
    torch.testing.assert_close(lp32.grad.double(), ref_lp.grad, rtol=1e-5, atol=1e-6)
    assert ref_lp.grad.abs().sum() > 0


def test_policy_loss_survives_exploded_ratios_and_refuses_bad_dual_clip():
    lp = torch.tensor([[0.0, 80.0, -80.0]], requires_grad=True)
    old = torch.zeros(1, 3)
    adv = torch.tensor([[1.0, -1.0, 1.0]])
    loss, metrics = alg.policy_loss(lp, old, adv, torch.ones(1, 3), 0.2, 0.2, 3.0, "token-mean")
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(lp.grad).all()
    # token 1: A < 0 with ratio exp(20) is capped by dual clip at -A * 3; token 2: ratio exp(-20)
    torch.testing.assert_close(loss, torch.tensor((-1.0 + 3.0 - math.exp(-20.0)) / 3))
    assert metrics["clipfrac_lower"].item() == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        alg.policy_loss(lp, old, adv, torch.ones(1, 3), 0.2, 0.2, 0.5, "token-mean")


# --------------------------------------------------------------------------- value loss


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cliprange", [0.5, 0.2, 0.0])
def test_value_loss(seed, dtype, mode, cliprange):
    mask = make_mask(5, 12, seed, empty_row=True)
    v, old, ret = randn((5, 12), seed), randn((5, 12), seed + 1), randn((5, 12), seed + 2)
    V, O, R, M = v.tolist(), old.tolist(), ret.tolist(), mask.tolist()
    per_token, flags = [], []
    for b in range(5):
        row = []
        for t in range(12):
            plain = (V[b][t] - R[b][t]) ** 2
            if cliprange > 0:
                moved = min(max(V[b][t] - O[b][t], -cliprange), cliprange)
                clipped = (O[b][t] + moved - R[b][t]) ** 2
            else:
                clipped = -1.0
            row.append(max(plain, clipped))
            if M[b][t]:
                flags.append(clipped > plain)
        per_token.append(row)
    loss, metrics = alg.value_loss(v.to(dtype), old.to(dtype), ret.to(dtype), mask, cliprange, mode)
    close(loss, 0.5 * ref_agg(per_token, M, mode), dtype)
    close(metrics["vf_clipfrac"], sum(flags) / len(flags), dtype)
    if cliprange > 0:
        assert 0 < sum(flags) < len(flags)


# --------------------------------------------------------------------------- entropy


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("chunked", [False, True])
def test_entropy_from_logits(seed, dtype, chunked, monkeypatch):
    if chunked:
        monkeypatch.setattr(logprob_head, "_ENTROPY_CHUNK_ELEMENTS", 20)  # 2 positions of 11 logits per chunk
    logits = randn((3, 5, 11), seed, 3.0).to(dtype)
    expected = []
    for row in logits.double().tolist():
        expected.append([])
        for z in row:
            total = sum(math.exp(v) for v in z)
            p = [math.exp(v) / total for v in z]
            expected[-1].append(-sum(pi * math.log(pi) for pi in p))
    out = logprob_head.entropy_from_logits(logits)
    assert out.shape == (3, 5) and out.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    close(out, expected, torch.float64 if dtype == torch.float64 else torch.float32)


def test_entropy_gradient_matches_reference():
    logits = randn((2, 7), 3).requires_grad_(True)
    logprob_head.entropy_from_logits(logits.float()).sum().backward()  # .float() is differentiable
    ref = logits.detach().clone().requires_grad_(True)
    for z in ref:
        p = torch.softmax(z, -1)
        (-(p * torch.log(p)).sum()).backward(retain_graph=True)
    torch.testing.assert_close(logits.grad, ref.grad, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- rewards


@pytest.mark.parametrize("seed", SEEDS)
def test_scores_to_token_rewards(seed):
    mask = make_mask(6, 11, seed, empty_row=True)
    scores = randn((6,), seed)
    expected = [[0.0] * 11 for _ in range(6)]
    for b, row in enumerate(mask.tolist()):
        cols = [t for t, keep in enumerate(row) if keep]
        if cols:
            expected[b][cols[-1]] = scores[b].item()
    close(alg.scores_to_token_rewards(scores, mask), expected, torch.float64)
    close(alg.scores_to_token_rewards(scores.float(), mask.bool()), expected, torch.float32)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["k1", "k3"])
def test_apply_kl_penalty(seed, dtype, kind):
    mask = make_mask(5, 10, seed)
    scores = alg.scores_to_token_rewards(randn((5,), seed), mask)
    lp, ref = randn((5, 10), seed + 1), randn((5, 10), seed + 2)
    S, L, R, M = scores.tolist(), lp.tolist(), ref.tolist(), mask.tolist()
    coef = 0.05
    expected = [[S[b][t] - coef * ref_kl(L[b][t], R[b][t], kind) * M[b][t] for t in range(10)] for b in range(5)]
    per_seq = [sum(ref_kl(L[b][t], R[b][t], kind) for t in range(10) if M[b][t]) / sum(M[b]) for b in range(5)]
    rewards, mean_kl = alg.apply_kl_penalty(scores.to(dtype), lp.to(dtype), ref.to(dtype), mask, coef, kind)
    close(rewards, expected, dtype)
    assert isinstance(mean_kl, float)
    assert mean_kl == pytest.approx(sum(per_seq) / 5, rel=1e-5 if dtype == torch.float32 else 1e-12)


# --------------------------------------------------------------------------- advantages


def mask_with_holes(seed):
    """A non-contiguous mask, to check that unmasked positions are skipped, not treated as 0."""
    mask = make_mask(5, 16, seed)
    for b in range(5):
        cols = mask[b].nonzero().flatten().tolist()
        if len(cols) >= 3:
            mask[b, cols[len(cols) // 2]] = 0.0
    return mask


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
@pytest.mark.parametrize("holes", [False, True])
def test_gae_advantages(seed, dtype, gamma, lam, holes):
    mask = mask_with_holes(seed) if holes else make_mask(5, 16, seed)
    values = randn((5, 16), seed + 1)
    rewards = alg.scores_to_token_rewards(randn((5,), seed), mask) + 0.1 * randn((5, 16), seed + 2) * mask
    rewards = rewards + 100.0 * (1 - mask)  # garbage off the response must not leak in
    values_garbage = values + 50.0 * (1 - mask)
    exp_adv, exp_ret = ref_gae(rewards.tolist(), values_garbage.tolist(), mask.tolist(), gamma, lam)
    adv, ret = alg.gae_advantages(rewards.to(dtype), values_garbage.to(dtype), mask, gamma, lam)
    close(adv, exp_adv, dtype)
    close(ret, exp_ret, dtype)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gamma", [1.0, 0.9])
@pytest.mark.parametrize("holes", [False, True])
def test_reinforce_plus_plus_advantages(seed, dtype, gamma, holes):
    mask = mask_with_holes(seed) if holes else make_mask(5, 16, seed)
    rewards = randn((5, 16), seed) * mask + 7.0 * (1 - mask)
    R, M = rewards.tolist(), mask.tolist()
    exp_ret = [[0.0] * 16 for _ in range(5)]
    for b in range(5):
        cols = [t for t in range(16) if M[b][t]]
        running = 0.0
        for t in reversed(cols):
            running = R[b][t] + gamma * running
            exp_ret[b][t] = running
    adv, ret = alg.reinforce_plus_plus_advantages(rewards.to(dtype), mask, gamma)
    close(ret, exp_ret, dtype)
    close(adv, ref_whiten(exp_ret, M), dtype)


def group_batch(seed):
    """Shuffled group ids: three groups of 4, one of 3 and one singleton."""
    ids = [10] * 4 + [3] * 4 + [7] * 4 + [42] * 3 + [5]
    random.Random(seed).shuffle(ids)
    n = len(ids)
    return randn((n,), seed), ids, make_mask(n, 9, seed)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_advantages(seed, dtype, norm_by_std):
    scores, ids, mask = group_batch(seed)
    S, M = scores.tolist(), mask.tolist()
    per_row = [0.0] * len(ids)
    for members in ref_group_members(ids).values():
        if len(members) == 1:
            mean, std = 0.0, 1.0
        else:
            mean = sum(S[i] for i in members) / len(members)
            std = math.sqrt(sum((S[i] - mean) ** 2 for i in members) / (len(members) - 1))
        for i in members:
            per_row[i] = (S[i] - mean) / (std + 1e-6) if norm_by_std else S[i] - mean
    expected = [[per_row[b] * M[b][t] for t in range(9)] for b in range(len(ids))]
    adv, ret = alg.grpo_advantages(scores.to(dtype), torch.tensor(ids), mask, norm_by_std=norm_by_std)
    close(adv, expected, dtype)
    close(ret, expected, dtype)


def test_grpo_constant_group_gives_zero_advantage():
    adv, _ = alg.grpo_advantages(torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0]), [0, 0, 0, 1, 1], torch.ones(5, 2))
    assert adv[:3].abs().max() == 0.0 and adv[3, 0] < 0 < adv[4, 0]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rloo_advantages(seed, dtype):
    scores, ids, mask = group_batch(seed)
    S, M = scores.tolist(), mask.tolist()
    per_row = [0.0] * len(ids)
    for members in ref_group_members(ids).values():
        for i in members:
            others = [S[j] for j in members if j != i]
            per_row[i] = S[i] - sum(others) / len(others) if others else 0.0
    expected = [[per_row[b] * M[b][t] for t in range(9)] for b in range(len(ids))]
    adv, ret = alg.rloo_advantages(scores.to(dtype), ids, mask)
    close(adv, expected, dtype)
    close(ret, expected, dtype)


# --------------------------------------------------------------------------- KL controllers


def test_adaptive_kl_controller_sequence():
    ctrl = alg.AdaptiveKLController(init_kl_coef=0.1, target_kl=0.1, horizon=100)
    ctrl.update(0.15, 10)  # error 0.5 -> clipped to 0.2: x (1 + 0.2 * 10 / 100) = x 1.02
    assert ctrl.value == pytest.approx(0.102, rel=1e-12)
    ctrl.update(0.05, 10)  # error -0.5 -> -0.2: x 0.98
    assert ctrl.value == pytest.approx(0.09996, rel=1e-12)
    ctrl.update(0.11, 20)  # error 0.1 (unclipped): x (1 + 0.1 * 20 / 100) = x 1.02
    assert ctrl.value == pytest.approx(0.1019592, rel=1e-12)
    ctrl.update(0.1, 50)  # on target: unchanged
    assert ctrl.value == pytest.approx(0.1019592, rel=1e-12)

    restored = alg.AdaptiveKLController(init_kl_coef=0.5, target_kl=0.1, horizon=100)
    restored.load_state_dict(ctrl.state_dict())
    assert restored.value == ctrl.value


def test_fixed_kl_controller_and_builder():
    ctrl = alg.build_kl_controller("fixed", 0.3)
    ctrl.update(5.0, 1000)
    assert isinstance(ctrl, alg.FixedKLController) and ctrl.value == 0.3
    other = alg.FixedKLController(0.0)
    other.load_state_dict(ctrl.state_dict())
    assert other.value == 0.3
    assert isinstance(alg.build_kl_controller("adaptive", 0.1, 0.2, 50), alg.AdaptiveKLController)
    with pytest.raises(ValueError, match="fixed or adaptive"):
        alg.build_kl_controller("pid", 0.1)


# --------------------------------------------------------------------------- global whitening


def _whiten_worker(rank: int, world: int, port: int, data_path: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        data = torch.load(data_path)
        lo, hi = data["bounds"][rank]
        x, mask, values = data["x"][lo:hi], data["mask"][lo:hi], data["values"][lo:hi]
        group = dist.group.WORLD
        result = {
            "whiten": alg.masked_whiten(x, mask, group=group),
            "whiten_noshift": alg.masked_whiten(x, mask, shift_mean=False, group=group),
            "gae": alg.gae_advantages(x, values, mask, 0.99, 0.95, whiten_group=group),
        }
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built in")
def test_masked_whiten_global_over_two_gloo_processes(tmp_path):
    # Uneven shards: rank 0 holds 3 rows, rank 1 holds 5 (one of them without response tokens).
    mask = make_mask(8, 12, 5, empty_row=True)
    x = randn((8, 12), 5, 2.0) + 1.0
    values = randn((8, 12), 6)
    data_path = str(tmp_path / "data.pt")
    torch.save({"x": x, "mask": mask, "values": values, "bounds": [(0, 3), (3, 8)]}, data_path)
    mp.spawn(_whiten_worker, args=(2, free_port(), data_path, str(tmp_path)), nprocs=2, join=True)
    shards = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]

    def joined(key, i=None):
        return torch.cat([s[key] if i is None else s[key][i] for s in shards])

    close(joined("whiten"), ref_whiten(x.tolist(), mask.tolist()), torch.float64)
    close(joined("whiten_noshift"), ref_whiten(x.tolist(), mask.tolist(), shift_mean=False), torch.float64)
    exp_adv, exp_ret = ref_gae(x.tolist(), values.tolist(), mask.tolist(), 0.99, 0.95)
    close(joined("gae", 0), exp_adv, torch.float64)
    close(joined("gae", 1), exp_ret, torch.float64)
    # and the same as one process whitening the concatenated batch
    torch.testing.assert_close(joined("whiten"), alg.masked_whiten(x, mask), rtol=1e-12, atol=1e-12)
