"""scripts/gpu_check.py's plan (gpu_check_plan.py) and main, on CPU: every shipped preset has a GPU
check (a file in configs/ without one fails here, naming it), each preset's check overrides pass
config validation on its GPU count, and the scheduler (lanes, small checks beside big ones, the
budget, the GPU column) does what its docstring says, with a fake runner and no GPU."""

from __future__ import annotations

import os
import sys

import pytest

from tests.helpers import ROOT

sys.path.insert(0, os.path.join(ROOT, "tests", "gpu"))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import gpu_check  # noqa: E402
import gpu_check_machine  # noqa: E402
import gpu_check_plan  # noqa: E402
import gpu_check_results  # noqa: E402
from test_presets_gpu import CPU_PRESETS, PRESETS, preset_overrides  # noqa: E402

from spmd_rl import preflight

CONFIGS = sorted(f[:-5] for f in os.listdir(os.path.join(ROOT, "configs")) if f.endswith(".toml"))


def test_every_shipped_preset_has_a_check():
    missing = [c for c in CONFIGS if c not in PRESETS and c not in CPU_PRESETS]
    assert not missing, (f"configs/{missing[0]}.toml has no GPU check: add it to PRESETS in "
                         "tests/gpu/test_presets_gpu.py (or to CPU_PRESETS with where it is tested)")
    stale = [p for p in [*(v.config or k for k, v in PRESETS.items()), *CPU_PRESETS] if p not in CONFIGS]
    assert not stale, f"tests/gpu/test_presets_gpu.py names presets that are not in configs/: {stale}"


def test_gpu_check_plan_runs_every_gpu_test_file():
    """Every tests/gpu/test_*.py is run by a check of PLAN (a GPU test nobody runs is a test that
    never fails), and every target of PLAN exists."""
    gpu_tests = sorted(f"tests/gpu/{f}" for f in os.listdir(os.path.join(ROOT, "tests", "gpu"))
                       if f.startswith("test_") and f.endswith(".py"))
    planned = {target.split("::")[0] for check in gpu_check_plan.PLAN for target in check.targets}
    missing = [f for f in gpu_tests if f not in planned]
    assert not missing, f"scripts/gpu_check.py's PLAN runs no test of {missing}"
    assert all(os.path.isfile(os.path.join(ROOT, f)) for f in planned), sorted(planned)
    assert {"families", "reward-model"} <= {c.name for c in gpu_check_plan.PLAN}
    one_gpu = {c.name: c.gpus for c in gpu_check_plan.PLAN if c.name in ("families", "reward-model")}
    assert one_gpu == {"families": 1, "reward-model": 1} and not any(c.gpus_by_memory for c in gpu_check_plan.PLAN
                                                                       if c.name in one_gpu)


def test_gpu_check_plan_runs_every_preset_check():
    planned = {target for check in gpu_check_plan.PLAN for target in check.targets}
    for name in PRESETS:
        node = f"tests/gpu/test_presets_gpu.py::test_preset_trains_saves_and_resumes[{name}]"
        assert node in planned, f"scripts/gpu_check.py's PLAN does not run {node}"


H100_GIB, H200_GIB = 79.2, 139.8  # an H100's and an H200's memory as torch reports it


def preset_config(name, tmp_path, monkeypatch):
    """The check's overrides on the preset, the model as a random one of the same shape (the check's
    model directory only exists on the GPU machine)."""
    from spmd_rl.config.run_config import load_config
    from spmd_rl.rollout.vllm import kwargs as vllm_kwargs

    monkeypatch.setattr(vllm_kwargs, "vllm_import_problem", lambda: None)  # no vLLM on the CI machine
    p = PRESETS[name]
    args = preset_overrides(name, "unused", p.save_every[0])
    config = args[args.index("--config") + 1]
    overrides = [a.replace("RUN_DIR", str(tmp_path)) for a in args if a not in ("--config", config)]
    overrides = [a for a in overrides if not a.startswith(("model.path=", "model.init="))]
    overrides += ['model.init="random"', 'model.path=""', f'model.arch="{p.arch}"', f"trainer.run_dir={tmp_path}",
                  f'data.train_files=["{tmp_path}/data/train.parquet"]']
    return load_config(config, overrides)


