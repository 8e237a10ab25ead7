"""Checkpoints and disk space: what a full disk does to DCP, the bytes a save writes, the start-up
line, the save that does not fit, and the write that fails anyway (on a real full filesystem where
the machine lets us mount one, and by ENOSPC injected at the write everywhere)."""

from __future__ import annotations

import errno
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from spmd_rl.checkpoint import WRITE_THREADS, ModelAndOptimizer
from spmd_rl.checkpoint_writes import os_error

MB = 2**20


def make_model(width: int = 512, seed: int = 0, step: bool = True):
    """4 x width x width fp32 weights (+ biases) and AdamW; `step`: its state exists."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if step:
        model(torch.randn(2, width)).sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


@pytest.mark.parametrize("async_save", [False, True])
def test_a_full_disk_makes_dcp_fail_with_the_zip_writers_unexpected_pos(small_filesystem, async_save):
    """Issue 27's `RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598`
    (a 1.5B save, 34 GB free) is a full disk: DCP's save of 12 MiB of model + AdamW state into a
    4 MiB filesystem, called as the checkpointer calls it (FileSystemWriter with its threads,
    synchronous and asynchronous), fails with torch's zip writer's error, and the OSError behind it
    is ENOSPC. (What the checkpointer makes of it: the tests below.)"""
    root = small_filesystem.mount(4 * MB)
    model, opt = make_model()
    state = {"actor": ModelAndOptimizer(model, opt).state_dict()}
    writer = dcp.FileSystemWriter(root, thread_count=max(2, WRITE_THREADS))
    with pytest.raises(dcp.CheckpointException) as e:
        if async_save:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                upload = dcp.async_save(state, checkpoint_id=root, storage_writer=writer)
            getattr(upload, "upload_completion", upload).result()
        else:
            dcp.save(state, checkpoint_id=root, storage_writer=writer)
    (error, _), = e.value.failures.values()
    assert type(error) is RuntimeError and "inline_container.cc" in str(error) and "unexpected pos" in str(error), error
    assert os_error(error) is not None and os_error(error).errno == errno.ENOSPC, repr(error.__context__)
