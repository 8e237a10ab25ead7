"""Start-up that talks: seconds per start-up phase, logged and kept for the first step's metrics.

A 7B start-up takes minutes (model build and load, FSDP wrap, the vLLM engine with its CUDA
graphs), and a minute of silence looks like a hang. The clock logs a line when a phase begins and
one with its seconds when it ends, a "still in" line every `heartbeat_s` while a phase runs long
(so no silent gap is longer than that), and hands `time/startup_<phase>` scalars (plus
`time/startup_total`, from the process start) to the first logged step.

    clock = startup_clock()            # one per process
    with clock("data"):
        setup_data()
    clock.begin("model_build"); ...; clock.begin("reference_critic"); ...   # begin() ends the open phase
    clock.finish()                     # ends the open phase, stops the heartbeat thread
    metrics.update(clock.take_metrics())
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time

log = logging.getLogger("spmd_rl")

HEARTBEAT_S = 30.0
"""Longest silence while a phase runs: a "still in <phase>" line comes at least this often."""


def process_start_time() -> float:
    """Wall-clock time this process started (Linux /proc; now elsewhere)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


class StartupClock:
    def __init__(self, heartbeat_s: float = HEARTBEAT_S, start: float | None = None):
        self.heartbeat_s = heartbeat_s
        self.start = process_start_time() if start is None else start
        self.seconds: dict[str, float] = {}
        self._phase: str | None = None
        self._phase_t0 = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._taken = False

    # ------------------------------------------------------------------ phases
    def begin(self, name: str) -> None:
        """End the open phase (if any) and start `name`."""
        self.end()
        with self._lock:
            self._phase, self._phase_t0 = name, time.perf_counter()
        log.info("start-up: %s ...", name)
        if self._thread is None and self.heartbeat_s > 0:
            self._thread = threading.Thread(target=self._heartbeat, name="spmd_rl-startup-heartbeat", daemon=True)
            self._thread.start()

    def end(self) -> None:
        """End the open phase, logging its seconds."""
        with self._lock:
            name, self._phase = self._phase, None
            if name is None:
                return
            dt = time.perf_counter() - self._phase_t0
            self.seconds[name] = self.seconds.get(name, 0.0) + dt
        log.info("start-up: %s took %.1fs", name, dt)

    @contextlib.contextmanager
    def __call__(self, name: str):
        self.begin(name)
        try:
            yield
        finally:
            self.end()

    def finish(self) -> None:
        """Start-up is over: end the open phase, log the total and stop the heartbeat."""
        self.end()
        if "total" not in self.seconds:
            self.seconds["total"] = time.time() - self.start
            parts = ", ".join(f"{k} {v:.1f}s" for k, v in self.seconds.items() if k != "total")
            log.info("start-up: %.1fs since the process started (%s)", self.seconds["total"], parts)
        self.close()

    def close(self) -> None:
        """Stop and join the heartbeat thread (also on the error path; idempotent)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._thread = None

    def take_metrics(self) -> dict[str, float]:
        """`time/startup_<phase>` scalars, once (for the first step logged by this process)."""
        if self._taken or not self.seconds:
            return {}
        self._taken = True
        return {f"time/startup_{k}": v for k, v in self.seconds.items()}

    # ------------------------------------------------------------------ heartbeat
    def _heartbeat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            with self._lock:
                name, t0 = self._phase, self._phase_t0
            if name is not None:
                log.info("start-up: still in %s after %.0fs", name, time.perf_counter() - t0)


_CLOCK: StartupClock | None = None


def startup_clock() -> StartupClock:
    """This process's clock (created on first use; its total counts from the process start)."""
    global _CLOCK
    if _CLOCK is None:
        _CLOCK = StartupClock()
    return _CLOCK
