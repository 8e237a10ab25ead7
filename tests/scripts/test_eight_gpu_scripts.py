"""The eight-GPU run's scripts on CPU: scripts/bench/shipped_7b.sh (configs/qwen7b.toml as shipped, a save, a
resume) and scripts/bench/weak_scaling.sh (bench_step.sh's 1.5B work on 1, 2, 4, 8 GPUs). Each script's DRY=1
commands are parsed back (shlex), loaded as spmd_rl.ppo loads them, validated for their world size and predicted
by the start-up memory check to fit 80 GB cards; the 7B run must be the shipped preset but for the model, the data
and its steps, and weak scaling must keep each GPU's work (prompts, optimizer steps, phases) that of one GPU."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

import pytest

from tests.helpers import ROOT

sys.path.insert(0, os.path.join(ROOT, "tests", "gpu"))

from runs import expected_saves  # noqa: E402

from spmd_rl import preflight

SHIPPED = os.path.join(ROOT, "scripts", "bench", "shipped_7b.sh")
WEAK = os.path.join(ROOT, "scripts", "bench", "weak_scaling.sh")
BENCH_STEP = os.path.join(ROOT, "scripts", "bench", "bench_step.sh")
PRESET = os.path.join(ROOT, "configs", "qwen7b.toml")
H100_GIB = 79.2  # an H100's memory as torch reports it (tests/scripts/test_gpu_check_plan.py)

SHIPPED_CHANGES = {  # what shipped_7b.sh may change in the preset: no hub (model), no GSM8K (data), its steps
    "model.init", "model.arch", "model.path", "model.tokenizer", "data.synthetic_task", "data.apply_chat_template",
    "data.train_files", "data.val_files", "trainer.val_every", "trainer.run_dir", "trainer.total_steps",
    "trainer.save_every", "trainer.resume"}


def dry(script: str, *args: str, **env: str) -> list[list[str]]:
    """The torchrun commands a script prints with DRY=1, each split as a shell would."""
    p = subprocess.run(["bash", script, *args], cwd=ROOT, env=dict(os.environ, DRY="1", **env), capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    lines = p.stdout.splitlines()
    assert lines and all(line.startswith("torchrun ") for line in lines), p.stdout
    return [shlex.split(line) for line in lines]


def parse(argv: list[str]) -> tuple[int, str, list[str]]:
    """(ranks, --config, overrides) of `torchrun ... --nproc_per_node=N ... -m spmd_rl.ppo --config X k=v ...`."""
    i = argv.index("-m")
    assert argv[i + 1] == "spmd_rl.ppo", argv
    nproc = [int(a.split("=", 1)[1]) for a in argv[1:i] if a.startswith("--nproc_per_node=")]
    assert len(nproc) == 1, argv[:i]
    rest = argv[i + 2:]
    assert rest[0] == "--config", rest
    overrides = rest[2:]
    assert all("=" in o and not o.startswith("-") for o in overrides), overrides
    return nproc[0], rest[1], overrides


def loaded(argv: list[str], monkeypatch):
    """The command's config, validated for its ranks on one node, and its start-up memory plan on 80 GB cards."""
    from spmd_rl.config.run_config import load_config
    from spmd_rl.preflight import speed_settings
    from spmd_rl.preflight.memory import check_memory
    from spmd_rl.rollout.vllm import kwargs as vllm_kwargs

    monkeypatch.setattr(vllm_kwargs, "vllm_import_problem", lambda: None)  # no vLLM on the CI machine
    nproc, config, overrides = parse(argv)
    cfg = load_config(os.path.join(ROOT, config), overrides)
    speed_settings.resolve(cfg, nproc, H100_GIB * 2**30)  # "auto" chosen first, as the entry point does
    preflight.validate(cfg, world_size=nproc, gpus_per_node=nproc)
    plan = check_memory(cfg, nproc, H100_GIB * 2**30)
    assert plan is not None and plan.fits, plan.line()
    return nproc, config, cfg


def flat(cfg) -> dict:
    from spmd_rl.config.toml_io import to_dict
    from spmd_rl.preflight.resume import flatten

    return flatten(to_dict(cfg))


def changed(cfg, base) -> set[str]:
    a, b = flat(cfg), flat(base)
    return {k for k in a.keys() | b.keys() if a.get(k) != b.get(k)}


