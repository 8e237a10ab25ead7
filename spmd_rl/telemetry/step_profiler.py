"""Training steps under torch.profiler (`trainer.profile_steps`, as verl's profile_steps).

The trainer names each phase of a step `phase/<name>` with `phase_range` (PhaseTimer), so the
trace shows the phases and the summary gives each phase's wall time beside the time the GPU was
busy during it (`phase_times`): a phase whose GPU is busy for much less than its wall time is
waiting on the host. The profiler slows the host (every op is recorded), so compare a phase's GPU
busy ms with its `time/<phase>` in an unprofiled step, not only with its profiled wall time. For
each profiled step N every rank R writes

    <run_dir>/profile/step_<N>_rank<R>.json.gz   the trace (ui.perfetto.dev, chrome://tracing)
    <run_dir>/profile/step_<N>_rank<R>.txt       per phase: wall ms, GPU busy ms and %, ms of
                                                 garbage collection; for a phase whose GPU
                                                 idles, the host ops it idled in
                                                 (`idle_host_ops`) and when in the phase
                                                 (`idle_where`); for a phase whose GPU
                                                 works, its kernels by device time
                                                 (`phase_kernels`); then the step's ops with
                                                 the most self device time (CPU time without
                                                 CUDA)

Every collection of Python's cyclic garbage collector inside a profiled step, on a thread the
profiler records (the main thread, autograd's backward threads), is a host range
`gc/generation<G>` in the trace (`gc_ranges`): the GIL is held while it runs, so it stops every
thread that launches GPU work, and an idle GPU behind it shows up as that op in the idle table.

Profiling a step costs it time (every op is recorded: seconds more for a step with a long
rollout), so its `time/*` metrics are not the run's; profile a step after the first (compiles).
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import logging
import os
import threading
from typing import Iterator

import torch
from torch.autograd import DeviceType

log = logging.getLogger(__name__)

PHASE = "phase/"
GC = "gc/generation"
TOP_OPS = 40


def phase_range(name: str):
    """The profiler range of a step's phase (costs about a microsecond when nothing profiles)."""
    return torch.profiler.record_function(PHASE + name)


@contextlib.contextmanager
def profiled_step(step: int, out_dir: str, rank: int, device: torch.device) -> Iterator[None]:
    """Run the block (training step `step`) under torch.profiler, then write its files."""
    cuda = device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities) as prof, gc_ranges():
        yield
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, f"step_{step}_rank{rank}")
    prof.export_chrome_trace(stem + ".json.gz")
    with open(stem + ".txt", "w") as f:
        f.write(summary(prof.events(), cuda))
    log.info("profile of step %d: %s.txt (per phase and op) and %s.json.gz (the trace)", step, stem, stem)


@contextlib.contextmanager
def gc_ranges() -> Iterator[None]:
    """Each garbage collection during the block as a profiler range `gc/generation<G>` (gc.callbacks:
    "start" and "stop" come in pairs on one thread; the profiler keeps the ranges of the threads it
    records, not those of threads started without its state, such as a plain threading.Thread)."""
    open_ranges = threading.local()

    def callback(phase: str, info: dict) -> None:
        if phase == "start":
            open_ranges.current = torch.profiler.record_function(f"{GC}{info['generation']}")
            open_ranges.current.__enter__()
        elif getattr(open_ranges, "current", None) is not None:
            open_ranges.current.__exit__(None, None, None)
            open_ranges.current = None

    gc.callbacks.append(callback)
    try:
        yield
    finally:
        gc.callbacks.remove(callback)


def phase_times(events) -> dict[str, tuple[float, float]]:
    """Phase name -> (wall ms, GPU busy ms), summed over the phase's ranges in the step.

    Wall: the phase's host-side ranges. GPU busy: the union of the device's activity (kernels,
    copies, memsets, from every thread: autograd's backward runs on a thread of its own) that falls
    inside those ranges, so overlapping streams count once. Not the device time of the ops
    launched inside the range: that misses the backward thread's kernels, and the device-side copy
    of each range (a user annotation with the same name, spanning its first to last kernel) is
    no kernel at all. Work launched near a phase's end that runs after it counts in what follows."""
    return _phase_times(_timeline(events))


def _phase_times(timeline) -> dict[str, tuple[float, float]]:
    ranges, busy, _, _ = timeline
    return {name: (sum(b - a for a, b in spans) / 1e3, sum(_overlap(busy, a, b) for a, b in spans) / 1e3)
            for name, spans in ranges.items()}


