"""The value side: per-token values of a batch, and the critic's clipped value loss.

values[:, t] is the critic's estimate before token t is generated: the value head's output
at position t-1, the same shift as the actor's log-probs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from spmd_rl import algorithms as algos
from spmd_rl.actor import reshard
from spmd_rl.batch import Batch, iter_micro_batches
from spmd_rl.config import CriticConfig


def forward_values(model: torch.nn.Module, mb: Batch) -> torch.Tensor:
    out = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"], use_cache=False).logits
    return F.pad(out[:, :-1, 0].float(), (1, 0))


@torch.no_grad()
def compute_values(model: torch.nn.Module, batch: Batch, micro_batch_size: int, device: torch.device) -> torch.Tensor:
    out = torch.zeros(batch["input_ids"].shape, dtype=torch.float32)
    row = 0
    for mb in iter_micro_batches(batch, micro_batch_size):
        v = forward_values(model, mb.to(device))
        out[row:row + len(mb), :v.shape[1]] = v.cpu()
        row += len(mb)
    reshard(model)
    return out * batch["response_mask"]


def critic_loss_fn(model: torch.nn.Module, cfg: CriticConfig):
    def loss_fn(mb: Batch, denom: float):
        values = forward_values(model, mb)
        loss, m = algos.value_loss(values, mb["values"], mb["returns"], mb["response_mask"],
                                   cfg.cliprange_value, cfg.loss_agg_mode, denom=denom)
        metrics = {"vf_loss": loss.item(), **{k: float(v) for k, v in m.items()},
                   "vpred_mean": algos.masked_mean(values.detach(), mb["response_mask"]).item()}
        return loss, metrics

    return loss_fn
