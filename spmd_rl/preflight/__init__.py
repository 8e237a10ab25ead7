"""The checks a run makes before any model loads, settings and world together: `validate(cfg,
world_size, gpus_per_node)` runs the settings' own checks (spmd_rl/config/) and those that need the
models' files and packages (models), the user's code (user_code), the run's synthetic data
(synthetic_data) and the engine (engine), in one order, the first that fails raising one
ConfigError that names the key and the fix. The entry point (spmd_rl/ppo.py) and the SLURM
launcher (launch/slurm.py) call it. Beside it: the memory plan and its refusal (memory) and what may
change at a resume (resume), which the entry point runs once the process group exists."""

from __future__ import annotations

from typing import TYPE_CHECKING

from spmd_rl.preflight import engine, models, synthetic_data, user_code

if TYPE_CHECKING:
    from spmd_rl.config.run_config import Config


def validate(cfg: Config, world_size: int = 1, gpus_per_node: int | None = None) -> None:
    """Every check, the first that fails raising: the choices; the model, its files and packages;
    the data; the batch layout over `world_size` ranks; sampling, losses and rewards; the engine's
    layout; the user's code; the trainer's paths; the ranges; last vLLM's keyword arguments."""
    cfg.check_choices()
    cfg.model.check_source()
    models.check_arch(cfg)
    cfg.model.check()
    models.check_lora_support(cfg)
    models.check_model_files(cfg)  # config.json, weights, tokenizer (no weights are read)
    models.check_reward_model_files(cfg)  # a one-label sequence classifier with a tokenizer
    models.check_chat_template(cfg)
    models.check_packed_attention(cfg)
    models.check_lora_targets(cfg)
    models.check_lora_in_latent_attention(cfg)
    models.check_router_aux_loss(cfg)
    synthetic_data.place_synthetic(cfg)  # before data.check: the run's own files become data.*_files
    cfg.data.check()
    cfg.trainer.check_layout(world_size, gpus_per_node)
    cfg.trainer.check_ulysses(cfg, world_size)
    models.check_attention_heads(cfg, world_size)
    cfg.data.check_layout(world_size)
    cfg.actor.check_batches(cfg, "actor", world_size)
    if cfg.use_critic:
        cfg.critic.check_batches(cfg, "critic", world_size)
    cfg.rollout.check_sampling()
    cfg.actor.check_loss()
    cfg.algorithm.check(cfg.rollout.n)
    cfg.reward.check(cfg.data.max_response_length)
    cfg.rollout.check_engine(world_size, gpus_per_node)
    cfg.check_lora_sync()
    cfg.rollout.check_multi_turn()
    cfg.rollout.check_partial(cfg.algorithm.dynamic_sampling)
    engine.check_length_profile(cfg)
    user_code.check_multi_turn_code(cfg)
    cfg.rollout.check_logprobs(cfg.rollout_logprob_readers())
    cfg.trainer.check(cfg.run_dir, cfg.checkpoint_dir)
    cfg.check_ranges()
    engine.check_engine_kwargs(cfg)  # last: with engine kwargs set, it imports vLLM to know its argument names
