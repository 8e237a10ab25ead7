"""The policy side: token log-probs of a batch, and the actor's PPO loss.

Log-probs use logits / temperature, the distribution the rollout sampled from, so the
ratio to the engine's log-probs is 1 when the weights agree (the mismatch metric).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule

from spmd_rl import algorithms as algos
from spmd_rl.batch import Batch, iter_micro_batches
from spmd_rl.config import ActorConfig


def forward_logprobs(model: torch.nn.Module, mb: Batch, temperature: float, with_entropy: bool = False,
                     entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[B, L] log p(token_t | tokens < t) (column 0 is 0), and optionally the entropy of the
    distribution that predicted token t (differentiable only with entropy_grad)."""
    logits = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"], use_cache=False).logits
    logits = logits[:, :-1].float() / temperature
    targets = mb["input_ids"][:, 1:]
    logp = torch.gather(F.log_softmax(logits, dim=-1), -1, targets[..., None])[..., 0]
    logp = F.pad(logp, (1, 0))
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = F.pad(algos.entropy_from_logits(logits if entropy_grad else logits.detach()), (1, 0))
    return logp, entropy


@torch.no_grad()
def compute_logprobs(model: torch.nn.Module, batch: Batch, temperature: float, micro_batch_size: int,
                     device: torch.device) -> torch.Tensor:
    """Log-probs for the whole batch, [B, L] on CPU, in micro-batches."""
    out = torch.zeros(batch["input_ids"].shape, dtype=torch.float32)
    row = 0
    for mb in iter_micro_batches(batch, micro_batch_size):
        logp, _ = forward_logprobs(model, mb.to(device), temperature)
        out[row:row + len(mb), :logp.shape[1]] = logp.cpu()
        row += len(mb)
    reshard(model)
    return out * batch["response_mask"]


def reshard(model: torch.nn.Module) -> None:
    """After a no-grad forward FSDP2 keeps the root's parameters (embeddings, lm_head, norm)
    unsharded -- 2.2 GB per rank for a 7B model, held through the rollout. Free them, and those of
    any other unit left unsharded (a no-op for units that already are)."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def actor_loss_fn(model: torch.nn.Module, cfg: ActorConfig, temperature: float):
    """The per-micro-batch loss of the policy update (see update.LossFn)."""

    def loss_fn(mb: Batch, denom: float):
        mask = mb["response_mask"]
        need_entropy_grad = cfg.entropy_coeff != 0  # entropy is always logged; only its bonus needs a gradient
        logp, entropy = forward_logprobs(model, mb, temperature, with_entropy=True, entropy_grad=need_entropy_grad)
        old, adv = mb["old_logprobs"], mb["advantages"]
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
        metrics = {"pg_loss": pg_loss.item(), "entropy": algos.masked_mean(entropy.detach(), mask).item(),
                   **{k: float(v) for k, v in m.items()}}
        if need_entropy_grad:
            ent = algos.agg_loss(entropy, mask, cfg.loss_agg_mode, denom=denom)
            loss = loss - cfg.entropy_coeff * ent
        if cfg.use_kl_loss:
            kl = algos.kl_penalty(logp, mb["ref_logprobs"], cfg.kl_loss_type)
            kl_loss = algos.agg_loss(kl, mask, cfg.loss_agg_mode, denom=denom)
            loss = loss + cfg.kl_loss_coef * kl_loss
            metrics["kl_loss"] = kl_loss.item()
        return loss, metrics

    return loss_fn

