"""Rollout-mismatch correction, GSPO / CISPO losses and DAPO overlong shaping against float64
references written as plain Python loops (same batch layout and helpers as test_algorithms), and
the correction on a real engine that differs from the actor."""

from __future__ import annotations

import math

import pytest
import torch

from spmd_rl.algo import algorithms as alg
from spmd_rl.algo import rollout_correction as rc
from tests.algo.test_algorithms import MODES, SEEDS, close, make_mask, randn, ref_agg, rows_cols

LEVELS = ["", "token", "sequence", "geometric"]
# bounds per mask level that the noise of perturbed_logprobs crosses in both directions
BOUNDS = {"": (0.5, 2.0), "token": (0.5, 2.0), "sequence": (0.8, 1.25), "geometric": (0.95, 1.05)}


def perturbed_logprobs(mask, seed):
    """(actor old log-probs, engine log-probs) that differ by noise on response tokens, from
    0.05 on the first row to 1.2 on the last (so bounds cut some rows and not others)."""
    old = -randn(mask.shape, seed).abs() * 2 * mask
    scale = torch.linspace(0.05, 1.2, mask.shape[0], dtype=torch.float64)[:, None]
    eng = (old + randn(mask.shape, seed + 100) * scale) * mask
    return old, eng


def ref_correction(old, eng, m, is_level, cap, mask_level, low, high, reject):
    """(weights, keep) per token as lists, from the definitions."""
    weights = [[0.0] * len(r) for r in m]
    keep = [[0.0] * len(r) for r in m]
    for b, row in enumerate(m):
        toks = [t for t, x in enumerate(row) if x]
        lr = {t: old[b][t] - eng[b][t] for t in toks}
        total = sum(lr.values())
        level = {"token": lambda t: lr[t], "sequence": lambda t: total,
                 "geometric": lambda t: total / max(len(toks), 1)}

        def ratio(lv, t):
            return math.exp(min(max(level[lv](t), -20.0), 20.0))

        rejected = reject and any(not (low <= math.exp(lr[t]) <= high) for t in toks)
        for t in toks:
            kept = not rejected and (not mask_level or low <= ratio(mask_level, t) <= high)
            keep[b][t] = 1.0 if kept else 0.0
            if kept:
                weights[b][t] = min(ratio(is_level, t), cap) if is_level else 1.0
    return weights, keep


CASES = [  # (is_level, mask_level, reject_sequences): every level in each role, and combinations
    ("token", "", False), ("sequence", "", False), ("geometric", "", False), ("", "token", False),
    ("", "sequence", False), ("", "geometric", False), ("", "", True), ("token", "token", True),
    ("geometric", "sequence", False), ("sequence", "token", True),
]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("is_level,mask_level,reject", CASES)
def test_correction_weights_and_keep_match_reference(seed, is_level, mask_level, reject):
    mask = make_mask(7, 12, seed, empty_row=True)
    old, eng = perturbed_logprobs(mask, seed)
    low, high = BOUNDS[mask_level]
    corr, metrics = rc.correct(old, eng, mask, is_level=is_level, is_threshold=2.0, mask_level=mask_level,
                               mask_low=low, mask_high=high, reject_sequences=reject)
    w, keep = ref_correction(old.tolist(), eng.tolist(), mask.tolist(), is_level, 2.0, mask_level, low, high, reject)
    close(corr.weights, w, torch.float64)
    close(corr.keep, keep, torch.float64)
    # metrics from the same definitions
    tokens = rows_cols(mask.tolist())
    kept = [(b, t) for b, t in tokens if keep[b][t]]
    rows = [b for b in range(7) if any(mask[b].tolist())]
    lr = {(b, t): float(old[b, t] - eng[b, t]) for b, t in tokens}
    if kept:
        assert metrics["is_weight_mean"].item() == pytest.approx(sum(w[b][t] for b, t in kept) / len(kept))
        assert metrics["is_weight_max"].item() == pytest.approx(max(w[b][t] for b, t in kept))
    masked = sum(1 for b, t in tokens if not keep[b][t]) / len(tokens)
    assert metrics["token_masked_frac"].item() == pytest.approx(masked)
    dropped_rows = sum(1 for b in rows if not any(keep[b])) / len(rows)
    assert metrics["seq_masked_frac"].item() == pytest.approx(dropped_rows)
    assert metrics["chi2_token"].item() == pytest.approx(sum(math.exp(2 * v) for v in lr.values()) / len(tokens) - 1)
    seq = [sum(v for (bb, _), v in lr.items() if bb == b) for b in rows]
    assert metrics["chi2_seq"].item() == pytest.approx(sum(math.exp(2 * s) for s in seq) / len(rows) - 1, rel=1e-9)
    ppl_a = math.exp(-sum(old[b, t].item() for b, t in tokens) / len(tokens))
    ppl_e = math.exp(-sum(eng[b, t].item() for b, t in tokens) / len(tokens))
    assert metrics["ppl_actor"].item() == pytest.approx(ppl_a)
    assert metrics["ppl_engine"].item() == pytest.approx(ppl_e)
    assert metrics["ppl_ratio"].item() == pytest.approx(ppl_a / ppl_e)
    if is_level == "token":
        trunc = sum(1 for v in lr.values() if math.exp(v) > 2.0) / len(tokens)
        assert metrics["truncated_frac"].item() == pytest.approx(trunc)
    if mask_level or reject:
        assert 0 < masked < 1  # the noise puts some tokens out of bounds, and keeps others