@pytest.mark.parametrize("gpus", [8, 4])
def test_shipped_7b_is_the_preset_with_a_save_and_a_resume(gpus, tmp_path, monkeypatch):
    from spmd_rl.config.run_config import load_config

    first, second = dry(SHIPPED, str(tmp_path), str(gpus))
    preset = load_config(PRESET, [])
    runs = []
    for argv in (first, second):
        nproc, config, cfg = loaded(argv, monkeypatch)
        assert nproc == gpus and os.path.join(ROOT, config) == PRESET
        script = changed(cfg, preset) - set(cfg.auto_chosen)  # the preset's "auto" keys, chosen at start
        assert script <= SHIPPED_CHANGES, script - SHIPPED_CHANGES
        for key in ("rollout.tensor_parallel_size", "data.train_batch_size", "rollout.n", "data.max_response_length",
                    "rollout.gpu_memory_utilization", "actor.ppo_mini_batch_size", "actor.max_token_len_per_gpu"):
            assert flat(cfg)[key] == flat(preset)[key], key
        assert cfg.rollout.tensor_parallel_size == 2 and cfg.data.train_batch_size == 256
        m, d = cfg.model, cfg.data
        assert (m.init, m.arch, m.path, m.tokenizer) == ("random", "qwen2-7b", "", "char")
        assert (d.synthetic_task, d.apply_chat_template, d.train_files) == (
            "arithmetic", False, [os.path.join(cfg.run_dir, "data", "train.parquet")])
        runs.append(cfg.trainer)
    assert [(t.total_steps, t.resume) for t in runs] == [(5, "none"), (7, "auto")]
    assert runs[0].run_dir == runs[1].run_dir and runs[0].keep_last == 2
    assert expected_saves((5, 7), (runs[0].save_every, runs[1].save_every)) == [5]  # step 5 saved, then none
    if os.path.isdir("/dev/shm"):
        assert runs[0].run_dir.startswith("/dev/shm/"), "the ~91 GB checkpoint goes to memory, not the disk"


def test_shipped_7b_extra_overrides_and_steps_reach_both_processes(tmp_path, monkeypatch):
    first, second = dry(SHIPPED, str(tmp_path), "8", "rollout.enforce_eager=true", STEPS="3", MORE="1",
                        RUN_DIR=str(tmp_path / "run"))
    runs = [loaded(argv, monkeypatch)[2] for argv in (first, second)]
    assert [(c.trainer.total_steps, c.trainer.run_dir, c.rollout.enforce_eager) for c in runs] == [
        (3, str(tmp_path / "run"), True), (4, str(tmp_path / "run"), True)]


FIXED_SPEED = ("model.gradient_checkpointing", "actor.max_token_len_per_gpu", "actor.logprob_max_token_len_per_gpu")
"""weak_scaling.sh's fixed speed settings."""


@pytest.mark.parametrize("counts", [None, "1 2 4 8", "1 2 4"])
def test_weak_scaling_keeps_the_work_per_gpu(counts, tmp_path, monkeypatch):
    """k GPUs: 64 x k prompts in one mini-batch, so each GPU generates and trains bench_step's 512 responses a
    step in one optimizer step (no old log-prob pass), with every other setting bench_step's on one GPU."""
    cmds = dry(WEAK, str(tmp_path), *([counts] if counts else []))
    expected = [int(k) for k in (counts or "1 2 4 8").split()]  # a dry run leaves out no count
    _, one_config, one = loaded(dry(BENCH_STEP, str(tmp_path), "qwen2-1.5b", "after")[0], monkeypatch)
    assert one.data.train_batch_size == 64 and not one.old_logprob_pass_reason()
    got = []
    for argv in cmds:
        nproc, config, cfg = loaded(argv, monkeypatch)
        got.append(nproc)
        assert config == one_config
        assert cfg.data.train_batch_size == cfg.actor.ppo_mini_batch_size == 64 * nproc
        assert cfg.data.train_batch_size * cfg.rollout.n // nproc == 512 and cfg.rollout.tensor_parallel_size == 1
        assert not cfg.old_logprob_pass_reason(), cfg.old_logprob_pass_reason()
        assert cfg.trainer.save_every == -1 and cfg.trainer.run_dir.endswith(f"/step-qwen2-1.5b-after-gpus{nproc}/run")
        # each run's synthetic data is its own, under its run directory
        assert (cfg.model.gradient_checkpointing, cfg.actor.max_token_len_per_gpu,
                cfg.actor.logprob_max_token_len_per_gpu) == (False, 16384, 32768)  # fixed, not "auto", on every count
        fixed = {k for k in FIXED_SPEED if flat(cfg)[k] != flat(one)[k]}  # where bench_step's "auto" chose otherwise
        assert changed(cfg, one) == ({"trainer.run_dir", "trainer.save_every", "data.train_files", "data.val_files"} |
                                     ({"data.train_batch_size", "actor.ppo_mini_batch_size"} if nproc > 1 else set())
                                     | fixed)
    assert got == expected


def test_weak_scaling_leaves_out_counts_above_the_visible_gpus(tmp_path):
    """Run for real with no GPU visible: every count is left out, saying so, and nothing starts."""
    p = subprocess.run(["bash", WEAK, str(tmp_path), "1 2"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, CUDA_VISIBLE_DEVICES="", DRY="0"))
    assert p.stdout.splitlines() == ["left out: 1 GPUs (0 visible)", "left out: 2 GPUs (0 visible)"], p.stdout
    assert p.returncode != 0 and not list(tmp_path.iterdir())
