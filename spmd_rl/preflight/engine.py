"""The rollout engine's own arguments, checked against the engine, and the benchmarks' length profile
(called by preflight.validate)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from spmd_rl.config.run_config import Config


def check_engine_kwargs(cfg: Config) -> None:
    """rollout.engine_kwargs are arguments vLLM takes (vLLM is imported only when some are set)."""
    from spmd_rl.rollout.vllm.kwargs import check_engine_kwargs as check

    check(cfg.rollout)


def check_length_profile(cfg: Config) -> None:
    """rollout.length_profile parses (a histogram file is read) and has single-turn rollouts to shape."""
    r = cfg.rollout
    if not r.length_profile:
        return
    from spmd_rl.config.checks import need
    from spmd_rl.rollout.length_profile import parse

    try:
        parse(r.length_profile, "rollout.length_profile =")
    except ValueError as e:
        need(False, str(e))
    need(not r.multi_turn, "rollout.length_profile shapes single-turn responses: turn it off, or "
         "rollout.tools / rollout.environment")