@pytest.mark.parametrize("gpu_gib", [H100_GIB, H200_GIB])
@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_check_overrides_validate_and_fit_on_its_gpus(name, gpu_gib, monkeypatch, tmp_path):
    """The check's overrides are a valid config for the GPU count it runs on with cards of this
    memory (Preset.gpus_on), and the start-up memory check predicts that it fits those GPUs: qwen7b
    on 4 80 GB cards or 2 141 GB ones."""
    from spmd_rl.preflight import speed_settings
    from spmd_rl.preflight.memory import check_memory

    gpus = PRESETS[name].gpus_on(gpu_gib)
    cfg = preset_config(name, tmp_path, monkeypatch)
    preflight.validate(cfg, world_size=gpus, gpus_per_node=gpus)
    assert cfg.data.max_response_length == 128 and cfg.rollout.engine == "vllm"
    speed_settings.resolve(cfg, gpus, gpu_gib * 2**30)  # "auto" settings, as the entry point chooses them
    assert check_memory(cfg, gpus, gpu_gib * 2**30).fits
    if name == "qwen7b":
        assert gpus == {H100_GIB: 4, H200_GIB: 2}[gpu_gib]


def test_qwen7b_needs_4_gpus_of_80_gb_and_2_of_the_smallest_memory_it_picks_2_for(monkeypatch, tmp_path):
    """Why qwen7b's GPU count depends on the cards: on two 80 GB cards the start-up memory check
    refuses it, naming 4 GPUs and LoRA (on two H100s it ran out of memory in its update,
    2026-11-26); every (GiB, GPUs) pair of Preset.gpus_by_memory fits at that GiB, the least memory
    that picks it."""
    from spmd_rl.preflight import speed_settings
    from spmd_rl.preflight.memory import MemoryPlanError, check_memory

    p = PRESETS["qwen7b"]
    cfg = preset_config("qwen7b", tmp_path, monkeypatch)
    with pytest.raises(MemoryPlanError, match=r"shard over more GPUs \(4 GPUs: peak [\d.]+ GiB, fits\).*LoRA"):
        check_memory(cfg, 2, H100_GIB * 2**30)
    assert p.gpus_by_memory, "qwen7b runs on 2 GPUs where they have the memory"
    for name, preset in PRESETS.items():
        for gib, n in preset.gpus_by_memory:
            assert preset.gpus_on(gib) == n and preset.gpus_on(gib - 1) != n, (name, gib, n)
            cfg = preset_config(name, tmp_path / name, monkeypatch)
            preflight.validate(cfg, world_size=n, gpus_per_node=n)
            speed_settings.resolve(cfg, n, gib * 2**30)
            assert check_memory(cfg, n, gib * 2**30).fits, (name, f"{n} GPUs of {gib} GiB")


@pytest.mark.parametrize("gpu_gib", [H100_GIB, H200_GIB, 0.0])
def test_preset_checks_need_the_gpus_their_tests_run_on(gpu_gib):
    """gpu_check's preset checks ask for as many GPUs as the preset tests then use on the same cards
    (0: memory unknown, planned as 80 GB cards)."""
    for check in gpu_check_plan.for_cards(gpu_check_plan.PLAN, gpu_gib):
        for target in check.targets:
            if target.startswith(gpu_check_plan.PRESET_TEST):
                name = target.split("[", 1)[1].rstrip("]")
                assert check.gpus == PRESETS[name].gpus_on(gpu_gib), (check.name, gpu_gib)


