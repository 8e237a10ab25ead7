"""Rollout engines: the interface (base.py), transformers generate (hf_engine.py, CPU/tests) and the
colocated vLLM engine (vllm_engine.py, GPU). vLLM is imported only when a vLLM engine is built."""

from __future__ import annotations

from spmd_rl.rollout.base import Completion, RolloutEngine, SamplingParams

__all__ = ["Completion", "RolloutEngine", "SamplingParams", "make_engine"]


def make_engine(cfg, model_dir: str, rank: int, world_size: int, local_rank: int, local_world_size: int, **hf_kwargs):
    """The engine `cfg.rollout.engine` names. "vllm": VLLMEngine(cfg, model_dir, ranks...), built
    asleep. "hf": HFEngine(**hf_kwargs) (model, pad_token_id, eos_token_ids, device, ...)."""
    engine = cfg.rollout.engine
    if engine == "vllm":
        from spmd_rl.rollout.vllm_engine import VLLMEngine

        return VLLMEngine(cfg, model_dir, rank, world_size, local_rank, local_world_size)
    if engine == "hf":
        from spmd_rl.rollout.hf_engine import HFEngine

        return HFEngine(**hf_kwargs)
    raise ValueError(f"rollout.engine = {engine!r}: use 'hf' or 'vllm'")
