"""trainer.profile_steps (spmd_rl/telemetry/step_profiler.py): the profiled step's files, its phase table
against the phases' own timers, and the key's check."""

from __future__ import annotations

import gzip
import json
import os
import re
import time

import pytest
import torch

from spmd_rl import preflight
from spmd_rl.errors import ConfigError
from spmd_rl.telemetry import step_profiler
from tests.helpers.dist_utils import run_distributed


def test_phase_table_matches_the_phases_wall_time(tmp_path):
    """Two named phases under the profiler: each row's wall time lies between the phase's own sleep and what a
    clock around the range saw (the clock also counts the range's entry and exit, slow on a loaded machine)."""
    walls = {}
    with step_profiler.profiled_step(1, str(tmp_path), 0, torch.device("cpu")):
        for name, seconds in (("generate", 0.05), ("update_actor", 0.12)):
            t0 = time.perf_counter()
            with step_profiler.phase_range(name):
                time.sleep(seconds)
                torch.ones(64, 64) @ torch.ones(64, 64)
            walls[name] = (time.perf_counter() - t0) * 1e3
    text = (tmp_path / "step_1_rank0.txt").read_text()
    rows = {m[1]: float(m[2]) for m in re.finditer(r"^\| (\w+) \| ([\d.]+) \| [\d.]+ \| - \| [\d.]+ \|$", text, re.M)}
    assert set(rows) == {"generate", "update_actor"}, text
    for name, wall in walls.items():
        slept = dict(generate=50.0, update_actor=120.0)[name]
        assert slept - 1.0 <= rows[name] <= wall + 1.0, (name, rows[name], slept, wall)
    assert "aten::mm" in text  # the op table follows
    trace = json.loads(gzip.open(tmp_path / "step_1_rank0.json.gz").read())
    assert {"phase/generate", "phase/update_actor"} <= {e.get("name") for e in trace["traceEvents"]}


def test_garbage_collections_are_ranges_in_the_trace_and_counted_per_phase(tmp_path):
    """Two collections inside a phase are `gc/generation2` ranges; the phase's GC ms is their time
    (clocked around each gc.collect), the other phase's 0 (automatic collections off here)."""
    import gc

    clocked = []

    def collect():
        junk = []
        for _ in range(20000):  # cycles for the collector to find
            a, b = [], []
            a.append(b)
            b.append(a)
            junk.append(a)
        del junk
        t0 = time.perf_counter()
        gc.collect()
        clocked.append((time.perf_counter() - t0) * 1e3)

    was_on = gc.isenabled()
    gc.disable()
    try:
        with step_profiler.profiled_step(1, str(tmp_path), 0, torch.device("cpu")):
            with step_profiler.phase_range("generate"):
                time.sleep(0.02)
            with step_profiler.phase_range("update_actor"):
                collect()
                collect()
    finally:
        if was_on:
            gc.enable()
    text = (tmp_path / "step_1_rank0.txt").read_text()
    rows = {m[1]: float(m[2]) for m in re.finditer(r"^\| (\w+) \| [\d.]+ \| [\d.]+ \| - \| ([\d.]+) \|$", text, re.M)}
    assert rows["generate"] == 0.0, text
    # the profiler's timestamps and perf_counter differ in rate by a fraction of a percent (the profiler converts
    # its clock approximately): 17 ms over collections of 3.5 s, a full suite's heap; a range counted twice is 2x
    assert sum(clocked) * 0.7 <= rows["update_actor"] <= sum(clocked) * 1.01 + 0.2, (rows, clocked)
    trace = json.loads(gzip.open(tmp_path / "step_1_rank0.json.gz").read())
    assert sum(e.get("name") == "gc/generation2" for e in trace["traceEvents"]) == 2


@pytest.mark.parametrize("steps", ["[0]", "[4]"])
def test_steps_outside_the_run_are_refused(tmp_path, steps):
    from tests.config.test_config import valid_cfg

    with pytest.raises(ConfigError, match=r"trainer.profile_steps = \[\d\]: \[\d\] not between 1 and trainer.total_steps = 3"):
        preflight.validate(valid_cfg(tmp_path, [f"trainer.profile_steps={steps}", "trainer.total_steps=3",
                                     f'trainer.run_dir="{tmp_path}/run"']), world_size=1)


