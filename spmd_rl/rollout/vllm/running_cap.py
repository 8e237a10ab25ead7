"""How many requests vLLM runs at once, set before each engine call where rollout.max_num_seqs is "auto".

vLLM runs up to `max_num_seqs` requests at once and, when its KV cache fills, preempts the newest
running one: its KV blocks are freed and it is prefilled again later, prompt and tokens so far. A cap
that never preempts must count every request at full length (data.max_response_length), which a run
whose responses are mostly shorter pays for in smaller decode batches: a long-tailed run's mean
response is a fraction of its longest.

With "auto", the engine is built for the most sequences a call has (at most 512:
spmd_rl/preflight/speed_settings.py), and before each call `RunningCap.before` sets vLLM's scheduler
to the requests the KV cache holds at their expected contexts:

    cap = KV tokens // (the call's mean prompt + the expected response), within [1, built]

The expected response is the mean length of the requests that finished in the engine's last call, at
most the call's mean token limit; before any request finished, the mean limit itself (so the first
call, at max_response_length, preempts none). A running request is on average part way through its
response, so a cap by the mean final context leaves room for lengths that vary; where responses
grow faster than this follows, vLLM preempts, counted in rollout/engine_preempted.

Every rank of a tensor-parallel group sees the same requests and outputs, so their caps agree and
their engines schedule alike. A rollout.max_num_seqs the user set is vLLM's own cap, unchanged.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


def running_cap(kv_tokens: int, prompt_mean: float, response_mean: float, built: int) -> int:
    """The requests whose expected contexts (prompt_mean + response_mean tokens) the KV cache holds,
    within [1, built]."""
    context = max(1.0, prompt_mean + response_mean)
    return max(1, min(built, int(kv_tokens // context)))


def scheduler_of(llm: Any) -> Any | None:
    """vLLM's scheduler in this process (the engine core runs in-process: external_launcher), or None
    where this vLLM keeps it elsewhere."""
    core = getattr(getattr(llm.llm_engine, "engine_core", None), "engine_core", None)
    scheduler = getattr(core, "scheduler", None)
    return scheduler if hasattr(scheduler, "max_num_running_reqs") else None


def kv_tokens_of(llm: Any) -> int:
    """Tokens the engine's KV cache holds (vLLM's "GPU KV cache size")."""
    cache = llm.llm_engine.vllm_config.cache_config
    return int(getattr(cache, "kv_cache_size_tokens", None) or cache.num_gpu_blocks * cache.block_size)


class RunningCap:
    """The per-call cap of one engine (the module docstring) and the preemptions since the last read."""

    def __init__(self, scheduler: Any, kv_tokens: int, built: int):
        self.scheduler, self.kv_tokens, self.built = scheduler, kv_tokens, built
        self.cap = built
        self.response_mean: float | None = None  # of the last call's finished requests
        self.preempted = 0
        preempt = getattr(scheduler, "_preempt_request", None)
        if preempt is not None:
            def counted(*args, **kwargs):
                self.preempted += 1
                return preempt(*args, **kwargs)

            scheduler._preempt_request = counted

    @classmethod
    def of(cls, llm: Any, built: int) -> RunningCap | None:
        """The cap of `llm` (built for `built` sequences at once); None, with a warning, where this
        vLLM's scheduler cannot be reached: vLLM's own cap of `built` then holds."""
        scheduler = scheduler_of(llm)
        if scheduler is None:
            log.warning("rollout.max_num_seqs = \"auto\": vLLM's scheduler is not reachable in this vLLM version, so "
                        "its cap stays at %d sequences at once whatever the KV cache holds", built)
            return None
        return cls(scheduler, kv_tokens_of(llm), built)

    def before(self, prompt_lengths: list[int], limits: list[int]) -> int:
        """Set the cap for a call of these requests (each a prompt and its token limit); returns it."""
        if not prompt_lengths:
            return self.cap
        limit_mean = sum(limits) / len(limits)
        expected = limit_mean if self.response_mean is None else min(self.response_mean, limit_mean)
        self.cap = running_cap(self.kv_tokens, sum(prompt_lengths) / len(prompt_lengths), expected, self.built)
        self.scheduler.max_num_running_reqs = self.cap
        return self.cap

    def finished(self, lengths: list[int]) -> None:
        """The response lengths of the requests that finished in the call (none: the last estimate stays)."""
        if lengths:
            self.response_mean = sum(lengths) / len(lengths)

    def metrics(self) -> dict[str, float]:
        """rollout/engine_max_running (the last call's cap) and rollout/engine_preempted (preemptions
        since the last read)."""
        out = {"rollout/engine_max_running": float(self.cap), "rollout/engine_preempted": float(self.preempted)}
        self.preempted = 0
        return out
