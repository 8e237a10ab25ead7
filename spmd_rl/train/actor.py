"""The policy side: token log-probs of a batch, and the actor's PPO loss.

Log-probs use logits / temperature, the distribution the rollout sampled from, so the
ratio to the engine's log-probs is 1 when the weights agree (the mismatch metric).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from spmd_rl.algo import algorithms as algos
from spmd_rl.batching import sequence_parallel
from spmd_rl.batching.batch import Batch, HostColumns, iter_micro_batches
from spmd_rl.config.actor import ActorConfig
from spmd_rl.model import routing
from spmd_rl.model.loading import reshard, shares_prompts

if TYPE_CHECKING:
    from spmd_rl.train.old_logprobs import UpdateLogprobs


def forward_logprobs(model: torch.nn.Module, mb: Batch, temperature: float, with_entropy: bool = False,
                     entropy_grad: bool = False, router_aux: list | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[b, L] log p(token_t | tokens < t) (column 0 is 0), and optionally the entropy of the
    distribution that predicted token t (differentiable only with entropy_grad). The model was
    loaded by `models.load_causal_lm`: packed or padded input as it was loaded for, log-probs
    from its hidden states (spmd_rl.model.logprob_head). A model set up for sequence parallelism
    (sequence_parallel.apply) takes this rank's slice of the packed row; every rank of its group
    gets the whole micro-batch's columns. A micro-batch with the engine's `routes` routes its tokens
    by them (actor.router_replay; spmd_rl.model.routing). `router_aux`: a list that gets the routers'
    load-balancing loss over this forward's real tokens (actor.router_aux_loss_coef)."""
    if not hasattr(model, "spmd_chunked_logprobs"):
        raise TypeError("forward_logprobs needs a model from models.load_causal_lm or models.prepare_policy")
    layout = sequence_parallel.make_layout(mb, model)
    routes = layout.token_rows(mb[routing.BATCH_KEY]) if routing.BATCH_KEY in mb else None
    with routing.replay(model, routes), routing.router_logits(model, router_aux is not None) as logits:
        logp, entropy = model(**layout.inputs, use_cache=False, logprob_targets=layout.targets,
                              logprob_rows=layout.output_rows, temperature=temperature, with_entropy=with_entropy,
                              entropy_grad=entropy_grad)
    if router_aux is not None and logits:
        real = layout.token_rows(mb["attention_mask"][..., None])[..., 0] > 0  # the forward's tokens, padding out
        router_aux.append(routing.load_balancing_loss(logits, routing.state_of(model).top_k, real))
    return layout.to_columns(logp), None if entropy is None else layout.to_columns(entropy)


@torch.no_grad()
def compute_logprobs(model: torch.nn.Module, batch: Batch, temperature: float, micro_batch_size: int,
                     device: torch.device, max_tokens: int = 0) -> torch.Tensor:
    """Log-probs for the whole batch, [B, L] on CPU, in micro-batches (of `max_tokens` real tokens
    when > 0, else of `micro_batch_size` rows)."""
    return per_token_outputs(model, batch, lambda mb: forward_logprobs(model, mb, temperature)[0],
                             micro_batch_size, device, max_tokens)


@torch.no_grad()
def per_token_outputs(model: torch.nn.Module, batch: Batch, forward, micro_batch_size: int, device: torch.device,
                      max_tokens: int = 0) -> torch.Tensor:
    """`forward(micro-batch on device) -> [b, l]` over the whole batch in micro-batches (see
    batch.iter_micro_batches), gathered into [B, L] float32 on CPU and masked to the responses;
    then the model's FSDP units are resharded (no-grad forwards leave the root gathered)."""
    out = HostColumns(batch["input_ids"].shape)
    for rows, mb in iter_micro_batches(batch, micro_batch_size, max_tokens, shares_prompts(model)):
        out.put(rows, forward(mb.to(device)))
    reshard(model)
    return out.result() * batch["response_mask"]


def actor_loss_fn(model: torch.nn.Module, cfg: ActorConfig, temperature: float,
                  own_logprobs: UpdateLogprobs | None = None):
    """The per-micro-batch loss of the policy update (see update.LossFn). `own_logprobs`
    (old_logprobs.UpdateLogprobs, the on-policy shortcut): the old log-probs are this forward's,
    detached, and so are the TIS weights; otherwise the batch's `old_logprobs` / `rollout_is_weights`."""

    def loss_fn(mb: Batch, denom: float):
        mask = mb["response_mask"]
        need_entropy_grad = cfg.entropy_coeff != 0  # entropy is always logged; only its bonus needs a gradient
        aux = [] if cfg.router_aux_loss_coef > 0 else None
        logp, entropy = forward_logprobs(model, mb, temperature, with_entropy=True, entropy_grad=need_entropy_grad,
                                         router_aux=aux)
        adv = mb["advantages"]
        if own_logprobs is not None:
            old, w = own_logprobs.take(mb, logp)
        else:
            old = mb["old_logprobs"]
            w = mb["rollout_is_weights"] if "rollout_is_weights" in mb else None  # rollout correction (TIS)
        if cfg.policy_loss == "gspo":
            pg_loss, m = algos.gspo_loss(logp, old, adv, mask, cfg.gspo_clip_ratio_low, cfg.gspo_clip_ratio_high,
                                         cfg.loss_agg_mode, denom=denom, is_weights=w)
        elif cfg.policy_loss == "cispo":
            pg_loss, m = algos.cispo_loss(logp, old, adv, mask, cfg.cispo_clip_ratio_high, cfg.loss_agg_mode,
                                          denom=denom, is_weights=w)
        else:
            pg_loss, m = algos.policy_loss(logp, old, adv, mask, cfg.clip_ratio_low, cfg.clip_ratio_high,
                                           cfg.clip_ratio_c, cfg.loss_agg_mode, denom=denom, is_weights=w)
        loss = pg_loss
        # 0-d tensors, read once per update (update.ppo_update): no wait for the GPU per micro-batch
        metrics = {"pg_loss": pg_loss.detach(), "entropy": algos.masked_mean(entropy.detach(), mask), **m}
        if need_entropy_grad:
            ent = algos.agg_loss(entropy, mask, cfg.loss_agg_mode, denom=denom)
            loss = loss - cfg.entropy_coeff * ent
        if cfg.use_kl_loss:
            kl = algos.kl_penalty(logp, mb["ref_logprobs"], cfg.kl_loss_type)
            kl_loss = algos.agg_loss(kl, mask, cfg.loss_agg_mode, denom=denom)
            loss = loss + cfg.kl_loss_coef * kl_loss
            metrics["kl_loss"] = kl_loss.detach()
        if aux:  # a mean over the micro-batch, weighted by its share of the mini-batch's denominator
            share = (mask.sum() if cfg.loss_agg_mode == "token-mean" else (mask.sum(-1) > 0).sum()) / denom
            aux_loss = share * aux[0]  # logged as added: a "loss" metric is summed over micro-batches
            loss = loss + cfg.router_aux_loss_coef * aux_loss
            metrics["router_aux_loss"] = aux_loss.detach()
        return loss, metrics

    return loss_fn