def _fit_body(rank, world, base):
    from tests.train.test_old_logprobs import _trainer

    trainer = _trainer(f"{base}/run", f"{base}/data", ["data.train_batch_size=4", "rollout.n=2", "actor.ppo_mini_batch_size=4",
                                                       "actor.micro_batch_size_per_gpu=4", "trainer.total_steps=2",
                                                       "trainer.save_every=-1", "trainer.profile_steps=[2]"], rank)
    trainer.fit()
    trainer.close()


def test_a_run_profiles_the_steps_it_names(tmp_path):
    """A 2-step run with trainer.profile_steps = [2]: step 2's files only, with the step's phases."""
    run_distributed(_fit_body, 1, str(tmp_path))
    files = sorted(os.listdir(tmp_path / "run" / "profile"))
    assert files == ["step_2_rank0.json.gz", "step_2_rank0.txt"], files
    text = (tmp_path / "run" / "profile" / "step_2_rank0.txt").read_text()
    for phase in ("generate", "reward", "adv", "update_actor"):
        assert re.search(rf"^\| {phase} \| [\d.]+ \|", text, re.M), (phase, text[:2000])


class _Event:
    """The fields of torch.profiler's FunctionEvent that phase_times reads (times in us)."""

    def __init__(self, name, start, end, device=False, annotation=False):
        from torch.autograd import DeviceType
        from torch.autograd.profiler_util import Interval

        self.name, self.time_range = name, Interval(start, end)
        self.device_type = DeviceType.CUDA if device else DeviceType.CPU
        self.is_user_annotation = annotation


def test_gpu_busy_is_the_union_of_device_activity_inside_each_phase():
    """Hand-made events: overlapping kernels count once, a kernel launched by another thread (the
    backward's) counts, the device-side copy of a phase's range (a user annotation) does not, and a
    kernel running past its phase's end counts in the next phase. Reference: worked out by hand."""
    events = [
        _Event("phase/generate", 0, 10_000), _Event("phase/update_actor", 10_000, 30_000),
        _Event("phase/generate", 0, 10_000, device=True, annotation=True),  # spans the phase's kernels
        _Event("phase/update_actor", 10_500, 29_000, device=True, annotation=True),
        _Event("decode", 1_000, 4_000, device=True), _Event("decode", 3_000, 5_000, device=True),  # union 4 ms
        _Event("matmul", 9_000, 12_000, device=True),  # 1 ms in generate, 2 ms in update_actor
        _Event("copy", 9_500, 9_600, device=True),  # another stream, inside matmul: counts once
        _Event("backward", 20_000, 26_000, device=True),  # launched by autograd's thread
        _Event("cudaLaunchKernel", 20_000, 20_010),  # host side: not device activity
    ]
    times = step_profiler.phase_times(events)
    assert times == {"generate": (10.0, 5.0), "update_actor": (20.0, 8.0)}, times


def test_idle_time_is_given_to_the_innermost_host_op_running_then():
    """The GPU idles from 5 to 10 ms of a 20 ms phase. Sampled every 0.2 ms, the idle time goes to
    the innermost host op covering each sample (a nested op wins over its parent), to
    "(host code between ops)" where none runs; ops outside the gap get nothing; a gap shorter than
    a sample counts its own length. By hand: 5-7 ms inside _local_scalar_dense (nested in item),
    7-8 item alone, 8.5-9 cudaMalloc, the rest none; 0.05 ms in cudaLaunchKernel between two kernels."""
    events = [
        _Event("phase/update_actor", 0, 20_000),
        _Event("phase/update_actor", 0, 20_000, device=True, annotation=True),  # not device activity
        _Event("fwd", 0, 5_000, device=True), _Event("bwd", 10_000, 15_000, device=True),
        _Event("bwd2", 15_050, 20_000, device=True), _Event("cudaLaunchKernel", 15_000, 15_100),
        _Event("aten::item", 4_000, 8_000), _Event("aten::_local_scalar_dense", 5_000, 7_000),
        _Event("cudaMalloc", 8_500, 9_000), _Event("aten::mm", 12_000, 13_000),
    ]
    idle = step_profiler.idle_host_ops(events, "update_actor")
    assert list(idle) == ["aten::_local_scalar_dense", "(host code between ops)", "aten::item", "cudaMalloc",
                          "cudaLaunchKernel"], idle
    assert [idle[k] for k in idle] == pytest.approx([2.0, 1.4, 1.0, 0.6, 0.05]), idle
    assert step_profiler.phase_times(events)["update_actor"] == (20.0, 14.95)
    # the profile's text: a phase idling under 50 ms gets no table
    text = "\n".join(step_profiler.idle_table(step_profiler._timeline(events), step_profiler.phase_times(events)))
    assert text == ""
    long = events + [_Event("phase/generate", 30_000, 130_000), _Event("sampler", 40_000, 140_000)]
    text = "\n".join(step_profiler.idle_table(step_profiler._timeline(long), step_profiler.phase_times(long)))
    assert "GPU idle in generate: 100 ms" in text and "| sampler | 90.0 | 90% |" in text, text
    assert "| (host code between ops) | 10.0 | 10% |" in text and "update_actor" not in text, text


