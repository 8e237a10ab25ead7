"""A run's whole config: the root dataclass whose fields are the sections, the settings derived
across sections, loading and validation.

A run is configured by a TOML file whose tables mirror the section dataclasses (`[model]` in
spmd_rl/config/model.py, `[data]` in data.py, ...: one file per table) plus dotted overrides on the
command line (`actor.lr=1e-6`). Each key is documented by the string right under it;
`python -m spmd_rl.config.reference --markdown` prints the reference (docs/config.md).

Batch sizes follow verl: *algorithm* sizes are global and counted in prompts
(`data.train_batch_size`, `actor.ppo_mini_batch_size`); *performance* sizes are
per GPU and counted in sequences (`*.micro_batch_size_per_gpu`). The derived
per-rank numbers are printed at start (`Config.describe_layout`).

`load_config` (reading: spmd_rl/config/toml_io.py) refuses unknown keys and wrong types. The checks
of the settings themselves are kept beside their keys (each section's `check...` and `ranges`) and,
across sections, here; spmd_rl/preflight/ runs them, in its order, among the checks that need the
model, the engine or the machine. Each refusal is one message that names the key and the fix,
before any model is loaded.
"""

from __future__ import annotations

import dataclasses
import math
import os
import typing
from dataclasses import dataclass, field
from typing import Any

from spmd_rl.config import actor, algorithm, critic, data, model, reward, reward_model, rollout, toml_io, trainer
from spmd_rl.config.actor import ActorConfig
from spmd_rl.config.algorithm import AlgorithmConfig
from spmd_rl.config.checks import AUTO, need, ordinal
from spmd_rl.config.critic import CriticConfig
from spmd_rl.config.data import DataConfig
from spmd_rl.config.model import ModelConfig
from spmd_rl.config.reward import RewardConfig
from spmd_rl.config.reward_model import RewardModelConfig
from spmd_rl.config.rollout import RolloutConfig
from spmd_rl.config.trainer import TrainerConfig
from spmd_rl.errors import ConfigError