def test_card_memory_from_nvidia_smi():
    smi = ("0, GPU-aaaa-1111, 81559\n1, GPU-bbbb-2222, 81559\n2, GPU-cccc-3333, 143771\n"
           "3, GPU-dddd-4444, 143771\n")
    assert gpu_check_machine.smallest_card_gib(smi) == pytest.approx(81559 / 1024)
    assert gpu_check_machine.smallest_card_gib(smi, "2,3") == pytest.approx(143771 / 1024)
    assert gpu_check_machine.smallest_card_gib(smi, "GPU-cccc,GPU-dddd-4444") == pytest.approx(143771 / 1024)
    assert gpu_check_machine.smallest_card_gib(smi, "1,2") == pytest.approx(81559 / 1024)
    assert gpu_check_machine.smallest_card_gib("") == 0.0
    assert gpu_check_machine.smallest_card_gib("No devices were found\n") == 0.0


@pytest.mark.parametrize("n_gpus, gpu_gib, result, gpus", [
    (2, H100_GIB, "n/a", "-"),  # two 80 GB cards: it needs 4
    (4, H100_GIB, "PASS", "0,1,2,3"),
    (2, H200_GIB, "PASS", "0,1"),
    (1, H200_GIB, "n/a", "-"),
])
def test_the_7b_preset_runs_on_the_gpus_its_cards_memory_asks_for(n_gpus, gpu_gib, result, gpus):
    """The scheduler with the plan for the cards' memory: the 7B preset check on 4 80 GB GPUs or 2
    141 GB ones, n/a where the machine has fewer; the other checks as before."""
    plan = [c for c in gpu_check_plan.for_cards(gpu_check_plan.PLAN, gpu_gib) if c.name in ("preset-7b", "preset-0.5b")]
    rows, ran = fake_run(plan, n_gpus, 10000, {"preset-7b": 43, "preset-0.5b": 32})
    got = {r.item: r for r in rows}
    assert (got["preset-7b"].result, got["preset-7b"].gpus) == (result, gpus), got["preset-7b"]
    if result == "n/a":
        assert f"needs {PRESETS['qwen7b'].gpus_on(gpu_gib)} GPUs, {n_gpus} visible" in got["preset-7b"].note
    assert got["preset-0.5b"].result == "PASS"


@pytest.mark.parametrize("family", ["qwen3", "llama3", "gemma3"])
def test_family_runs_validate_and_fit_one_80_gb_gpu(family, monkeypatch, tmp_path):
    """tests/gpu/test_model_families_gpu.py's runs (the model as a random one of the same shape) are
    a valid config on one GPU and predicted to fit an 80 GB card, with the shape of the family's own
    config class (not a Qwen2 read of it)."""
    import torch
    from test_model_families_gpu import FAMILIES, RUN, family_overrides
    from transformers import AutoModelForCausalLM

    from spmd_rl.config.run_config import load_config
    from spmd_rl.model.loading import preset_config
    from spmd_rl.preflight.memory import check_memory, model_shape
    from spmd_rl.rollout.vllm import kwargs as vllm_kwargs

    monkeypatch.setattr(vllm_kwargs, "vllm_import_problem", lambda: None)  # no vLLM on the CI machine
    overrides = [a for a in family_overrides("unused") if not a.startswith(("model.path=", "model.init="))]
    assert len(overrides) == len(RUN) - 1
    cfg = load_config(None, [*overrides, 'model.init="random"', f'model.arch="{FAMILIES[family]}"',
                             f"trainer.run_dir={tmp_path}", f'data.train_files=["{tmp_path}/data/train.parquet"]'])
    preflight.validate(cfg, world_size=1, gpus_per_node=1)
    assert cfg.rollout.engine == "vllm" and not cfg.rollout.enforce_eager and cfg.model.remove_padding
    plan = check_memory(cfg, 1, H100_GIB * 2**30)
    assert plan is not None and plan.fits, plan
    with torch.device("meta"):
        n = sum(p.numel() for p in AutoModelForCausalLM.from_config(preset_config(FAMILIES[family])).parameters())
    assert model_shape(cfg).parameters() == pytest.approx(n, rel=0.01), (family, "the plan's shape is not the model's")


