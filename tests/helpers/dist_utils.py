"""Run a test body in N gloo processes (CPU), the way torchrun would, ending each the way a rank
of `spmd_rl.ppo` ends (spmd_rl.runtime.lifecycle's ordered teardown: the process group destroyed and its
gloo threads joined while the interpreter is fully alive; a plain destroy_process_group() left them
to interpreter shutdown, where a late one aborted the process now and then with SIGABRT).

The processes start from a fork server (multiprocessing's "forkserver") that has imported torch and
transformers once for the whole session, so each test's processes skip the seconds of those imports
that a spawned process pays. The server is a clean process of its own, started without the test
process's threads, which is what makes a fork safe here (a fork of the test process would copy
whatever threads earlier tests left in it). Each process takes the test process's environment and
working directory of the moment of the call, as a spawned one would."""

import os
import traceback

import torch.multiprocessing as mp

from spmd_rl.runtime.distributed import free_port

PRELOADED = ["torch", "torch.distributed", "transformers"]
"""What the fork server imports once (the heavy imports every test body makes)."""


def _entry(rank, world, port, env, cwd, fn, args, errors):
    os.environ.clear()
    os.environ.update(env, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.chdir(cwd)
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
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOADED)  # read when the server starts (the first call), ignored after
    errors = ctx.SimpleQueue()
    mp.start_processes(_entry, args=(world, free_port(), dict(os.environ), os.getcwd(), fn, args, errors), nprocs=world,
                       join=True, start_method="forkserver")
    if not errors.empty():
        raise AssertionError(errors.get())


def full(t):
    """A tensor's whole value on this rank: a DTensor's gathered (collective), any other tensor itself (a
    parameter FSDP2 leaves out on one rank: spmd_rl.model.loading.frozen_kept_whole)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t
