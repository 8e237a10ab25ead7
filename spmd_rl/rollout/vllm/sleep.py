"""vLLM's sleep on a GPU that other processes share: an adapter for vLLM 0.26's freed-memory check.

vLLM's worker checks that a sleep freed memory by reading the *device's* free memory before and
after it (vllm/v1/worker/gpu_worker.py, `Worker.sleep`: `assert freed_bytes >= 0, "Memory usage
increased after sleeping."`). That reading counts every process on the GPU. When another process
allocates more than the engine frees in those few milliseconds, the assertion fires although the
engine's memory was released: it comes after the release and before the executor records that it
sleeps (`sleeping_tags`, `is_sleeping`, vllm/v1/executor/abstract.py), so the next `wake_up` would
find it "not sleeping" and leave its memory released. vLLM waits for the reading to settle on ROCm
only. A small engine beside other GPU work meets it (docs/performance.md, "Learning checks
(multi-turn and single-turn)").

`sleep(llm, level)` runs `llm.sleep(level=level)` and, on that assertion alone, records the sleep as
vLLM's executor does after a good one, with one warning per process.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

SHARED_GPU_ASSERTION = "Memory usage increased after sleeping."
"""The message of vLLM 0.26's freed-memory assertion in `Worker.sleep`."""

survived = 0
"""Sleeps of this process whose freed-memory assertion this module caught (tests read it)."""


def sleep(llm, level: int) -> None:
    """`llm.sleep(level=level)`, surviving vLLM's freed-memory assertion (the module doc)."""
    global survived
    try:
        llm.sleep(level=level)
    except AssertionError as e:
        executor = llm.llm_engine.model_executor
        if str(e) != SHARED_GPU_ASSERTION or executor.is_sleeping:
            raise
        executor.sleeping_tags = {"weights", "kv_cache"}
        executor.is_sleeping = True
        survived += 1
        if survived == 1:
            log.warning("vLLM's sleep released its memory but found less free memory on the GPU than before "
                        "(another process on this GPU allocated meanwhile: %s); recorded the engine as asleep "
                        "(spmd_rl/rollout/vllm/sleep.py). Said once per process.", SHARED_GPU_ASSERTION)