def fake_run(checks, n_gpus, budget, durations, poll=0.01):
    """schedule() with a runner that sleeps each check's duration (seconds / 100) and records when
    and where it ran, and whether it was told its GPUs are shared."""
    import threading
    import time

    log, lock = [], threading.Lock()
    t0 = time.monotonic()

    def runner(check, gpus, timeout, shared):
        start = time.monotonic() - t0
        time.sleep(durations[check.name] / 100)
        with lock:
            log.append((check.name, gpus, start, time.monotonic() - t0, shared))
        return [gpu_check_plan.Row(check.name, "PASS", durations[check.name], gpu_check_plan.gpu_label(gpus))]

    import dataclasses

    scaled = [dataclasses.replace(c, secs=c.secs / 100) for c in checks]  # expected seconds on the same clock
    rows = gpu_check_plan.schedule(scaled, n_gpus, budget / 100, runner, poll_s=poll, say=lambda s: None)
    return rows, {name: (gpus, start, end, shared) for name, gpus, start, end, shared in log}


def assert_unshared_checks_had_their_gpus_to_themselves(ran):
    """A check told its GPUs are not shared (SPMD_RL_GPU_SHARED=0: its free-memory drift check on)
    overlapped no other check on any of its GPUs."""
    for name, (gpus, start, end, shared) in ran.items():
        if shared:
            continue
        for other, (g2, s2, e2, _) in ran.items():
            overlap = min(end, e2) - max(start, s2)
            assert other == name or not set(gpus) & set(g2) or overlap <= 0.005, (name, other, ran)


C = gpu_check_plan.Check


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
    assert not ran["big7b"][3] and ran["long"][3], ran  # only the check with small ones beside it is shared
    assert_unshared_checks_had_their_gpus_to_themselves(ran)


def test_a_check_is_shared_only_where_a_small_check_runs_on_its_gpus():
    """One GPU, the plan's order (a small check first, then big ones): the first big check runs
    beside the small one (shared); the next starts after it, alone (its drift check runs). A small
    check never joins a big check started alone: it waits for it."""
    checks = [C("learn", ("x",), secs=8, small=True), C("preset", ("x",), secs=20), C("other", ("x",), secs=10)]
    rows, ran = fake_run(checks, 1, 1000, {"learn": 8, "preset": 20, "other": 10})
    assert all(r.result == "PASS" for r in rows)
    assert ran["learn"][3] and ran["preset"][3] and not ran["other"][3], ran
    assert_unshared_checks_had_their_gpus_to_themselves(ran)

    checks = [C("first", ("x",), secs=20), C("learn", ("x",), secs=8, small=True)]
    rows, ran = fake_run(checks, 1, 1000, {"first": 20, "learn": 8})
    assert not ran["first"][3] and ran["learn"][1] >= ran["first"][2] - 0.02, ran
    assert not ran["learn"][3], "the last check left, on a GPU of its own: not shared"
    assert_unshared_checks_had_their_gpus_to_themselves(ran)

    checks = [C("a", ("x",), secs=30), C("learn", ("x",), secs=5, small=True), C("b", ("x",), secs=20)]
    rows, ran = fake_run(checks, 2, 1000, {"a": 30, "learn": 5, "b": 20})
    assert ran["learn"][0] != ran["a"][0] and ran["learn"][1] < ran["a"][2], ran  # beside b, on the other GPU
    assert not ran["a"][3] and ran["b"][3], ran
    assert_unshared_checks_had_their_gpus_to_themselves(ran)


def test_more_gpus_than_visible_is_na_and_the_budget_leaves_checks_not_run():
    checks = [C("one", ("x",), secs=30), C("two", ("x",), gpus=2, secs=10), C("late", ("x",), secs=30)]
    rows, ran = fake_run(checks, 1, 50, {"one": 30, "two": 10, "late": 30})
    got = {r.item: r for r in rows}
    assert got["one"].result == "PASS" and got["two"].result == "n/a" and "needs 2 GPUs, 1 visible" in got["two"].note
    assert got["late"].result == "NOT RUN" and "late" not in ran


