"""The value side: per-token values of a batch, and the critic's clipped value loss.

values[:, t] is the critic's estimate before token t is generated: the value head's output
at position t-1, the same shift as the actor's log-probs.
"""

from __future__ import annotations

import torch

from spmd_rl.algo import algorithms as algos
from spmd_rl.batching import sequence_parallel
from spmd_rl.batching.batch import Batch
from spmd_rl.config.critic import CriticConfig
from spmd_rl.model.row_gather import pick_positions
from spmd_rl.train.actor import per_token_outputs


def forward_values(model: torch.nn.Module, mb: Batch) -> torch.Tensor:
    layout = sequence_parallel.make_layout(mb, model)
    out = model(**layout.inputs, use_cache=False).logits[..., 0].float()
    return layout.to_columns(pick_positions(out, layout.output_rows))  # shared prompts: before each response token


def compute_values(model: torch.nn.Module, batch: Batch, micro_batch_size: int, device: torch.device,
                   max_tokens: int = 0) -> torch.Tensor:
    return per_token_outputs(model, batch, lambda mb: forward_values(model, mb), micro_batch_size, device, max_tokens)


def critic_loss_fn(model: torch.nn.Module, cfg: CriticConfig):
    def loss_fn(mb: Batch, denom: float):
        values = forward_values(model, mb)
        loss, m = algos.value_loss(values, mb["values"], mb["returns"], mb["response_mask"],
                                   cfg.cliprange_value, cfg.loss_agg_mode, denom=denom)
        metrics = {"vf_loss": loss.detach(), **m,  # 0-d tensors, read once per update (update.ppo_update)
                   "vpred_mean": algos.masked_mean(values.detach(), mb["response_mask"])}
        return loss, metrics

    return loss_fn