class MicroBatching(typing.NamedTuple):
    """A role's micro-batches, resolved (Config.micro_batching)."""

    rows: int  # sequences per micro-batch where a token budget is 0
    update_tokens: int  # token budget of an update micro-batch (packed); 0 = `rows` sequences
    forward_tokens: int  # token budget of a no-grad pass (log-probs, values); 0 = `rows` sequences


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy (actor) model; the reference model is a frozen copy of its initial weights."""
    data: DataConfig = field(default_factory=DataConfig)
    """Datasets and sequence lengths."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Generation: sampling and the inference engine."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    """Policy optimisation."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """Value model (used when algorithm.adv_estimator = "gae")."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantage estimation and the KL reward penalty."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Reward scoring."""
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    """A reward model (Bradley-Terry) whose score is added to the rule reward's (off by default)."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """The loop: steps, validation, checkpoints, logging."""
    auto_chosen = ()  # not a setting (no annotation): the "section.key"s whose "auto" was chosen at start
    # (spmd_rl/preflight/speed_settings.py), noted in the saved config.toml

    def toml_notes(self) -> dict[str, str]:
        """config.toml's comment on each key whose value "auto" chose."""
        return {key: '"auto" chose this (spmd_rl/preflight/speed_settings.py)' for key in self.auto_chosen}

    # ---------------------------------------------------------------- derived
    @property
    def run_dir(self) -> str:
        return self.trainer.run_dir or os.path.join("runs", self.trainer.experiment_name)

    @property
    def checkpoint_dir(self) -> str:
        return self.trainer.checkpoint_dir or os.path.join(self.run_dir, "checkpoints")

    @property
    def use_critic(self) -> bool:
        return self.algorithm.adv_estimator == "gae"

    @property
    def use_reference(self) -> bool:
        return self.actor.use_kl_loss or self.algorithm.use_kl_in_reward

    def engine_sleep_level(self) -> int:
        """vLLM's sleep level: rollout.sleep_level, or where it is 0, 1 with LoRA's adapter sync (the
        base is kept in host memory, never sent again) and 2 otherwise (new weights every step)."""
        if self.rollout.sleep_level:
            return self.rollout.sleep_level
        return 1 if self.model.adapter_sync else 2

    def vllm_applies_adapter(self) -> bool:
        """Whether vLLM's LoRA layers apply the adapter sent each step (LoRA's adapter sync into the
        vLLM engine): the engine's base weights then never change after the first sync."""
        return self.model.adapter_sync and self.rollout.engine == "vllm"

    def engine_keeps_weights(self) -> bool:
        """Whether the engine's weights stay on the GPU while it sleeps (rollout.weights_stay_on_gpu):
        true once set or chosen; an "auto" not yet chosen (speed_settings, at start) reads as false."""
        return self.rollout.weights_stay_on_gpu is True

    def engine_stays_awake(self) -> bool:
        """Whether the vLLM engine stays awake between steps (rollout.stay_awake): true once set or chosen;
        an "auto" not yet chosen (speed_settings, at start) reads as false."""
        return self.rollout.engine == "vllm" and self.rollout.stay_awake is True

    def engine_max_model_len(self) -> int:
        """The engine's context length: rollout.max_model_len, or where it is 0 the longest prompt and
        response (data.max_prompt_length + data.max_response_length)."""
        return self.rollout.max_model_len or self.data.max_prompt_length + self.data.max_response_length

    def engine_sequences_per_call(self, world_size: int) -> int:
        """The most sequences one engine replica (rollout.tensor_parallel_size ranks) gets in a generate
        call of this run: training (data.train_batch_size / world_size prompts per rank, x rollout.n;
        with partial rollouts x rollout.partial_pool_batches, the most batches their run holds) or
        validation (a rank's share of data.val_batch_size, x rollout.val_n)."""
        d, r = self.data, self.rollout
        batches = r.partial_pool_batches if r.partial_rollouts else 1
        most = batches * d.train_batch_size // world_size * r.tensor_parallel_size * r.n
        if d.val_files:
            most = max(most, -(-d.val_batch_size // world_size) * r.tensor_parallel_size * r.val_n)
        return most

    def engine_kv_cache_tokens(self, world_size: int) -> int:
        """rollout.kv_cache_tokens as tokens on each GPU of a replica (0: vLLM sizes it from
        rollout.gpu_memory_utilization); "auto": each of a call's sequences (engine_sequences_per_call)
        at engine_max_model_len in whole KV blocks (rollout.block_size, vLLM's 16 where 0), plus vLLM's
        null block."""
        tokens = self.rollout.kv_cache_tokens
        if tokens != AUTO:
            return tokens
        block = self.rollout.block_size or 16
        return (self.engine_sequences_per_call(world_size) * -(-self.engine_max_model_len() // block) + 1) * block

    def check_lora_sync(self) -> None:
        """LoRA's adapter sync against the engine's sleep level; the weights kept on the GPU need it."""
        need(not (self.vllm_applies_adapter() and self.rollout.sleep_level == 2),
             'model.lora_sync = "adapter" sends the base weights to vLLM once and keeps them, but rollout.sleep_level '
             '= 2 drops them at every sleep (the base would be sent every step): set rollout.sleep_level = 0 (picks 1) '
             'or 1, or model.lora_sync = "merged"')
        need(not self.engine_keeps_weights() or self.vllm_applies_adapter(),
             'rollout.weights_stay_on_gpu = true keeps the vLLM engine\'s base weights on the GPU while it sleeps, which '
             'only LoRA\'s adapter sync can use (its base never changes): set it to false or "auto", or use '
             'rollout.engine = "vllm" with model.lora_rank > 0 and model.lora_sync = "adapter"')

    def check_choices(self) -> None:
        """Every key of CHOICES holds one of its choices."""
        for key, choices in CHOICES.items():
            section, name = key.split(".")
            value = str(getattr(getattr(self, section), name))
            need(value in choices, f"{key} = {value!r} is not one of {', '.join(repr(c) for c in choices)}")

    def check_ranges(self) -> None:
        """Every number a user sets, in its meaningful range (one message naming the key): finite,
        then each section's `ranges`."""
        for section in SECTIONS:
            for name, value in dataclasses.asdict(getattr(self, section)).items():
                for v in value if isinstance(value, list) else [value]:
                    if isinstance(v, float) and not math.isfinite(v):
                        raise ConfigError(f"{section}.{name} = {v} must be a finite number")
        for section in SECTIONS:
            for name, ok, expected in getattr(self, section).ranges(self):
                need(ok, f"{section}.{name} = {getattr(getattr(self, section), name)!r} must be {expected}")

    def micro_batching(self, role: str) -> MicroBatching:
        """How the "actor" (and reference) or the "critic" cuts its work into micro-batches, with
        the critic's unset keys taken from the actor. The token budgets are a micro-batch's: with
        sequence parallelism (trainer.ulysses_size) the per-GPU budget times the group's GPUs."""
        a, sp = self.actor, max(self.trainer.ulysses_size, 1)  # an SP group's micro-batch: sp GPUs' budgets
        if role == "actor":
            return MicroBatching(a.micro_batch_size_per_gpu, sp * a.max_token_len_per_gpu,
                                 sp * (a.logprob_max_token_len_per_gpu or 2 * a.max_token_len_per_gpu))
        c = self.critic
        tokens = a.max_token_len_per_gpu if c.max_token_len_per_gpu == -1 else c.max_token_len_per_gpu
        return MicroBatching(c.micro_batch_size_per_gpu or a.micro_batch_size_per_gpu, sp * tokens,
                             sp * (c.forward_max_token_len_per_gpu or 2 * tokens))

    def describe_layout(self, world_size: int) -> str:
        """The derived per-rank batch numbers, the micro-batching actually used and where the old
        log-probs come from (old_logprob_pass_reason), for the start-up log."""
        n = self.rollout.n
        per_rank_prompts = self.data.train_batch_size // world_size
        roles = [("actor", self.actor)] + ([("critic", self.critic)] if self.use_critic else [])
        shard = self.trainer.fsdp_size or world_size
        fsdp = "" if shard == world_size else f" (HSDP: {world_size // shard} replicas x shard groups of {shard})"
        sp = max(self.trainer.ulysses_size, 1)
        ulysses = "" if sp == 1 else (f" (sequence parallel: {world_size // sp} data-parallel x SP groups of {sp} "
                                      "ranks sharing each micro-batch)")
        parts = [f"world={world_size}{fsdp}{ulysses} | per step: {self.data.train_batch_size} prompts x n={n} = "
                 f"{self.data.train_batch_size * n} sequences ({per_rank_prompts * n} per rank)"]
        where = "rank" if sp == 1 else "SP group"
        for role, section in roles:
            mini_seqs = section.mini_batch_rows(n, world_size // sp)
            mb = self.micro_batching(role)
            if mb.update_tokens:
                cut = (f"packed into micro-batches of <= {mb.update_tokens} tokens "
                       f"(<= {mb.forward_tokens} without gradients)")
            else:
                cut = f"= {mini_seqs // mb.rows} micro-batches of {mb.rows} sequences"
            parts.append(f"{role}: {self.data.train_batch_size // section.ppo_mini_batch_size} optimizer steps "
                         f"x {section.ppo_epochs} epochs, {mini_seqs} sequences per {where} per mini-batch {cut}")
        parts.append(f"rollout log-probs: {self.rollout_logprobs_plan()[1]}")
        reason = self.old_logprob_pass_reason()
        parts.append(f"old log-probs: separate pass ({reason})" if reason else
                     "old log-probs: from the update's forward (on-policy: 1 mini-batch, 1 epoch)")
        return " | ".join(parts)

    def rollout_logprob_readers(self) -> list[str]:
        """The settings that read every response's rollout log-probs (the engine's log-prob of
        each sampled token), as `key = value`; the mismatch metrics make do with a sample."""
        alg = self.algorithm
        readers = [f"algorithm.{k} = {getattr(alg, k)!r}"
                   for k in ("rollout_is", "rollout_mask", "rollout_reject_sequences") if getattr(alg, k)]
        # a carried-over response keeps the log-probs of the policy that sampled each token
        return readers + (["rollout.partial_rollouts = true"] if self.rollout.partial_rollouts else [])

    def rollout_logprobs_plan(self) -> tuple[int, str]:
        """(SamplingParams.logprobs_every of the training rollouts: 1 = every prompt asks the engine
        for its responses' log-probs, k = every k-th, 0 = none; the reason in words)."""
        r, readers = self.rollout, self.rollout_logprob_readers()
        if r.calculate_log_probs == "on" or (r.calculate_log_probs == "auto" and readers):
            why = "rollout.calculate_log_probs = 'on'" if r.calculate_log_probs == "on" else f"{readers[0]} reads them"
            return 1, f"every response ({why})"
        why = ("rollout.calculate_log_probs = 'off'" if r.calculate_log_probs == "off" else
               "rollout.calculate_log_probs = 'auto' and no algorithm.rollout_is / rollout_mask / "
               "rollout_reject_sequences reads them")
        k = r.logprob_sample_every
        if k == 0:
            return 0, f"none ({why}; rollout.logprob_sample_every = 0: no mismatch metrics)"
        rows = "every prompt's responses" if k == 1 else f"the responses of every {ordinal(k)} prompt"
        return k, f"{rows}, for the mismatch metrics only ({why})"

    def old_logprob_pass_reason(self) -> str:
        """Why this run needs a separate no-grad pass for the old log-probs (the config keys in
        words); "" when it does not: they come from the update's own forward, detached
        (spmd_rl/train/old_logprobs.py says when that gives the same update)."""
        a, alg = self.actor, self.algorithm
        if a.force_old_logprob_pass:
            return "actor.force_old_logprob_pass = true"
        if a.ppo_epochs > 1:
            return f"actor.ppo_epochs = {a.ppo_epochs}: later epochs follow an optimizer step"
        mini_batches = self.data.train_batch_size // a.ppo_mini_batch_size
        if mini_batches > 1:
            return f"{mini_batches} mini-batches per step: later ones follow an optimizer step"
        if alg.use_kl_in_reward:
            return "algorithm.use_kl_in_reward: the reward's KL penalty needs them before the update"
        if alg.rollout_mask or alg.rollout_reject_sequences:
            key = "algorithm.rollout_mask" if alg.rollout_mask else "algorithm.rollout_reject_sequences"
            return f"{key}: masked tokens leave the loss's denominator, counted before the update's forward"
        return ""


SECTIONS = {f.name: f.type for f in dataclasses.fields(Config)}

CHOICES: dict[str, tuple[str, ...]] = {
    f"{name}.{key}": values
    for name, module in (("model", model), ("data", data), ("rollout", rollout), ("actor", actor), ("critic", critic),
                         ("algorithm", algorithm), ("reward", reward), ("reward_model", reward_model),
                         ("trainer", trainer))
    for key, values in getattr(module, "CHOICES", {}).items()
}
"""Every "section.key" that takes one of a few values (each section module's CHOICES)."""


# --------------------------------------------------------------------------- loading


def load_config(path: str | None = None, overrides: list[str] | None = None) -> Config:
    """Config from a TOML file (optional) and `section.key=value` overrides."""
    return toml_io.load(Config, path, overrides)


def config_from_dict(raw: dict[str, Any]) -> Config:
    return toml_io.from_dict(Config, raw)