def test_table_names_the_gpus_of_every_row_and_fails_on_not_run():
    rows = [gpu_check_plan.Row("a", "PASS", 1.0, "0"), gpu_check_plan.Row("b", "PASS", 2.0, "0,1"),
            gpu_check_plan.Row("c", "NOT RUN", 0.0, "-", "no time")]
    text = gpu_check_results.table(rows, 3.0)
    assert "| 0,1  | PASS" in text and "TOTAL" in text.splitlines()[-1] and "FAIL" in text.splitlines()[-1]


@pytest.mark.parametrize("n_gpus, gpu_gib, n_calls", [(1, H100_GIB, 9), (2, H100_GIB, 6), (2, H200_GIB, 7),
                                                     (4, H100_GIB, 5), (8, H100_GIB, 3)])
def test_the_plan_splits_into_calls_that_each_fit(n_gpus, gpu_gib, n_calls):
    """--max-call-s 570 (a 10-minute device call): every check in one call, in PLAN order, each
    call's expected schedule within what the call leaves for checks; the docstring's call counts."""
    limit = 570 - gpu_check_plan.TAIL_S
    plan = gpu_check_plan.for_cards(gpu_check_plan.PLAN, gpu_gib)
    calls = gpu_check_plan.split_calls(plan, n_gpus, limit)
    assert sorted(c.name for g in calls for c in g) == sorted(c.name for c in plan)
    order = [c.name for c in plan]
    for group in calls:
        assert [c.name for c in group] == sorted((c.name for c in group), key=order.index)
        assert gpu_check_plan.expected_schedule(group, n_gpus)[1] <= limit, [c.name for c in group]
    assert len(calls) == n_calls
    said = {(1, H100_GIB): f"{n_calls} on one", (2, H100_GIB): f"{n_calls} on two 80 GB ones",
            (2, H200_GIB): f"{n_calls} on two 141 GB GPUs", (4, H100_GIB): f"{n_calls} calls on four 80 GB GPUs",
            (8, H100_GIB): f"{n_calls} calls on eight 80 GB GPUs"}[
        n_gpus, gpu_gib]
    assert said in " ".join(gpu_check_plan.__doc__.split()), f"gpu_check's docstring should say '{said}'"


def _call(monkeypatch, tmp_path, machine, names, argv, result="PASS"):
    """gpu_check.main on a fake machine: the checks `names` each give one row, no GPU, no pytest."""
    monkeypatch.setattr(gpu_check_machine, "WORK", tmp_path / machine.replace(" ", "_"))  # each machine its own disk
    monkeypatch.setattr(gpu_check, "machine_name", lambda: machine)  # the names main calls
    monkeypatch.setattr(gpu_check, "prebuild", lambda checks, out: None)
    monkeypatch.setattr(gpu_check, "schedule", lambda checks, n, budget, runner: [
        gpu_check_plan.Row(c.name, result, 1.0, "0", "", c.name) for c in checks])
    out = tmp_path / f"out-{machine.replace(' ', '_')}"
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--out", str(out), "--gpus", "4", "--only", names, *argv])
    return gpu_check.main(), out


def test_a_table_goes_on_on_another_machine_of_the_same_code_only(monkeypatch, tmp_path):
    """--continue FILE: the rows of a call on another machine (its OUT/results.json) join this call's
    table, which names the machine of every row; results of other code are refused in one line."""
    code, first_out = _call(monkeypatch, tmp_path, "4x H100 a", "export,colocate", [])
    assert code == 0 and (first_out / "results.json").is_file()
    code, out = _call(monkeypatch, tmp_path, "4x H100 b", "offload", ["--continue", str(first_out / "results.json")])
    text = (out / "gpu_check.txt").read_text()
    assert code == 0 and "3 passed" in text, text
    assert "[1] 4x H100 a; [2] 4x H100 b" in text and "offload" in [ln.split()[0] for ln in text.splitlines()
                                                                     if ln.endswith("[2]")], text
    monkeypatch.setattr(gpu_check, "code_fingerprint", lambda root=gpu_check_machine.ROOT: "other")
    with pytest.raises(SystemExit, match="results of other code"):
        _call(monkeypatch, tmp_path, "4x H100 c", "ppo", ["--continue", str(out / "results.json")])


