"""A rank's process lifecycle: it dies with its launcher, and it stops what it started, in order.

Why the order matters. Without it a finished run can abort now and then at exit with
"terminate called without an active exception" (SIGABRT). The cause: gloo's worker threads
(`pt_gloo_runloop`) release each collective's work object after the collective completed, and
with it the last C++ reference to tensors that have a Python object; dropping that reference
takes the GIL (torch's PyInterpreter decref). `destroy_process_group()` does not stop those
threads -- the ProcessGroupGloo lives on as long as anything (FSDP modules, device meshes, the
trainer) refers to it -- so when a worker thread is late (a loaded machine), it asks for the
GIL while the interpreter is already finalizing. CPython then ends the thread with
pthread_exit, whose unwinding meets the noexcept work destructor: std::terminate. See
pytorch/pytorch#190489 and tests/runtime/test_lifecycle.py, which forces that timing.

So a rank tears down in a fixed order, all of it while the interpreter is fully alive
(spmd_rl/ppo.py's `main` owns it, on every path: finished, preempted, crashed):

  1. the trainer's own workers: the rollout engine (vLLM: before the process group goes), the
     TensorBoard writer thread, the start-up heartbeat, checkpoint writers;
  2. the trainer itself: models, optimizers and meshes, the last holders of the process group;
  3. the process group: destroyed, then collected, so the gloo/NCCL threads are joined here;
     they finish their last GIL-taking decrefs while the main thread waits for them;
  4. library threads started on our behalf (tqdm's monitor from the model loaders' progress bars);
  5. a check that no thread of ours is left (a warning names any survivor).

Stop signals are ignored from the moment training returned (and after this teardown on every
path): the run is over, a second Ctrl-C must not cut the teardown short, and a SIGTERM that torchrun
sends to the remaining ranks once one rank has exited must not turn their exit status into a
signal death.

The exit statuses are listed in spmd_rl/exit_codes.py.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import os
import signal
import sys
import threading

log = logging.getLogger("spmd_rl")

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

# Native threads a rank starts through torch.distributed; their names (/proc/<pid>/task/*/comm).
PROCESS_GROUP_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop", "pt_nccl_watchdg", "pt_nccl_heartbt")


# ---------------------------------------------------------------------------- launcher death
def die_with_launcher() -> bool:
    """Under torchrun: have the kernel SIGKILL this rank the moment its launcher dies.

    torchrun starts each rank in a session of its own, so a launcher killed with SIGKILL (OOM
    killer, `kill -9`, a lost node agent) would leave the ranks training as orphans, writing
    into the run directory and holding their GPUs. Why SIGKILL and not a stop request: nobody is
    left to collect the exit status or restart the ranks; a checkpoint would need every rank in a
    collective while the peers die in the same instant (a hang, not seconds); and a rank blocked
    inside a collective never returns to Python to act on a signal. The run directory is
    crash-safe by construction (a checkpoint becomes `latest` only once complete; `*.tmp` leftovers
    are ignored and removed by the next save), so the restart resumes from the last complete
    checkpoint, as after any hard kill. Returns whether the watch is armed.

    Only under torchrun (TORCHELASTIC_RUN_ID set): a plain `python -m spmd_rl.ppo` started from a
    shell (nohup, `&`) must outlive that shell. torchrun spawns its workers from its main thread,
    so the parent-death signal (tied to the spawning thread) fires only when the agent exits.
    """
    if not sys.platform.startswith("linux") or "TORCHELASTIC_RUN_ID" not in os.environ:
        return False
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        log.warning("prctl(PR_SET_PDEATHSIG) failed (errno %d): this rank will not stop if torchrun dies",
                    ctypes.get_errno())
        return False
    if os.getppid() != parent:  # the launcher died before the watch was armed
        os.write(2, f"[spmd_rl pid {os.getpid()}] the launcher is gone; exiting\n".encode())
        os.kill(os.getpid(), signal.SIGKILL)
    return True


# ---------------------------------------------------------------------------- threads
def native_threads() -> list[str]:
    """Names of this process's OS threads other than the calling one (Linux; [] elsewhere)."""
    me = str(threading.get_native_id())
    names = []
    try:
        for tid in os.listdir("/proc/self/task"):
            if tid == me:
                continue
            try:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    names.append(f.read().strip())
            except OSError:  # the thread ended while we looked
                pass
    except OSError:
        return []
    return sorted(names)


def process_group_threads() -> list[str]:
    """The torch.distributed worker threads still running in this process."""
    return [n for n in native_threads() if n.startswith(PROCESS_GROUP_THREADS)]


def python_threads() -> list[str]:
    """Names of the live Python threads other than the main thread."""
    main = threading.main_thread()
    return sorted(t.name for t in threading.enumerate() if t is not main and t.is_alive())


def stop_library_threads() -> None:
    """Stop threads libraries started for us: tqdm's monitor (transformers' loading bars)."""
    tmonitor = sys.modules.get("tqdm._monitor")
    if tmonitor is None:
        return
    for t in threading.enumerate():  # one per tqdm subclass that showed a bar
        if isinstance(t, tmonitor.TMonitor) and t is not threading.current_thread():
            t.exit()  # sets its stop event and joins it


# ---------------------------------------------------------------------------- process group
def destroy_process_group() -> None:
    """Destroy torch.distributed's groups and wait until their threads are gone.

    `dist.destroy_process_group()` only unregisters the groups; the C++ ProcessGroup (and gloo's
    worker threads) is freed when the last Python reference goes, often during interpreter
    teardown. Callers drop their references first (models, meshes); the collection here then
    runs the destructors now, on this thread, with the interpreter alive."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _release_meshes()
    gc.collect()
    left = process_group_threads()
    if left:  # someone still holds a group: name the threads, so the leak is found, not hidden
        log.warning("process-group threads still running after teardown: %s (a reference to a "
                    "ProcessGroup or DeviceMesh outlives the run)", ", ".join(left))


def _release_meshes() -> None:
    """Make device meshes that outlive the run let go of their process groups.

    DTensor keeps process-lifetime caches keyed by sharding specs (sharding propagation, the
    redistribute planner, mesh topology), and through them the run's DeviceMesh, whose registry
    holds the ProcessGroup objects: the groups' threads would then run into interpreter teardown."""
    mesh_module = sys.modules.get("torch.distributed.device_mesh")
    if mesh_module is None:
        return
    with contextlib.suppress(Exception):  # a private, debugging-only API: its absence is no error
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache

        _clear_sharding_prop_cache()
    # the type, not isinstance: isinstance asks a weakref.proxy for its __class__, and a dead one
    # (torch.compile leaves some among gc's objects) raises ReferenceError
    meshes = [obj for obj in gc.get_objects() if issubclass(type(obj), mesh_module.DeviceMesh)]
    for obj in meshes:
        if isinstance(getattr(obj, "_pg_registry", None), dict):
            obj._pg_registry.clear()  # the names stay; the groups are destroyed anyway


def ignore_stop_signals() -> None:
    """After teardown: a stop request has nothing left to stop. Ignoring it (SIG_IGN survives
    interpreter finalization, a Python handler does not) keeps the exit status ours."""
    from spmd_rl.runtime.preemption import STOP_SIGNALS

    if threading.current_thread() is threading.main_thread():
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
