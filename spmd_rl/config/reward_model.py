"""[reward_model]: a Bradley-Terry reward model that scores responses beside the rule reward."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from spmd_rl.config.checks import Rule

if TYPE_CHECKING:
    from spmd_rl.config.run_config import Config


@dataclass
class RewardModelConfig:
    path: str = ""
    """A local Hugging Face directory of a sequence-classification model with one label (a
    Bradley-Terry reward model: config.json's architectures end in "ForSequenceClassification",
    num_labels = 1); empty = no reward model. Each rank scores its own responses with it, as the
    conversation [prompt, response] rendered by the reward model's own chat template; the score
    is its output at the last token. FSDP-sharded like the reference model, frozen, and moved to the
    CPU with the training state while the engine generates (rollout.offload_train_states)."""
    tokenizer: str = ""
    """The reward model's tokenizer directory; empty = `path`'s. Without a chat template, the
    conversation's contents are joined by newlines (plain text)."""
    weight: float = 1.0
    """The reward model's score is added to the rule reward times this: score = reward.rule_weight *
    rule + reward_model.weight * reward model."""
    micro_batch_size_per_gpu: int = 8
    """Sequences per reward-model forward on one GPU (right-padded) when max_token_len_per_gpu is 0."""
    max_token_len_per_gpu: int = 0
    """Token budget of one reward-model forward on one GPU, padding included (the sequences sorted by
    length, so rows of a forward are of similar length); 0 = micro-batches of
    micro_batch_size_per_gpu sequences. A sequence longer than the budget gets a forward of its own."""

    @property
    def enabled(self) -> bool:
        return bool(self.path)

    def ranges(self, cfg: Config) -> list[Rule]:
        return [("weight", self.weight >= 0, ">= 0"),
                ("micro_batch_size_per_gpu", self.micro_batch_size_per_gpu >= 1, ">= 1"),
                ("max_token_len_per_gpu", self.max_token_len_per_gpu >= 0, ">= 0 (0 = count sequences)")]
