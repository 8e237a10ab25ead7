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

The engine's weights kept on the GPU while it sleeps (rollout.weights_stay_on_gpu): with LoRA's
adapter sync the base never changes, yet vLLM's sleep at level 1 copies it to host memory at every
sleep and back at every wake-up. `keep_weights_on_gpu(llm)` gives the engine's worker a sleep-mode
backend (vLLM 0.26's pluggable `SleepModeBackend`, vllm/device_allocator/sleep_mode_backend.py) whose
suspend releases only what is not tagged "weights" (the KV cache) and whose resume maps back only
what it released: nothing is copied. Its two halves, `release` and `map_back`, work on vLLM's
allocator (`CuMemAllocator`: `pointer_to_data` of allocations with a handle, a tag and `is_asleep`).
"""

from __future__ import annotations

import gc
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


KEPT = ("weights",)
"""The tags of vLLM's sleep pool that stay mapped while the engine sleeps with its weights kept."""


def release(allocator, keep: tuple[str, ...], unmap) -> int:
    """Unmap and release every allocation of `allocator` not tagged one of `keep` and not asleep
    already, with `unmap(handle)` (vLLM's `unmap_and_release`); its contents are dropped. Returns
    the bytes released."""
    freed = 0
    for data in allocator.pointer_to_data.values():
        if data.tag in keep or data.is_asleep:
            continue
        try:
            unmap(data.handle)
        finally:
            data.is_asleep = True
        freed += data.handle[1]
    return freed


def map_back(allocator, tags: list[str] | None, create) -> int:
    """Map back, with `create(handle)` (vLLM's `create_and_map`), every allocation `release` released
    whose tag is in `tags` (None: every tag); its contents are whatever the new memory holds, as after
    vLLM's own wake-up of a discarded tag. Returns the bytes mapped."""
    mapped = 0
    for data in allocator.pointer_to_data.values():
        if data.is_asleep and (tags is None or data.tag in tags):
            create(data.handle)
            data.is_asleep = False
            mapped += data.handle[1]
    return mapped


def mapped_bytes(allocator) -> dict[str, int]:
    """Bytes of `allocator`'s allocations mapped now, by tag."""
    out: dict[str, int] = {}
    for data in allocator.pointer_to_data.values():
        if not data.is_asleep:
            out[data.tag] = out.get(data.tag, 0) + data.handle[1]
    return out


def weights_stay_backend():
    """The class of the sleep-mode backend that keeps the weights mapped (the module doc): vLLM's
    `CuMemBackend` with its two methods replaced. Made on call: this module imports no vLLM."""
    import torch
    from vllm.device_allocator import get_mem_allocator_instance
    from vllm.device_allocator.cumem import create_and_map, unmap_and_release
    from vllm.device_allocator.sleep_mode_backend import CuMemBackend

    class WeightsStayBackend(CuMemBackend):
        def suspend(self, level: int = 1) -> None:
            self._state = "SUSPENDED"
            release(get_mem_allocator_instance(), KEPT, unmap_and_release)
            gc.collect()
            torch.cuda.empty_cache()

        def resume(self, tags: list[str] | None = None) -> None:
            self._state = "RESUMING"
            map_back(get_mem_allocator_instance(), tags, create_and_map)
            self._state = "RUNNING"

    return WeightsStayBackend


def engine_worker(llm):
    """The worker of an engine built with the external launcher (one worker, in this process)."""
    return llm.llm_engine.model_executor.driver_worker.worker


def keep_weights_on_gpu(llm, backend=None) -> None:
    """Give `llm`'s worker the backend that keeps its weights on the GPU while it sleeps (`backend`:
    its class, `weights_stay_backend()` when None). Before the engine's first sleep: the worker makes
    vLLM's own backend then, and a sleep that already moved the weights to host memory would leave
    them there."""
    worker = engine_worker(llm)
    if not hasattr(worker, "_sleep_mode_backend"):
        raise RuntimeError("this vLLM has no pluggable sleep-mode backend (vLLM 0.26's Worker._sleep_mode_backend), "
                           "which keeping the engine's weights on the GPU needs: set rollout.weights_stay_on_gpu = "
                           "false, or install the vLLM version of the `vllm` extra")
    backend = backend or weights_stay_backend()
    if worker._sleep_mode_backend is not None and not isinstance(worker._sleep_mode_backend, backend):
        raise RuntimeError("the engine has slept already with vLLM's own sleep-mode backend: keep_weights_on_gpu "
                           "must come before its first sleep")
    worker._sleep_mode_backend = backend()


def held_while_asleep() -> dict[str, int]:
    """Bytes of vLLM's sleep pool mapped now, by tag (while the engine sleeps: what it keeps)."""
    from vllm.device_allocator import get_mem_allocator_instance

    return mapped_bytes(get_mem_allocator_instance())
