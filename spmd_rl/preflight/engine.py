"""The rollout engine's own arguments, checked against the engine (called by preflight.validate)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from spmd_rl.config.run_config import Config


def check_engine_kwargs(cfg: Config) -> None:
    """rollout.engine_kwargs are arguments vLLM takes (vLLM is imported only when some are set)."""
    from spmd_rl.rollout.vllm.kwargs import check_engine_kwargs as check

    check(cfg.rollout)