def test_idle_time_is_placed_in_the_phase_by_tenth_and_by_gap():
    """A phase of two 10 ms ranges (20 ms end to end): the GPU idles 0-3 ms and 9-10 ms of the first and
    15-16 ms of the second (its 5-6 ms: 15-16 ms end to end). By hand, tenths of 2 ms: 2, 1, 0, 0, 1, 0, 0, 1,
    0, 0 ms; gaps longest first: 3 ms at 0, then the two 1 ms gaps in order of the sort (stable: first
    found first)."""
    events = [
        _Event("phase/generate", 0, 10_000), _Event("phase/generate", 30_000, 40_000),
        _Event("decode", 3_000, 9_000, device=True), _Event("decode", 30_000, 35_000, device=True),
        _Event("decode", 36_000, 40_000, device=True),
        _Event("idle_kernel", 20_000, 30_000, device=True),  # between the ranges: outside the phase
    ]
    slices, gaps = step_profiler.idle_where(events, "generate")
    assert slices == pytest.approx([2.0, 1.0, 0, 0, 1.0, 0, 0, 1.0, 0, 0]), slices
    assert gaps == [(0.0, 3.0), (9.0, 1.0), (15.0, 1.0)], gaps
    assert step_profiler.idle_where(events, "generate", top=1)[1] == [(0.0, 3.0)]
    long = events + [_Event("phase/update_actor", 50_000, 150_000)]  # idles 100 ms: gets the lines
    text = "\n".join(step_profiler.idle_table(step_profiler._timeline(long), step_profiler.phase_times(long)))
    assert "Idle ms in each tenth of update_actor: 10, 10, 10, 10, 10, 10, 10, 10, 10, 10" in text, text
    assert "Its longest idle gaps (ms into the phase: ms): 0: 100.0" in text and "of generate" not in text, text


def test_each_phase_lists_the_kernels_it_started_by_device_time():
    """Hand-made events: a kernel counts in the phase whose range holds its start (also when it
    runs past the phase's end, and when the phase has two ranges), overlapping kernels each count
    their own time, the phase's device-side annotation is no kernel. By hand: update_actor has
    add 3 calls 0.5+1.0+2.0 ms, mm 1 call 4.0 ms; generate has decode 2 ms."""
    events = [
        _Event("phase/generate", 0, 10_000), _Event("phase/update_actor", 10_000, 20_000),
        _Event("phase/update_actor", 30_000, 40_000),
        _Event("phase/update_actor", 10_100, 19_000, device=True, annotation=True),
        _Event("decode", 1_000, 3_000, device=True),
        _Event("add", 10_500, 11_000, device=True), _Event("mm", 12_000, 16_000, device=True),
        _Event("add", 13_000, 14_000, device=True),  # overlaps mm: both count
        _Event("add", 19_500, 21_500, device=True),  # starts in the phase, ends after it
        _Event("idle_kernel", 25_000, 26_000, device=True),  # between ranges: no phase
        _Event("aten::add", 10_500, 10_600),  # host op: not a kernel
    ]
    assert step_profiler.phase_kernels(events) == {"update_actor": {"mm": (1, 4.0), "add": (3, 3.5)},
                                                   "generate": {"decode": (1, 2.0)}}
    times = {"update_actor": (20.0, 60.0), "generate": (10.0, 2.0)}  # only phases busy >= 50 ms get a table
    text = "\n".join(step_profiler.kernel_table(step_profiler._timeline(events), times))
    assert "Kernels in update_actor: 8 ms of device time, 4 launches" in text and "generate" not in text, text
    assert text.index("| mm | 1 | 4.0 | 53% |") < text.index("| add | 3 | 3.5 | 47% |"), text
