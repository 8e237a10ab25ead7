"""GPU memory reporting and the expandable-segments switch used around the colocated engine.

PyTorch's `expandable_segments` allocator (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) helps
training with variable sequence lengths, but memory that a sleep-mode vLLM engine allocates
through it is not handed back by `sleep()` (vLLM's pool maps its own pages). The engine therefore switches expandable segments off from
`wake_up` to `sleep` and back on afterwards, when the user asked for them (verl does the same).

While the engine is built they must stay off, and vLLM would switch them back on: its sleep-mode
allocator (`CuMemAllocator.use_memory_pool`) turns them off around the weights and the KV cache
and back on afterwards whenever PYTORCH_CUDA_ALLOC_CONF names them, so the CUDA graphs captured
next get their buffers from expandable (CUDA VMM) segments. With tensor parallelism, vLLM's custom
all-reduce then registers those graph buffers for the other ranks through cudaIpcGetMemHandle,
which legacy CUDA IPC refuses for VMM memory: `custom_all_reduce.cuh:455 'invalid argument'` at
engine start (vLLM issues #42609, #43923). `engine_build_allocator` hides the setting from vLLM
for the build. Nothing here needs a GPU to import.

Out of memory: `is_out_of_memory` tells PyTorch's and vLLM's out-of-memory errors from others, and
`allocator_lines_held` keeps the line vLLM's allocator prints itself out of a rank's output, where
the trainer says it in its own one line.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
import threading
import time

import torch

GiB = 2**30
ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # the second: torch's newer alias


def expandable_segments_requested() -> bool:
    """Whether the process was started with expandable segments on (PYTORCH_CUDA_ALLOC_CONF, or the
    newer PYTORCH_ALLOC_CONF alias)."""
    for var in ALLOC_CONF_VARS:
        conf = os.environ.get(var, "").replace(" ", "")
        if "expandable_segments:True" in conf:
            return True
    return False


def without_expandable_segments(conf: str) -> str:
    """An allocator setting string with its expandable_segments entry taken out (the others kept)."""
    entries = [e for e in conf.split(",") if e.strip() and e.split(":")[0].strip() != "expandable_segments"]
    return ",".join(entries)


@contextlib.contextmanager
def engine_build_allocator():
    """Expandable segments off, and hidden from the allocator settings in the environment, while a
    vLLM engine is built (weights, KV cache and CUDA-graph capture): see the module docstring.
    The environment is restored afterwards; the allocator stays off until the caller switches it
    back (the engine does so when it first sleeps)."""
    saved = {v: os.environ[v] for v in ALLOC_CONF_VARS if v in os.environ}
    for var, conf in saved.items():
        hidden = without_expandable_segments(conf)
        if hidden:
            os.environ[var] = hidden
        else:
            del os.environ[var]
    set_expandable_segments(False)
    try:
        yield
    finally:
        for var in ALLOC_CONF_VARS:
            os.environ.pop(var, None)
        os.environ.update(saved)


def set_expandable_segments(enabled: bool) -> None:
    """Switch the CUDA caching allocator's expandable segments on or off for new segments.
    Existing segments stay as they are; call torch.cuda.empty_cache() to release cached ones."""
    if torch.cuda.is_available():
        torch.cuda.memory._set_allocator_settings(f"expandable_segments:{'True' if enabled else 'False'}")


def is_out_of_memory(e: BaseException) -> bool:
    """PyTorch's out-of-memory error, or vLLM's: its sleep-mode allocator raises a RuntimeError,
    `CUDA Error: out of memory at .../cumem_allocator.cpp:163`, when wake_up cannot map its pool (vLLM's
    own tests/basic_correctness/test_cumem.py expects a RuntimeError there), not a
    torch.OutOfMemoryError; a CUDA call's own RuntimeError says `CUDA error: out of memory`."""
    return isinstance(e, torch.OutOfMemoryError) or (isinstance(e, RuntimeError) and "out of memory" in str(e))


VLLM_ALLOCATOR_LINE = re.compile(rb"^CUDA Error: .* at \S*cumem_allocator\.cpp:\d+\s*$")
"""A line vLLM's sleep-mode allocator (csrc/cumem_allocator.cpp, CUDA_CHECK) prints on std::cerr
before it raises the same text as a RuntimeError."""