def ref_policy_grad(kind, lp, old, adv, m, mode, w, low=0.2, high=0.28):
    """Loss and d loss / d logprob, from per-token float64 scalar tensors."""
    lps = [[torch.tensor(v, dtype=torch.float64, requires_grad=True) for v in row] for row in lp]
    per = [[0.0] * len(row) for row in lp]
    for b, row in enumerate(m):
        toks = [t for t, x in enumerate(row) if x]
        if kind == "gspo" and toks:
            s_i = math.exp(sum(lp[b][t] - old[b][t] for t in toks) / len(toks))
        for t in toks:
            a = adv[b][t]
            if kind == "gspo":  # GSPO-token: s_t = sg[s_i] * pi_t / sg[pi_t]
                s = s_i * torch.exp(lps[b][t] - lp[b][t])
                pg = torch.maximum(-a * s, -a * torch.clamp(s, 1 - low, 1 + high))
            elif kind == "cispo":
                pg = -a * min(math.exp(lp[b][t] - old[b][t]), 1 + high) * lps[b][t]
            else:
                r = torch.exp(lps[b][t] - old[b][t])
                pg = torch.maximum(-a * r, -a * torch.clamp(r, 1 - low, 1 + high))
            per[b][t] = pg * w[b][t]
    loss = ref_agg(per, m, mode)
    loss.backward()
    grad = [[0.0 if x.grad is None else x.grad.item() for x in row] for row in lps]
    return loss.item(), grad


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["ppo", "gspo", "cispo"])
def test_policy_losses_with_is_weights_match_reference(seed, mode, kind):
    mask = make_mask(6, 11, seed, empty_row=True)
    old = -randn(mask.shape, seed).abs() * mask
    lp = (old + randn(mask.shape, seed + 1, 0.3)) * mask
    adv = randn(mask.shape, seed + 2) * mask
    w = randn(mask.shape, seed + 3).abs() * mask
    # GSPO's sequence ratio is clipped at 1 +- 3e-4: widen here so both branches occur
    low, high = (0.2, 0.28) if kind != "gspo" else (0.05, 0.05)
    x = lp.clone().requires_grad_(True)
    if kind == "gspo":
        loss, _ = alg.gspo_loss(x, old, adv, mask, low, high, mode, is_weights=w)
    elif kind == "cispo":
        loss, _ = alg.cispo_loss(x, old, adv, mask, high, mode, is_weights=w)
    else:
        loss, _ = alg.policy_loss(x, old, adv, mask, low, high, 0.0, mode, is_weights=w)
    loss.backward()
    want, grad = ref_policy_grad(kind, lp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), mode, w.tolist(),
                                 low, high)
    assert loss.item() == pytest.approx(want, rel=1e-10, abs=1e-12)
    close(x.grad, grad, torch.float64)