def test_continue_from_results_that_are_not_there_stops_before_any_check(monkeypatch, tmp_path):
    """--continue FILE where FILE is missing (a path of the other machine, a copy not made), or plain
    --continue on a fresh machine: one error naming the file and the fix, and no check runs (a table
    that silently dropped the earlier rows would run them again, or total PASS without them)."""
    ran = []
    monkeypatch.setattr(gpu_check, "pytest_runner", lambda out: ran.append(out))
    for argv in (["--continue", str(tmp_path / "elsewhere" / "results.json")], ["--continue"]):
        with pytest.raises(SystemExit) as e:
            _call(monkeypatch, tmp_path, "4x H100 fresh", "offload", argv)
        assert e.value.code == 2
        assert ran == []
    code, out = _call(monkeypatch, tmp_path, "4x H100 fresh", "offload", [])
    assert code == 0 and (out / "results.json").is_file()


def test_the_code_fingerprint_follows_the_code_not_the_caches(tmp_path):
    (tmp_path / "spmd_rl" / "__pycache__").mkdir(parents=True)
    (tmp_path / "spmd_rl" / "a.py").write_text("x = 1\n")
    first = gpu_check_machine.code_fingerprint(tmp_path)
    (tmp_path / "spmd_rl" / "__pycache__" / "a.cpython-312.pyc").write_bytes(b"cache")
    (tmp_path / "README.md").write_text("docs")
    assert gpu_check_machine.code_fingerprint(tmp_path) == first
    (tmp_path / "spmd_rl" / "a.py").write_text("x = 2\n")
    assert gpu_check_machine.code_fingerprint(tmp_path) != first


def test_expected_schedule_puts_small_checks_after_an_alone_one():
    checks = [C("big", ("x",), gpus=2, secs=100, alone=True), C("tiny", ("x",), secs=30, small=True)]
    assert gpu_check_plan.expected_schedule(checks, 2)[1] == 130
    assert gpu_check_plan.expected_schedule([C("tiny", ("x",), secs=30, small=True)], 1)[1] == 30


@pytest.mark.parametrize("n_gpus, checks", [
    (8, [C("7b", ("x",), gpus=4, secs=40, alone=True), C("long", ("x",), gpus=2, secs=25),
         C("uly", ("x",), gpus=2, secs=15), C("tp2", ("x",), gpus=2, secs=33), C("k", ("x",), secs=15),
         C("fam", ("x",), secs=23)]),
    (4, [C("a", ("x",), secs=30), C("b", ("x",), secs=20), C("pair", ("x",), gpus=2, secs=10),
         C("c", ("x",), secs=10), C("pair2", ("x",), gpus=2, secs=25), C("d", ("x",), secs=5)]),
    (2, [C("a", ("x",), secs=30), C("b", ("x",), secs=20), C("pair", ("x",), gpus=2, secs=10), C("c", ("x",), secs=10)]),
])
def test_expected_schedule_ends_when_the_scheduler_does(n_gpus, checks):
    """The plan's expected total (what --max-call-s splits the calls by) against the scheduler itself,
    run with checks that take exactly their expected seconds: checks of several GPUs run side by side
    where the machine has GPUs for them (on eight GPUs the 7B preset on four, and two pairs at once)."""
    rows, ran = fake_run(checks, n_gpus, 1000, {c.name: c.secs for c in checks})
    assert all(r.result == "PASS" for r in rows)
    took = max(end for _, _, end, _ in ran.values()) * 100
    assert gpu_check_plan.expected_schedule(checks, n_gpus)[1] == pytest.approx(took, rel=0.1), ran


def test_a_check_longer_than_a_call_gets_a_call_of_its_own():
    checks = [C("a", ("x",), secs=100), C("huge", ("x",), secs=900), C("b", ("x",), secs=100)]
    assert [[c.name for c in g] for g in gpu_check_plan.split_calls(checks, 1, 500)] == [["a", "b"], ["huge"]]


