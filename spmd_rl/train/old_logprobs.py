"""Where the old policy's log-probs come from: a separate no-grad pass, or the update's own forward.

The PPO ratio divides by pi_old, the policy that sampled the step (the actor before the update).
By default the trainer gets pi_old's log-probs in a no-grad pass over the step's rollouts before
the update. When the step is *on-policy* -- one epoch over one mini-batch, so the only optimizer
step comes after every micro-batch's forward -- the update's forward runs on exactly those weights
and gives the same log-probs; the pass is then pure cost (one forward over all the step's tokens).
This is TRL's num_iterations = 1 (old = the forward's log-probs, detached) and verl's on-policy mode.

The shortcut is taken (`Config.old_logprob_pass_reason()` is "") unless something needs the log-probs before
the update's forward, or the update's first forward is not the policy that sampled:

- actor.ppo_epochs > 1, or more than one mini-batch per step: later mini-batches / epochs run after
  an optimizer step, and their old log-probs must still be the sampling policy's;
- algorithm.use_kl_in_reward (fixed or adaptive): the reward's KL penalty, and with it the
  advantages, needs them before the update;
- algorithm.rollout_mask, algorithm.rollout_reject_sequences: masked tokens leave the loss's
  denominator (update.global_denominator), which is counted over the whole mini-batch before its
  first micro-batch's forward;
- actor.force_old_logprob_pass = true.

What the rest of the step reads from the old log-probs is the same with the shortcut:
- the policy losses (vanilla, gspo, cispo) get old = logp.detach() of the same forward;
- truncated IS (algorithm.rollout_is, any level) is row-local: `UpdateLogprobs.take` computes the
  weights per micro-batch (micro-batches hold whole rows) from the detached log-probs, as
  rollout_correction.correct does over the batch;
- the critic's update (before the actor's) reads values and returns, never old log-probs;
- the mismatch metrics (rollout/logprob_diff_*, rollout/mismatch_kl) and rollout_corr/* are
  computed after the update from the log-probs the update recorded (`UpdateLogprobs.logprobs`).

Numerically the two can differ at rounding level, never in the formula. The pass cuts its
micro-batches by actor.logprob_max_token_len_per_gpu (twice the update's token budget by default),
so a row is packed beside other rows than in the update; kernels whose summation order depends on
the packed micro-batch's shape (GPU GEMMs, bf16 compute, attention) then round its log-probs
differently (on CPU in float32 the tests find both bit for bit equal). With the pass the first
forward's ratio exp(logp - old) is 1 + that rounding, with the shortcut exactly 1 (ppo_kl exactly
0). The mismatch metrics then compare the engine with the update's forward instead of the pass's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from spmd_rl.algo.rollout_correction import is_weights
from spmd_rl.batching.batch import Batch, HostColumns

if TYPE_CHECKING:
    from spmd_rl.config.algorithm import AlgorithmConfig

ROW = "update_row"
"""Tensor key of a row's index in the step's batch, carried through the update's micro-batches."""


class UpdateLogprobs:
    """The on-policy shortcut during one actor update: each micro-batch's forward is the old
    policy; `take` hands the loss its detached log-probs (and TIS weights) and keeps them, by row,
    for the metrics after the update (`logprobs`)."""

    def __init__(self, actor_batch: Batch, alg: AlgorithmConfig):
        self.batch = Batch({**actor_batch.tensors, ROW: torch.arange(len(actor_batch))}, actor_batch.meta)
        """The update's batch: the actor's, with each row's index (ROW)."""
        self.alg = alg
        self._logprobs = HostColumns(actor_batch["input_ids"].shape)
        self._seen = torch.zeros(len(actor_batch), dtype=torch.long)

    def take(self, mb: Batch, logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(old log-probs, TIS weights or None) of micro-batch `mb` whose forward gave `logp` [b, l]."""
        old = logp.detach()
        rows = mb.host[ROW] if mb.host is not None else mb[ROW].cpu()  # the host's copy: no wait for the GPU
        self._logprobs.put(rows, old)
        self._seen[rows] += 1
        weights = None
        if self.alg.rollout_is:  # row-local: the same numbers as rollout_correction.correct over the batch
            weights = is_weights(old, mb["rollout_logprobs"], mb["response_mask"], self.alg.rollout_is,
                                 self.alg.rollout_is_threshold).float()
        return old, weights

    def logprobs(self, response_mask: torch.Tensor) -> torch.Tensor:
        """[B, L] old log-probs of the step on CPU, masked to the responses (compute_logprobs' layout).
        Raises if a row was not in exactly one micro-batch (the shortcut taken for a step that is
        not on-policy)."""
        if not bool((self._seen == 1).all()):
            raise RuntimeError("the update's forward saw some rows of the step not exactly once: the old log-probs "
                               "cannot come from it (see spmd_rl/train/old_logprobs.py)")
        return self._logprobs.result() * response_mask