def test_gspo_token_gradient_equals_sequence_gspo():
    """GSPO paper: with one advantage per sequence and seq-mean-token-mean, GSPO-token's gradient
    is that of the sequence objective -A_i * clip-min(s_i) with s_i = exp(mean log-ratio)."""
    mask = make_mask(5, 10, 7)
    old = -randn(mask.shape, 7).abs() * mask
    lp = (old + randn(mask.shape, 8, 0.01)) * mask
    a = randn(5, 9)
    adv = a[:, None] * mask
    x = lp.clone().requires_grad_(True)
    alg.gspo_loss(x, old, adv, mask, 3e-4, 4e-4, "seq-mean-token-mean")[0].backward()
    y = lp.clone().requires_grad_(True)
    s = torch.exp(((y - old) * mask).sum(-1) / mask.sum(-1))
    seq_loss = torch.maximum(-a * s, -a * s.clamp(1 - 3e-4, 1 + 4e-4)).mean()
    seq_loss.backward()
    torch.testing.assert_close(x.grad, y.grad * mask, rtol=1e-10, atol=1e-12)
    assert (x.grad != 0).any() and ((s - 1).abs() > 4e-4).any()  # some sequences clipped, some not


def test_overlong_penalty_matches_dapo_formula():
    lens = torch.arange(0, 13)
    got = alg.overlong_penalty(lens, max_length=12, buffer=4, factor=0.5)
    for n, g in zip(lens.tolist(), got.tolist()):
        want = 0.0 if n <= 8 else (8 - n) / 4 * 0.5
        assert g == pytest.approx(want), n
    assert alg.overlong_penalty(lens, 12, 0, 1.0).abs().sum() == 0


# --------------------------------------------------------------------------- a real engine != actor