def idle_host_ops(events, phase: str, sample_us: float = 200.0) -> dict[str, float]:
    """What the host was doing while the GPU sat idle in `phase`: host op name -> idle ms, from
    samples every `sample_us` of the phase's idle time, each given the innermost host op running
    at that instant on any thread (the op that started last among those covering it), or
    "(host code between ops)" when none was (Python of ours or a library's, outside any op)."""
    return _idle_in(_timeline(events), phase, sample_us)


def _idle_in(timeline, phase: str, sample_us: float = 200.0) -> dict[str, float]:
    ranges, busy, host, _ = timeline
    samples = sorted(p for a, b in ranges.get(phase, []) for lo, hi in _gaps(busy, a, b)
                     for p in _points(lo, hi, sample_us))
    times = [t for t, _ in samples]
    innermost: list[tuple[float, str] | None] = [None] * len(samples)
    for start, end, name in host:
        for i in range(bisect.bisect_left(times, start), bisect.bisect_right(times, end)):
            if innermost[i] is None or start >= innermost[i][0]:
                innermost[i] = (start, name)
    out: dict[str, float] = {}
    for (_, weight), hit in zip(samples, innermost):
        name = hit[1] if hit else "(host code between ops)"
        out[name] = out.get(name, 0.0) + weight / 1e3
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def _timeline(events):
    """(phase name -> its host ranges, the device's busy intervals (disjoint, sorted), the host
    ops other than phases as (start, end, name), the device's work (kernels, copies, memsets; not
    the phases' device-side annotations) as (start, end, name)); times in us."""
    ranges: dict[str, list[tuple[float, float]]] = {}
    device: list[tuple[float, float, str]] = []
    host: list[tuple[float, float, str]] = []
    for e in events:
        span = (e.time_range.start, e.time_range.end)
        if e.device_type != DeviceType.CPU:
            if not getattr(e, "is_user_annotation", False):
                device.append((*span, e.name))
        elif e.name.startswith(PHASE):
            ranges.setdefault(e.name[len(PHASE):], []).append(span)
        else:
            host.append((*span, e.name))
    return ranges, _union([(a, b) for a, b, _ in device]), host, device


def _gaps(disjoint: list[tuple[float, float]], a: float, b: float) -> list[tuple[float, float]]:
    """The parts of [a, b] that the sorted disjoint intervals leave uncovered."""
    out, t = [], a
    i = max(bisect.bisect_left(disjoint, (a, a)) - 1, 0)
    for lo, hi in disjoint[i:]:
        if lo >= b:
            break
        if lo > t:
            out.append((t, lo))
        t = max(t, hi)
    if t < b:
        out.append((t, b))
    return out


