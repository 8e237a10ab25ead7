"""Staging for asynchronous checkpoints: the copy of the state into host memory that a save waits
for, into buffers allocated once per run and reused by every later save.

torch's `DefaultStager` cannot be reused on every torch the project supports: on torch 2.11 its
`_stage` closes its inner `StateDictStager` after each save (a fix for a reference cycle of
one-shot stagers), which empties the stager's deep-copy dispatch table and its buffer cache. The
second save through the same stager then fails inside the deep copy (`KeyError: <class 'type'>`),
and even on a torch without that failure every save would allocate (and pin) new host buffers.
torch 2.13 no longer closes it. `HostStager` drives the same `StateDictStager` itself and closes
it only when the run ends, so the same code works on both.
"""

from __future__ import annotations

from typing import Any

import torch

try:  # present in torch 2.11-2.13 (private module): the deep copy that knows DTensors and storages
    from torch.distributed.checkpoint._state_dict_stager import StateDictStager
    from torch.distributed.checkpoint.staging import AsyncStager
except ImportError:  # pragma: no cover - a torch without it: dcp.async_save's default staging
    StateDictStager = AsyncStager = None


class HostStager(AsyncStager if AsyncStager is not None else object):
    """dcp.async_save's `async_stager`: copies the state dict to host memory and returns once the
    copy is complete (the step waits for it, never for the write). Buffers (pinned when CUDA is
    there) are keyed by the source tensors' storages, so the same parameters and optimizer moments
    are copied into the same buffers at every save. The caller must not stage again while a save
    of the previous staging is still being written (the checkpointer waits for it first)."""

    _synchronize_after_execute = False  # stage() returns a finished copy

    def __init__(self, pin_memory: bool):
        self.pin_memory = pin_memory
        self._stager = StateDictStager(pin_memory=pin_memory, share_memory=False)

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        if self._stager is None:
            raise RuntimeError("HostStager is closed")
        staged = self._stager.stage(state_dict, non_blocking=self.pin_memory)
        if self.pin_memory:  # non-blocking device->host copies: done before training touches the state
            torch.cuda.synchronize()
        return staged

    def synchronize_staging(self) -> None:  # stage() is synchronous: nothing to wait for
        pass

    def close(self) -> None:
        """Free the host buffers (pinned ones are unpinned as they are collected). Idempotent."""
        if self._stager is not None:
            self._stager.close()
            self._stager = None


def make_stager() -> HostStager | None:
    """The run's stager, or None (torch's default staging: a fresh host copy per save) where this
    torch lacks StateDictStager."""
    if StateDictStager is None:  # pragma: no cover
        return None
    return HostStager(pin_memory=torch.cuda.is_available())