def _fake_run(run_dir, saved, kept, steps=5):
    """A finished preset run's files as tests/gpu/runs.check_run reads them: steps 1-3, a resume from
    step_3, steps 4-5; `saved` steps logged a checkpoint stall, `kept` are on disk."""
    import json

    rows = [{"step": s, "rollout/logprob_diff_mean": 0.01, "memory/free_after_sleep_gb": 50.0} for s in range(1, steps + 1)]
    rows += [{"step": s, "time/checkpoint": 1.0} for s in saved]
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for s in kept:
        (run_dir / "checkpoints" / f"step_{s}").mkdir()
    (run_dir / "checkpoints" / "latest").write_text(f"step_{kept[-1]}")
    return ["", f"resumed from {run_dir}/checkpoints/step_3 at step 3"]


@pytest.mark.parametrize("save_every, saved, kept, ok", [
    ((1, 1), [1, 2, 3, 4, 5], [4, 5], True),
    ((1, 1), [1, 2, 3, 5], [4, 5], False),  # step 4's save did not happen (skipped: the disk was full)
    ((1, 1), [1, 2, 3, 4, 5], [5], False),  # keep_last = 2 but one left
    ((0, -1), [3], [3], True),  # at the first process's end only
    ((0, -1), [3], [2, 3], False),
])
def test_check_run_fails_a_save_asked_for_that_did_not_happen(tmp_path, save_every, saved, kept, ok):
    from runs import check_run, expected_saves

    logs = _fake_run(tmp_path, saved, kept)
    try:
        check_run("fake", tmp_path, (3, 5), logs, 0.05, saves=expected_saves((3, 5), save_every), keep_last=2,
                  shared=True)
    except AssertionError:
        assert not ok, "a run that made every save asked for failed"
    else:
        assert ok, "a missing save passed"


@pytest.mark.parametrize("free, ok", [
    ([64.04, 48.61, 48.61, 49.20, 48.52], True),  # 4xH100 qwen7b: the resumed process's first step made 0.68 GiB
    ([64.0, 48.6, 48.6, 49.2, 47.9], False),  # the resumed process leaks
    ([64.0, 48.6, 48.0, 48.6, 48.6], False),  # the first process leaks
    ([64.0, 48.6, 48.6, 48.6, 49.3], False),  # steady again after the resume, but not at the first process's level
])
def test_free_memory_must_be_steady_after_each_processs_first_step(tmp_path, monkeypatch, free, ok):
    import json

    import runs

    monkeypatch.setattr(runs, "shares_gpus", lambda: False)
    logs = _fake_run(tmp_path, [3], [3])
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        if "memory/free_after_sleep_gb" in row:
            row["memory/free_after_sleep_gb"] = free[row["step"] - 1]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    try:
        runs.check_run("fake", tmp_path, (3, 5), logs, 0.05)
    except AssertionError as e:
        assert not ok and "drifts" in str(e), e
    else:
        assert ok, f"a drift passed: {free}"


def test_expected_saves_follow_the_trainer():
    from runs import expected_saves

    assert expected_saves((3, 5), (1, 1)) == [1, 2, 3, 4, 5]
    assert expected_saves((3, 5), (0, -1)) == [3]
    assert expected_saves((4, 9), (2, 0)) == [2, 4, 9]
    assert expected_saves((3,), (-1,)) == []


def test_a_check_whose_package_is_missing_stops_gpu_check_before_any_check(monkeypatch, tmp_path, capsys):
    """A check's package (Check.needs: liger-kernel for `kernels`) this Python cannot import: one error
    naming the check, the package and the install, before any check runs; without that check it runs."""
    ran = []
    monkeypatch.setattr(gpu_check, "pytest_runner", lambda out: ran.append(out))
    monkeypatch.setattr(gpu_check, "importable", lambda package: package != "liger_kernel")
    with pytest.raises(SystemExit) as e:
        _call(monkeypatch, tmp_path, "1x H200", "kernels,export", [])
    assert e.value.code == 2 and ran == []
    assert "kernels needs liger_kernel, which this Python cannot import: pip install -e '.[gpu]'" in capsys.readouterr().err
    code, _ = _call(monkeypatch, tmp_path, "1x H200", "export", [])
    assert code == 0
