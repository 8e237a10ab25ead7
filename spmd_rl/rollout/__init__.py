"""Rollout engines: the interface (base.py), transformers generate (hf_engine.py, CPU/tests) and the
colocated vLLM engine (vllm/, GPU). vLLM is imported only when a vLLM engine is built
(build.build_engine picks the engine `rollout.engine` names)."""

from __future__ import annotations

from spmd_rl.rollout.base import Completion, RolloutEngine, SamplingParams

__all__ = ["Completion", "RolloutEngine", "SamplingParams"]
