"""Run a test body in N gloo processes (CPU), the way torchrun would."""

import os
import traceback

import torch.multiprocessing as mp

from spmd_rl.distributed import free_port


def _entry(rank, world, port, fn, args, errors):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        fn(rank, world, *args)
    except BaseException:
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
        raise
    finally:
        dist.destroy_process_group()


def run_distributed(fn, world: int, *args) -> None:
    """fn(rank, world, *args) in `world` processes; re-raises the first failure."""
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    mp.start_processes(_entry, args=(world, free_port(), fn, args, errors), nprocs=world, join=True,
                       start_method="spawn")
    if not errors.empty():
        raise AssertionError(errors.get())