def _points(lo: float, hi: float, step: float) -> list[tuple[float, float]]:
    """Samples of the gap [lo, hi): (instant, the us it stands for), the middle of each of its n
    equal slices about `step` long (one slice for a shorter gap), so they add up to the gap."""
    n = max(int((hi - lo) // step), 1) if hi > lo else 0
    return [(lo + (k + 0.5) * (hi - lo) / n, (hi - lo) / n) for k in range(n)]


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, disjoint intervals covering the same time as `intervals`."""
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _overlap(disjoint: list[tuple[float, float]], a: float, b: float) -> float:
    """Time of the sorted disjoint intervals inside [a, b]: what their gaps there leave."""
    return (b - a) - sum(hi - lo for lo, hi in _gaps(disjoint, a, b))


def idle_where(events, phase: str, parts: int = 10, top: int = 5) -> tuple[list[float], list[tuple[float, float]]]:
    """When in `phase` the GPU idled: the idle ms in each of `parts` equal slices of the phase's time
    (its ranges end to end), and its `top` longest idle gaps as (ms from the phase's start, ms), longest
    first. Idle time spread evenly over the phase is the host falling behind at every step of a loop;
    idle time in the first or last slice is work before or after the loop (setting up, collecting)."""
    return _idle_where(_timeline(events), phase, parts, top)


def _idle_where(timeline, phase: str, parts: int = 10, top: int = 5):
    ranges, busy, _, _ = timeline
    spans = sorted(ranges.get(phase, []))
    total = sum(b - a for a, b in spans)
    slices, gaps, offset = [0.0] * parts, [], 0.0
    for a, b in spans:
        for lo, hi in _gaps(busy, a, b):
            start, end = offset + lo - a, offset + hi - a
            gaps.append((start, end - start))
            for k in range(parts):
                slices[k] += max(0.0, min(end, total * (k + 1) / parts) - max(start, total * k / parts))
        offset += b - a
    gaps.sort(key=lambda gap: -gap[1])
    return [ms / 1e3 for ms in slices], [(start / 1e3, length / 1e3) for start, length in gaps[:top]]


def idle_table(timeline, times: dict[str, tuple[float, float]], top: int = 12) -> list[str]:
    """For each phase whose GPU idles 50 ms or more: the host ops the idle time fell in, then when in
    the phase it idled (idle_where)."""
    lines = []
    for name, (wall, busy) in times.items():
        if wall - busy < 50.0:
            continue
        lines += ["", f"GPU idle in {name}: {wall - busy:.0f} ms; the host meanwhile (sampled):", "",
                  "| host op | idle ms | % |", "|---|---|---|"]
        ops = _idle_in(timeline, name)
        total = sum(ops.values()) or 1.0
        lines += [f"| {op[:100]} | {ms:.1f} | {100 * ms / total:.0f}% |" for op, ms in list(ops.items())[:top]]
        slices, gaps = _idle_where(timeline, name)
        lines += ["", f"Idle ms in each tenth of {name}: " + ", ".join(f"{ms:.0f}" for ms in slices),
                  "Its longest idle gaps (ms into the phase: ms): " + ", ".join(f"{at:.0f}: {ms:.1f}" for at, ms in gaps)]
    return lines


def phase_kernels(events) -> dict[str, dict[str, tuple[int, float]]]:
    """Phase name -> device op name (kernel, copy, memset) -> (calls, ms of device time), over the
    device activity that starts inside the phase's ranges, largest first. Overlapping kernels each
    count their own time here (unlike GPU busy), so a phase's rows add up to its kernel time."""
    return _phase_kernels(_timeline(events))


def _phase_kernels(timeline) -> dict[str, dict[str, tuple[int, float]]]:
    ranges, _, _, device = timeline
    spans = sorted((a, b, name) for name, pairs in ranges.items() for a, b in pairs)  # phases follow one another
    starts = [a for a, _, _ in spans]
    out: dict[str, dict[str, list]] = {}
    for t, end, kernel in device:
        i = bisect.bisect_right(starts, t) - 1
        if i >= 0 and t <= spans[i][1]:
            row = out.setdefault(spans[i][2], {}).setdefault(kernel, [0, 0.0])
            row[0] += 1
            row[1] += (end - t) / 1e3
    return {phase: {name: (n, ms) for name, (n, ms) in sorted(rows.items(), key=lambda kv: -kv[1][1])}
            for phase, rows in out.items()}


def kernel_table(timeline, times: dict[str, tuple[float, float]], top: int = 15) -> list[str]:
    """For each phase whose GPU is busy 50 ms or more: its kernels by device time (phase_kernels)."""
    by_phase, lines = _phase_kernels(timeline), []
    for name, (_, busy) in times.items():
        if busy < 50.0:
            continue
        kernels = by_phase.get(name, {})
        total = sum(ms for _, ms in kernels.values()) or 1.0
        lines += ["", f"Kernels in {name}: {total:.0f} ms of device time, {sum(n for n, _ in kernels.values())} "
                  "launches; the largest:", "", "| kernel | calls | ms | % |", "|---|---|---|---|"]
        lines += [f"| {k[:100]} | {n} | {ms:.1f} | {100 * ms / total:.0f}% |" for k, (n, ms) in list(kernels.items())[:top]]
    return lines


def gc_ms(timeline) -> dict[str, float]:
    """Phase name -> ms of garbage collection (the `gc_ranges` ranges) inside its ranges."""
    ranges, _, host, _ = timeline
    collections = _union([(a, b) for a, b, name in host if name.startswith(GC)])
    return {name: sum(_overlap(collections, a, b) for a, b in spans) / 1e3 for name, spans in ranges.items()}


def summary(events, cuda: bool) -> str:
    """The text file of a profiled step: the phase table, the idle tables (CUDA), the top ops."""
    timeline = _timeline(events)  # one pass over the step's events, used by every table
    times, collected = _phase_times(timeline), gc_ms(timeline)
    lines = ["| phase | wall ms | GPU busy ms | GPU busy | GC ms |", "|---|---|---|---|---|"]
    for name, (wall, busy_ms) in times.items():
        busy = f"{100 * busy_ms / wall:.0f}%" if cuda and wall > 0 else "-"
        lines.append(f"| {name} | {wall:.1f} | {busy_ms:.1f} | {busy} | {collected[name]:.1f} |")
    if cuda:
        lines += idle_table(timeline, times) + kernel_table(timeline, times)
    sort_by = "self_device_time_total" if cuda else "self_cpu_time_total"
    lines += ["", events.key_averages().table(sort_by=sort_by, row_limit=TOP_OPS)]
    return "\n".join(lines) + "\n"
