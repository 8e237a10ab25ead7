"""The distributed, micro-batched update computes the same gradient as one process doing the
whole mini-batch at once, for every loss aggregation mode; and the FSDP2-wrapped model gives
the same log-probs as a plain `from_pretrained` model."""

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from dist_utils import run_distributed

MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")


def tiny_config():
    return Qwen2Config(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)


def make_batch(seed=0, rows=8):
    """Rows with different prompt/response lengths and right padding, plus PPO inputs."""
    from spmd_rl.batch import Batch

    g = torch.Generator().manual_seed(seed)
    L = 12
    ids = torch.randint(2, 50, (rows, L), generator=g)
    attn = torch.zeros(rows, L, dtype=torch.long)
    resp = torch.zeros(rows, L)
    for i in range(rows):
        p = int(torch.randint(2, 5, (1,), generator=g))
        r = int(torch.randint(1, L - p + 1, (1,), generator=g))
        attn[i, :p + r] = 1
        resp[i, p:p + r] = 1
    ids = ids * attn
    return Batch(dict(input_ids=ids, attention_mask=attn, response_mask=resp,
                      old_logprobs=(-torch.rand(rows, L, generator=g) * 3) * resp,
                      advantages=torch.randn(rows, L, generator=g) * resp))


def reference_grads(model, batch, mode):
    """float64, whole batch, written out plainly (no spmd_rl code)."""
    model = model.double()
    reference_loss(model, batch, mode).backward()
    return {n: p.grad.float() for n, p in model.named_parameters()}


def reference_loss(model, batch, mode):
    """The actor's PPO loss (clip 0.2 / 0.28, dual clip 3) of the whole batch for a float64 model,
    written out plainly (no spmd_rl code)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    logp = torch.log_softmax(logits, -1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    mask = batch["response_mask"][:, 1:].double()
    ratio = torch.exp(logp - batch["old_logprobs"][:, 1:].double())
    adv = batch["advantages"][:, 1:].double()
    per_tok = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.28))
    per_tok = torch.where(adv < 0, torch.minimum(per_tok, -adv * 3.0), per_tok)
    if mode == "token-mean":
        loss = (per_tok * mask).sum() / mask.sum()
    elif mode == "seq-mean-token-sum":
        loss = (per_tok * mask).sum(-1).mean()
    else:
        loss = ((per_tok * mask).sum(-1) / mask.sum(-1)).mean()
    return loss


# (remove_padding, chunked_logprobs, max_tokens): the padded full-logits path in micro-batches of one
# row, and packed rows with chunked log-probs in token-budget micro-batches (2-3 rows of <= 12 tokens).
LAYOUTS = {"padded-full-logits": (False, False, 0), "packed-chunked-token-budget": (True, True, 20)}


def _update_body(rank, world, layout):
    from torch.distributed.device_mesh import init_device_mesh

    from spmd_rl.actor import actor_loss_fn
    from spmd_rl.config import ActorConfig
    from spmd_rl.models import apply_fsdp, prepare_policy
    from spmd_rl.update import ppo_update

    remove_padding, chunked, max_tokens = LAYOUTS[layout]
    mesh = init_device_mesh("cpu", (world,))
    batch = make_batch()
    for mode in MODES:
        torch.manual_seed(0)
        plain = Qwen2ForCausalLM(tiny_config())
        model = Qwen2ForCausalLM(tiny_config())
        model.load_state_dict(plain.state_dict())
        ref = reference_grads(plain, batch, mode)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        apply_fsdp(prepare_policy(model, remove_padding, chunked), mesh, torch.float32)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)  # delta = -grad exactly
        cfg = ActorConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, loss_agg_mode=mode)
        rows = len(batch) // world
        mine = batch.select(slice(rank * rows, (rank + 1) * rows))
        metrics = ppo_update(model, opt, mine, actor_loss_fn(model, cfg, 1.0), mini_batch_size=rows,
                             micro_batch_size=1, epochs=1, grad_clip=0.0, loss_agg_mode=mode,
                             device=torch.device("cpu"), max_tokens=max_tokens)
        for n, p in model.named_parameters():
            got = before[n] - p.full_tensor()
            torch.testing.assert_close(got, ref[n], rtol=1e-4, atol=1e-6, msg=f"{mode} {n}")
        assert abs(metrics["grad_norm"] - torch.sqrt(sum((g.double() ** 2).sum() for g in ref.values())).item()) < 1e-4


@pytest.mark.parametrize("layout", LAYOUTS)
def test_distributed_micro_batched_update_matches_full_batch_reference(layout):
    run_distributed(_update_body, 2, layout)


def _fsdp_logprobs_body(rank, world, model_dir):
    from torch.distributed.device_mesh import init_device_mesh

    from spmd_rl.actor import compute_logprobs
    from spmd_rl.models import apply_fsdp, load_causal_lm

    mesh = init_device_mesh("cpu", (world,))
    batch = make_batch(seed=1)
    plain = Qwen2ForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    actor = apply_fsdp(load_causal_lm(model_dir, torch.float32), mesh, torch.float32)
    assert actor.lm_head.weight is actor.model.embed_tokens.weight  # still tied after wrapping
    got = compute_logprobs(actor, batch, 0.7, micro_batch_size=3, device=torch.device("cpu"))
    with torch.no_grad():
        logits = plain(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1] / 0.7
        want = torch.log_softmax(logits.double(), -1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    want = torch.nn.functional.pad(want, (1, 0)).float() * batch["response_mask"]
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5)


def test_fsdp_actor_logprobs_match_plain_from_pretrained(tmp_path):
    from spmd_rl.models import materialize_random_model

    materialize_random_model(str(tmp_path), tiny_config(), seed=3, dtype=torch.float32)
    run_distributed(_fsdp_logprobs_body, 2, str(tmp_path))