@contextlib.contextmanager
def allocator_lines_held(fd: int = 2):
    """Hold what this process writes to `fd` (stderr: Python's and native code's alike) while the
    block runs, and write it back when the block ends: all of it, but where the block ends in an
    out-of-memory error (`is_out_of_memory`), the lines vLLM's sleep-mode allocator printed about it
    itself. Its C++ code prints `CUDA Error: out of memory at .../cumem_allocator.cpp:163` on std::cerr
    and then raises the same text, which the trainer turns into its one line (trainer.PhaseTimer);
    without this, every rank that ran out of memory waking the engine printed the raw line as well.
    Anything else written meanwhile (other threads' too) comes out when the block ends, in order;
    around an error that is not an out-of-memory one, all of it, the allocator's lines included. Held
    in a file, not a pipe (a native writer holding the GIL could fill a pipe whose reader needs it):
    a process killed inside the block (a segfault) loses what was written there. For blocks of a few
    seconds that touch vLLM's allocator alone: waking the engine."""
    try:
        sys.stderr.flush()
        saved = os.dup(fd)
    except (OSError, ValueError):  # no stderr to hold
        yield
        return
    held = tempfile.TemporaryFile()
    os.dup2(held.fileno(), fd)
    drop = False
    try:
        yield
    except BaseException as e:
        drop = is_out_of_memory(e)
        raise
    finally:
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.flush()
        os.dup2(saved, fd)
        os.close(saved)
        held.seek(0)
        text = held.read()
        held.close()
        if drop:
            text = b"".join(line for line in text.splitlines(keepends=True) if not VLLM_ALLOCATOR_LINE.match(line))
        while text:
            text = text[os.write(fd, text):]


def device_memory(device: torch.device | int | None = None) -> dict[str, float]:
    """Device-level and PyTorch-level memory in GiB: free/used/total from the driver (this includes
    vLLM's own pool and other processes), allocated/reserved/peak from PyTorch's allocator."""
    if not torch.cuda.is_available():
        return {}
    free, total = torch.cuda.mem_get_info(device)
    return {
        "free": free / GiB,
        "used": (total - free) / GiB,
        "total": total / GiB,
        "torch_allocated": torch.cuda.memory_allocated(device) / GiB,
        "torch_reserved": torch.cuda.memory_reserved(device) / GiB,
        "torch_peak_allocated": torch.cuda.max_memory_allocated(device) / GiB,
    }


def free_after_sleep_bytes(device: torch.device, engine_awake: bool) -> int:
    """Free device memory once the engine's turn is over (`memory/free_after_sleep_gb`): the driver's free
    bytes, and with the engine awake (rollout.stay_awake) also what PyTorch's cache holds unused, since
    nothing empties it then and those blocks are training's to reuse. Either way the figure stays flat
    from step to step unless something leaks."""
    free = torch.cuda.mem_get_info(device)[0]
    if engine_awake:
        free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return free


def engine_pool_bytes() -> int:
    """Bytes allocated in vLLM's sleep-mode pool (0 when vLLM is not loaded). PyTorch's allocator
    counts these as allocated even while the engine sleeps and they hold no device memory, so
    they are taken out of the training figures below."""
    if "vllm" not in sys.modules:
        return 0
    try:
        from vllm.device_allocator.cumem import CuMemAllocator
    except ImportError:
        return 0
    return int(CuMemAllocator.get_instance().get_current_usage())


class PhaseMemory:
    """Memory of one phase of a step, started at construction, read by `end(name)`:

    - `memory/<name>_peak_gb`: the peak of what PyTorch tensors held during the phase, vLLM's pool
      left out (training tensors; while the engine is awake, plus its buffers outside the pool);
    - `memory/<name>_device_gb`: what the device really held at the phase's end (driver view: every
      process, vLLM's mapped pool included, PyTorch's cached blocks included).

    Neither can exceed the card: a figure above `memory/device_total_gb` is a bug."""

    def __init__(self, device: torch.device):
        self.device = device
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)

    def end(self, name: str) -> dict[str, float]:
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - engine_pool_bytes()
        return {f"memory/{name}_peak_gb": peak / GiB, f"memory/{name}_device_gb": (total - free) / GiB,
                "memory/device_total_gb": total / GiB}


class PeakPoller:
    """Samples the device's used memory (driver view) in a background thread, so a phase's peak
    includes allocations PyTorch's counters do not see (vLLM's sleep-mode pool, NCCL buffers).

        poller = PeakPoller(interval_s=0.01); poller.start()
        poller.phase("sync"); ...; peaks = poller.stop()   # {"sync": GiB, ...}
    """

    def __init__(self, device: int | None = None, interval_s: float = 0.01):
        self.device = torch.cuda.current_device() if device is None else device
        self.interval_s = interval_s
        self.peaks: dict[str, float] = {}
        self._phase = "start"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def phase(self, name: str) -> None:
        self._sample()
        self._phase = name
        self._sample()

    def _sample(self) -> None:
        free, total = torch.cuda.mem_get_info(self.device)
        used = (total - free) / GiB
        if used > self.peaks.get(self._phase, -1.0):
            self.peaks[self._phase] = used

    def _run(self) -> None:
        torch.cuda.set_device(self.device)
        while not self._stop.is_set():
            self._sample()
            time.sleep(self.interval_s)

    def start(self) -> "PeakPoller":
        self._thread = threading.Thread(target=self._run, daemon=True, name="gpu-mem-poller")
        self._thread.start()
        return self

    def stop(self) -> dict[str, float]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._sample()
        return dict(self.peaks)
