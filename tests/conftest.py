"""Shared fixtures: one short trained run on 2 ranks that several test files read (never write)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_cmd(run_dir, data_dir, *overrides, nproc=2):
    """torchrun of the tiny CPU preset for `run_dir`, a few steps, data under `data_dir`."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            "-m", "spmd_rl.ppo", "--config", os.path.join(ROOT, "configs", "tiny-cpu.toml"),
            f"trainer.run_dir={run_dir}", "trainer.total_steps=2", "trainer.tensorboard=true",
            f'data.train_files=["{data_dir}/train.parquet"]', f'data.val_files=["{data_dir}/val.parquet"]',
            "data.synthetic_size=256", "data.val_batch_size=64", "trainer.val_every=0", *overrides]


def run_cmd(cmd, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """A finished 2-step, 2-rank run with a checkpoint and a Hugging Face export at the end
    (trainer.export_hf_dir). Returns (run_dir, data_dir, export_dir). Tests must not modify it."""
    base = tmp_path_factory.mktemp("tiny_run")
    run_dir, data_dir, export_dir = base / "run", base / "data", base / "hf"
    p = run_cmd(tiny_cmd(run_dir, data_dir, f"trainer.export_hf_dir={export_dir}"))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return run_dir, data_dir, export_dir


@pytest.fixture(scope="module")
def env():
    """GPU tests: one process, a world of one (NCCL default group) on the current GPU, per module."""
    from spmd_rl.distributed import init_distributed
    from spmd_rl.lifecycle import destroy_process_group

    env = init_distributed("cuda")
    yield env
    destroy_process_group()  # the ordered teardown of spmd_rl.lifecycle, as a run's
