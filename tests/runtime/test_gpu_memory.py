"""spmd_rl/runtime/gpu_memory.py's free memory after the engine's turn, on stand-ins for the driver's and
PyTorch's allocator figures (no GPU needed)."""

import torch

from spmd_rl.runtime.gpu_memory import free_after_sleep_bytes

GiB = 2**30


def test_free_after_sleep_counts_pytorchs_unused_cache_only_with_the_engine_awake(monkeypatch):
    """Asleep, the cache was emptied: the driver's free bytes. Awake, the cache keeps training's blocks
    (75 GiB reserved, 15 GiB of them in tensors): those 60 GiB are free for training, so a step whose
    cache grew reads the same as one whose did not; a tensor kept alive (a leak) still shows."""
    state = {"free": 14 * GiB, "reserved": 75 * GiB, "allocated": 15 * GiB}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (state["free"], 140 * GiB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: state["reserved"])
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: state["allocated"])
    device = torch.device("cuda", 0)
    assert free_after_sleep_bytes(device, engine_awake=False) == 14 * GiB
    assert free_after_sleep_bytes(device, engine_awake=True) == 74 * GiB
    state.update(free=10 * GiB, reserved=79 * GiB)  # the cache grew by 4 GiB of unused blocks
    assert free_after_sleep_bytes(device, engine_awake=True) == 74 * GiB
    state.update(allocated=17 * GiB)  # 2 GiB of tensors left alive
    assert free_after_sleep_bytes(device, engine_awake=True) == 72 * GiB
