"""Moving training state (FSDP2 parameter shards, optimizer state) between the GPU and host memory.

`TrainStateOffload` serves `rollout.offload_train_states`: the state leaves the GPU while the
rollout engine generates and comes back before training. Each GPU storage behind the models'
parameters and buffers and the optimizers' state is copied into a host buffer of its exact size,
allocated and pinned at the first offload and kept for the run, and is then resized to zero bytes;
the reload resizes it back and copies the bytes in. FSDP2 frees and restores its unsharded
parameters the same way (`untyped_storage().resize_`). The tensors themselves (FSDP2's sharded
DTensors and their views, AdamW's moments) are never replaced, so FSDP2, the optimizer and compiled
graphs keep their references, and every copy after the first runs at pinned-memory speed. Moving the
tensors instead (`module.to("cpu")`, `to("cpu", non_blocking=True)`) would copy parameters into
pageable memory and pin fresh blocks for the moments, one tensor at a time, at every offload
(docs/performance.md, "Two and four GPUs": the offload of PPO at 7B).

`move_optimizer_state` serves `actor.offload_optimizer`, whose moments live on the host between
updates as host tensors (what a checkpoint then saves), and come to the GPU for the optimizer step.
Gradients are already freed after each update (`update.ppo_update` zeroes them with set_to_none).
"""

from __future__ import annotations

import weakref

import torch


@torch.no_grad()
def move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.device != device and key != "step":
                state[key] = value.to(device, non_blocking=True)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # a DTensor's shard on this rank


def state_storages(models: list[torch.nn.Module], optimizers: list[torch.optim.Optimizer],
                   device: torch.device) -> dict[int, torch.UntypedStorage]:
    """The distinct non-empty storages on `device` behind the models' parameters and buffers and the
    optimizers' state tensors, keyed by the storage (views and tied weights share one)."""
    tensors = [t for m in models for t in (*m.parameters(), *m.buffers())]
    tensors += [v for opt in optimizers for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    storages = {}
    for t in tensors:
        st = _local(t).untyped_storage()
        if st.device == device and st.nbytes() > 0:
            storages.setdefault(st._cdata, st)
    return storages


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole storage (what copy_ takes)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def host_buffer(nbytes: int, pin: bool) -> torch.UntypedStorage:
    """Host memory of exactly `nbytes`, page-locked when `pin` (cudaHostRegister, as torch's checkpoint
    staging does: `pin_memory=True` would round each block up to a power of two), unpinned when
    collected."""
    buf = torch.UntypedStorage(nbytes)
    if pin and nbytes:
        cudart = torch.cuda.cudart()
        err = int(cudart.cudaHostRegister(buf.data_ptr(), nbytes, 0))
        if err != 0:
            raise RuntimeError(f"pinning {nbytes} bytes of host memory for the offloaded training state failed "
                               f"(cudaError {err}); the host may be out of lockable memory (ulimit -l)")
        weakref.finalize(buf, cudart.cudaHostUnregister, buf.data_ptr())
    return buf


class TrainStateOffload:
    """Offloads the training state of one device to host buffers kept for the run, and reloads it.
    `offload` and `reload` alternate; the host buffers of storages that are gone (a model or
    optimizer state replaced since) are let go at the next offload."""

    def __init__(self, device: torch.device):
        if device.type == "cuda" and device.index is None:  # storages name their GPU's index
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.pin = device.type == "cuda"
        self._host: dict[int, torch.UntypedStorage] = {}
        self._away: list[tuple[int, torch.UntypedStorage]] = []

    @property
    def host_bytes(self) -> int:
        """Host memory held for the offloaded state (kept between offloads)."""
        return sum(buf.nbytes() for buf in self._host.values())

    @torch.no_grad()
    def offload(self, models: list[torch.nn.Module], optimizers: list[torch.optim.Optimizer]) -> int:
        """Copy the state to the host and free its device memory; returns the bytes moved."""
        if self._away:
            raise RuntimeError("the training state is already offloaded: reload it first")
        storages = state_storages(models, optimizers, self.device)
        self._host = {k: b for k, b in self._host.items() if k in storages and b.nbytes() == storages[k].nbytes()}
        for key, st in storages.items():
            if key not in self._host:
                self._host[key] = host_buffer(st.nbytes(), self.pin)
            _bytes_of(self._host[key]).copy_(_bytes_of(st), non_blocking=self.pin)
        if self.pin:
            torch.cuda.synchronize(self.device)  # the copies have landed before the memory is freed
        for st in storages.values():
            st.resize_(0)
        self._away = list(storages.items())
        if self.pin:
            torch.cuda.empty_cache()  # the engine's KV cache gets the memory
        return sum(self._host[k].nbytes() for k in storages)

    @torch.no_grad()
    def reload(self) -> None:
        """Give each offloaded storage its device memory and bytes back."""
        for key, st in self._away:
            buf = self._host[key]
            st.resize_(buf.nbytes())
            _bytes_of(st).copy_(_bytes_of(buf), non_blocking=self.pin)
        if self.pin:
            torch.cuda.synchronize(self.device)
        self._away = []