def test_engine_different_from_actor_weights_are_exact_ratios_and_mask_is_exact():
    """An HF engine with perturbed weights samples; the actor scores the same tokens; the real
    batch path (build_rollout_batch -> compute_logprobs -> actor_update_batch) must give IS weights
    exp(actor - engine) token by token, and mask exactly the tokens outside the bounds."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from spmd_rl.batching.batch import build_rollout_batch
    from spmd_rl.config.algorithm import AlgorithmConfig
    from spmd_rl.rollout.base import SamplingParams
    from spmd_rl.rollout.hf_engine import HFEngine
    from spmd_rl.train.actor import compute_logprobs

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    from spmd_rl.model.loading import prepare_policy

    actor = prepare_policy(Qwen2ForCausalLM(cfg).eval())
    engine_model = Qwen2ForCausalLM(cfg).eval()
    engine_model.load_state_dict(actor.state_dict())
    with torch.no_grad():
        for p in engine_model.parameters():
            p.add_(torch.randn_like(p) * 0.3)  # a deliberately different engine
    engine = HFEngine(engine_model, pad_token_id=0, eos_token_ids=[1], device=torch.device("cpu"))
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    comps = engine.generate(prompts, SamplingParams(n=4, temperature=1.0, max_new_tokens=6, seed=3))
    batch = build_rollout_batch(prompts, comps, pad_id=0)
    batch["old_logprobs"] = compute_logprobs(actor, batch, 1.0, micro_batch_size=5, device=torch.device("cpu"))

    a = AlgorithmConfig(rollout_is="token", rollout_is_threshold=1e9, rollout_mask="token",
                        rollout_mask_low=0.7, rollout_mask_high=1.4)
    out, metrics = rc.actor_update_batch(batch, a)
    # independent reference: a float64 forward of the actor on each row, and the engine's own numbers
    actor64 = actor.double()
    n_in = n_out = 0
    row = 0
    for p, group in zip(prompts, comps):
        for c in group:
            ids = torch.tensor([p + c.token_ids])
            with torch.no_grad():
                logp = torch.log_softmax(actor64(input_ids=ids).logits[0, :-1], -1)
            for j, (tok, eng_lp) in enumerate(zip(c.token_ids, c.logprobs)):
                col = len(p) + j
                ratio = math.exp(logp[col - 1, tok].item() - eng_lp)
                inside = 0.7 <= ratio <= 1.4
                assert out["response_mask"][row, col].item() == float(inside), (row, col, ratio)
                if inside:
                    assert out["rollout_is_weights"][row, col].item() == pytest.approx(ratio, rel=1e-4)
                n_in += inside
                n_out += not inside
            assert out["response_mask"][row].sum().item() == sum(
                out["response_mask"][row, len(p):len(p) + len(c.token_ids)].tolist())  # nothing outside the response
            row += 1
    assert n_in > 0 and n_out > 0, (n_in, n_out)  # the perturbation put tokens on both sides
    assert metrics["rollout_corr/token_masked_frac"] == pytest.approx(n_out / (n_in + n_out))
    assert torch.equal(batch["response_mask"], (batch["response_mask"] > 0).float())  # the original is untouched


# --------------------------------------------------------------------------- the update's denominators


def _masked_update_body(rank, world):
    """2 ranks, micro-batches of 1: an update on a batch whose response mask was folded with a
    correction mask (some sequences fully rejected) and carries IS weights must give the float64
    gradient of the loss over the kept tokens only, in every aggregation mode."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import Qwen2ForCausalLM

    from spmd_rl.config.actor import ActorConfig
    from spmd_rl.model.loading import apply_fsdp, prepare_policy
    from spmd_rl.train.actor import actor_loss_fn
    from spmd_rl.train.update import ppo_update
    from tests.train.test_update import make_batch, tiny_config

    mesh = init_device_mesh("cpu", (world,))
    batch = make_batch(rows=8)
    g = torch.Generator().manual_seed(5)
    full = batch["response_mask"]
    keep = (torch.rand(full.shape, generator=g) > 0.3).float() * full
    keep[2] = 0.0  # a rejected sequence on rank 0, and one on rank 1
    keep[7] = 0.0
    batch["response_mask"] = keep
    batch["rollout_is_weights"] = (torch.rand(full.shape, generator=g) * 2) * keep
    for mode in MODES:
        torch.manual_seed(0)
        plain = Qwen2ForCausalLM(tiny_config()).double()
        model = prepare_policy(Qwen2ForCausalLM(tiny_config()))
        model.load_state_dict({k: v.float() for k, v in plain.state_dict().items()})
        logits = plain(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
        logp = torch.log_softmax(logits, -1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
        m = keep[:, 1:].double()
        ratio = torch.exp(logp - batch["old_logprobs"][:, 1:].double())
        adv = batch["advantages"][:, 1:].double()
        per = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.28))
        per = torch.where(adv < 0, torch.minimum(per, -adv * 3.0), per) * batch["rollout_is_weights"][:, 1:].double()
        live = m.sum(-1) > 0  # sequences with a kept token: only these count as sequences
        if mode == "token-mean":
            loss = (per * m).sum() / m.sum()
        elif mode == "seq-mean-token-sum":
            loss = (per * m).sum(-1)[live].sum() / live.sum()
        else:
            loss = ((per * m).sum(-1)[live] / m.sum(-1)[live]).sum() / live.sum()
        loss.backward()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        apply_fsdp(model, mesh, torch.float32)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        rows = len(batch) // world
        ppo_update(model, opt, batch.select(slice(rank * rows, (rank + 1) * rows)),
                   actor_loss_fn(model, ActorConfig(clip_ratio_high=0.28, loss_agg_mode=mode), 1.0),
                   mini_batch_size=rows, micro_batch_size=1, epochs=1, grad_clip=0.0, loss_agg_mode=mode,
                   device=torch.device("cpu"))
        for (n, p), (_, q) in zip(model.named_parameters(), plain.named_parameters()):
            torch.testing.assert_close(before[n] - p.full_tensor(), q.grad.float(), rtol=1e-4, atol=1e-6,
                                       msg=f"{mode} {n}")


def test_masked_tokens_and_rejected_sequences_leave_the_global_denominator():
    from tests.helpers.dist_utils import run_distributed

    run_distributed(_masked_update_body, 2)
