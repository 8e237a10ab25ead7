"""Run a test body in N gloo processes (CPU), the way torchrun would, ending each the way a rank
of `spmd_rl.ppo` ends (spmd_rl.runtime.lifecycle's ordered teardown: the process group destroyed and its
gloo threads joined while the interpreter is fully alive; a plain destroy_process_group() left them
to interpreter shutdown, where a late one aborted the process now and then with SIGABRT)."""

import os
import traceback

import torch.multiprocessing as mp

from spmd_rl.runtime.distributed import free_port


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
        fn = args = None  # the body's objects (models, meshes) let go of the group before it is destroyed
        from spmd_rl.runtime.lifecycle import destroy_process_group, stop_library_threads

        destroy_process_group()
        stop_library_threads()


def run_distributed(fn, world: int, *args) -> None:
    """fn(rank, world, *args) in `world` processes; re-raises the first failure."""
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    mp.start_processes(_entry, args=(world, free_port(), fn, args, errors), nprocs=world, join=True,
                       start_method="spawn")
    if not errors.empty():
        raise AssertionError(errors.get())
