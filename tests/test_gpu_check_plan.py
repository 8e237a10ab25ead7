"""scripts/gpu_check.py's plan, on CPU: every shipped preset has a GPU check (a file in configs/
without one fails here, naming it), each preset's check overrides pass config validation on its
GPU count, and the scheduler (lanes, small checks beside big ones, the budget, the GPU column)
does what its docstring says, with a fake runner and no GPU."""

from __future__ import annotations

import os
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "tests", "gpu"))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import gpu_check  # noqa: E402
from test_presets_gpu import CPU_PRESETS, PRESETS, preset_overrides  # noqa: E402

CONFIGS = sorted(f[:-5] for f in os.listdir(os.path.join(ROOT, "configs")) if f.endswith(".toml"))


def test_every_shipped_preset_has_a_check():
    missing = [c for c in CONFIGS if c not in PRESETS and c not in CPU_PRESETS]
    assert not missing, (f"configs/{missing[0]}.toml has no GPU check: add it to PRESETS in "
                         "tests/gpu/test_presets_gpu.py (or to CPU_PRESETS with where it is tested)")
    stale = [p for p in [*PRESETS, *CPU_PRESETS] if p not in CONFIGS]
    assert not stale, f"tests/gpu/test_presets_gpu.py names presets that are not in configs/: {stale}"


def test_gpu_check_plan_runs_every_preset_check():
    planned = {target for check in gpu_check.PLAN for target in check.targets}
    for name in PRESETS:
        node = f"tests/gpu/test_presets_gpu.py::test_preset_trains_saves_and_resumes[{name}]"
        assert node in planned, f"scripts/gpu_check.py's PLAN does not run {node}"


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_check_overrides_validate_on_its_gpus(name, monkeypatch, tmp_path):
    """The check's overrides on the preset (the model as a random one of the same shape: the check's
    model directory only exists on the GPU machine) are a valid config for its GPU count."""
    from spmd_rl import vllm_kwargs
    from spmd_rl.config import load_config

    monkeypatch.setattr(vllm_kwargs, "vllm_import_problem", lambda: None)  # no vLLM on the CI machine
    p = PRESETS[name]
    args = preset_overrides(name, "unused", p.save_every[0])
    config = args[args.index("--config") + 1]
    overrides = [a.replace("RUN_DIR", str(tmp_path)) for a in args if a not in ("--config", config)]
    overrides = [a for a in overrides if not a.startswith(("model.path=", "model.init="))]
    overrides += ['model.init="random"', 'model.path=""', f'model.arch="{p.arch}"', f"trainer.run_dir={tmp_path}",
                  f'data.train_files=["{tmp_path}/data/train.parquet"]']
    cfg = load_config(config, overrides)
    cfg.validate(world_size=p.gpus, gpus_per_node=p.gpus)
    assert cfg.data.max_response_length == 128 and cfg.rollout.engine == "vllm"


def fake_run(checks, n_gpus, budget, durations, poll=0.01):
    """schedule() with a runner that sleeps each check's duration (seconds / 100) and records when
    and where it ran."""
    import threading
    import time

    log, lock = [], threading.Lock()
    t0 = time.monotonic()

    def runner(check, gpus, timeout):
        start = time.monotonic() - t0
        time.sleep(durations[check.name] / 100)
        with lock:
            log.append((check.name, gpus, start, time.monotonic() - t0))
        return [gpu_check.Row(check.name, "PASS", durations[check.name], gpu_check._label(gpus))]

    import dataclasses

    scaled = [dataclasses.replace(c, secs=c.secs / 100) for c in checks]  # expected seconds on the same clock
    rows = gpu_check.schedule(scaled, n_gpus, budget / 100, runner, poll_s=poll, say=lambda s: None)
    return rows, {name: (gpus, start, end) for name, gpus, start, end in log}


C = gpu_check.Check


def test_one_gpu_checks_run_side_by_side_and_a_two_gpu_check_waits_for_both():
    checks = [C("a", ("x",), secs=30), C("b", ("x",), secs=20), C("c", ("x",), secs=10), C("d", ("x",), gpus=2, secs=10),
              C("e", ("x",), secs=10)]
    rows, ran = fake_run(checks, 2, 1000, {"a": 30, "b": 20, "c": 10, "d": 10, "e": 10})
    assert [r.item for r in rows] == ["a", "b", "c", "d", "e"] and all(r.result == "PASS" for r in rows)
    assert {ran["a"][0], ran["b"][0]} == {(0,), (1,)} and ran["b"][1] < 0.05  # a and b at once
    assert ran["c"][0] == ran["b"][0] and ran["c"][1] >= ran["b"][2] - 0.02  # c on the GPU b frees
    assert ran["d"][0] == (0, 1) and ran["d"][1] >= max(ran["a"][2], ran["c"][2]) - 0.02
    assert ran["e"][1] >= ran["d"][1], "nothing after a waiting 2-GPU check starts before it"


def test_small_checks_run_beside_others_but_never_beside_an_alone_one():
    checks = [C("big7b", ("x",), gpus=2, secs=20, alone=True), C("tiny", ("x",), secs=5, small=True),
              C("pair", ("x",), gpus=2, secs=5, small=True), C("long", ("x",), gpus=2, secs=20)]
    rows, ran = fake_run(checks, 2, 1000, {"big7b": 20, "tiny": 5, "pair": 5, "long": 20})
    assert all(r.result == "PASS" for r in rows)
    for small in ("tiny", "pair"):
        assert ran[small][1] >= ran["big7b"][2] - 0.02, (small, ran)  # after the alone check
        assert ran[small][1] < ran["long"][2], (small, ran)  # beside the next big one
    assert ran["pair"][0] == (0, 1)


def test_more_gpus_than_visible_is_na_and_the_budget_leaves_checks_not_run():
    checks = [C("one", ("x",), secs=30), C("two", ("x",), gpus=2, secs=10), C("late", ("x",), secs=30)]
    rows, ran = fake_run(checks, 1, 50, {"one": 30, "two": 10, "late": 30})
    got = {r.item: r for r in rows}
    assert got["one"].result == "PASS" and got["two"].result == "n/a" and "needs 2 GPUs, 1 visible" in got["two"].note
    assert got["late"].result == "NOT RUN" and "late" not in ran


def test_table_names_the_gpus_of_every_row_and_fails_on_not_run():
    rows = [gpu_check.Row("a", "PASS", 1.0, "0"), gpu_check.Row("b", "PASS", 2.0, "0,1"),
            gpu_check.Row("c", "NOT RUN", 0.0, "-", "no time")]
    text = gpu_check.table(rows, 3.0)
    assert "| 0,1  | PASS" in text and "TOTAL" in text.splitlines()[-1] and "FAIL" in text.splitlines()[-1]


def test_expected_schedule_of_the_plan_fits_its_documented_calls():
    """The calls gpu_check.py's docstring gives for 2 GPUs each fit a device call (<= 570 s expected)."""
    doc = gpu_check.__doc__
    groups = ("preset-7b", "learning-1gpu,learning-2gpu,preset-long,ulysses", "preset-0.5b,preset-1.5b,kernels",
              "ppo,export,colocate,offload", "multiturn-learning,preset-0.5b-tool")
    for group in groups:
        assert group in doc
        checks = [c for c in gpu_check.PLAN if c.name in group.split(",")]
        total = float(gpu_check.expected_schedule(checks, 2)[-1].split(":")[1].strip().rstrip("s"))
        assert total <= 570, (group, total)
    assert {c.name for c in gpu_check.PLAN} == {n for g in groups for n in g.split(",")}
