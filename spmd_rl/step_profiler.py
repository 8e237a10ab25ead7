"""Training steps under torch.profiler (`trainer.profile_steps`, as verl's profile_steps).

The trainer names each phase of a step `phase/<name>` with `phase_range` (PhaseTimer), so the
trace shows the phases and the summary gives each phase's wall time beside the device time of the
kernels launched inside it: a phase whose kernels keep the GPU busy for much less than its wall
time is waiting on the host. For each profiled step N every rank R writes

    <run_dir>/profile/step_<N>_rank<R>.json.gz   the trace (ui.perfetto.dev, chrome://tracing)
    <run_dir>/profile/step_<N>_rank<R>.txt       per phase: wall ms, kernel ms, GPU busy %; then
                                                 the ops with the most self device time (CPU
                                                 time without CUDA)

Profiling a step costs it time (every op is recorded: seconds more for a step with a long
rollout), so its `time/*` metrics are not the run's; profile a step after the first (compiles).
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Iterator

import torch

log = logging.getLogger(__name__)

PHASE = "phase/"
TOP_OPS = 40


def phase_range(name: str):
    """The profiler range of a step's phase (costs about a microsecond when nothing profiles)."""
    return torch.profiler.record_function(PHASE + name)


@contextlib.contextmanager
def profiled_step(step: int, out_dir: str, rank: int, device: torch.device) -> Iterator[None]:
    """Run the block (training step `step`) under torch.profiler, then write its files."""
    cuda = device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities) as prof:
        yield
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, f"step_{step}_rank{rank}")
    prof.export_chrome_trace(stem + ".json.gz")
    with open(stem + ".txt", "w") as f:
        f.write(summary(prof.events(), cuda))
    log.info("profile of step %d: %s.txt (per phase and op) and %s.json.gz (the trace)", step, stem, stem)


def phase_times(events) -> dict[str, tuple[float, float]]:
    """Phase name -> (wall ms, device ms of the kernels launched inside it), summed over the
    phase's ranges in the step."""
    out: dict[str, tuple[float, float]] = {}
    for e in events:
        if e.name.startswith(PHASE):
            name = e.name[len(PHASE):]
            wall, kernels = out.get(name, (0.0, 0.0))
            out[name] = (wall + e.cpu_time_total / 1e3, kernels + e.device_time_total / 1e3)
    return out


def summary(events, cuda: bool) -> str:
    """The text file of a profiled step: the phase table, then the top ops."""
    lines = ["| phase | wall ms | kernel ms | GPU busy |", "|---|---|---|---|"]
    for name, (wall, kernels) in phase_times(events).items():
        busy = f"{100 * kernels / wall:.0f}%" if cuda and wall > 0 else "-"
        lines.append(f"| {name} | {wall:.1f} | {kernels:.1f} | {busy} |")
    sort_by = "self_device_time_total" if cuda else "self_cpu_time_total"
    lines += ["", events.key_averages().table(sort_by=sort_by, row_limit=TOP_OPS)]
    return "\n".join(lines) + "\n"
