"""Shared fixtures: runs that several test files read (never write): one short trained run on 2 ranks,
one on 1 rank without checkpoints or validations (tests/e2e: trainer.save_every and val_every = -1),
the tiny job's whole default run (tests/e2e: it learns; partial rollouts against it), and the same job
on the mixture-of-experts model (tests/e2e: it learns, exports and resumes; routing replay against it)."""

import os
import subprocess

import pytest

from tests.helpers.cpu_runs import run_cmd, tiny_cmd


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """A finished 2-step, 2-rank run with a checkpoint and a Hugging Face export at the end
    (trainer.export_hf_dir). Returns (run_dir, data_dir, export_dir), data_dir the run's synthetic
    data (<run_dir>/data). Tests must not modify it."""
    base = tmp_path_factory.mktemp("tiny_run")
    run_dir, export_dir = base / "run", base / "hf"
    data_dir = run_dir / "data"
    p = run_cmd(tiny_cmd(run_dir, f"trainer.export_hf_dir={export_dir}"))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return run_dir, data_dir, export_dir


@pytest.fixture(scope="session")
def tiny_run_without_saves_or_validations(tmp_path_factory):
    """A finished 2-step run on 1 rank with trainer.save_every = -1 and trainer.val_every = -1 (no
    checkpoint, no validation, not even after the last step). Returns (run_dir, its stdout + stderr).
    Tests must not modify it."""
    run_dir = tmp_path_factory.mktemp("tiny_run_without_saves_or_validations") / "run"
    p = run_cmd(tiny_cmd(run_dir, "trainer.save_every=-1", "trainer.val_every=-1", "trainer.tensorboard=false",
                         nproc=1))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return run_dir, p.stdout + p.stderr


@pytest.fixture(scope="session")
def tiny_default_run(tmp_path_factory):
    """The tiny job's default run on 2 ranks (configs/tiny-cpu.toml: 80 steps, its checkpoints and
    TensorBoard). Returns (run_dir, its stdout + stderr). Tests must not modify it."""
    from tests.helpers.cpu_runs import run, torchrun_cmd

    run_dir = tmp_path_factory.mktemp("tiny_default_run") / "run"
    return run_dir, run(torchrun_cmd(2, f"trainer.run_dir={run_dir}"))


@pytest.fixture(scope="session")
def moe_default_run(tmp_path_factory):
    """The tiny job's default run on the qwen3-moe-tiny model (8 experts, top-2; routing replay at its
    default, actor.router_replay = "engine"), 2 ranks, 80 steps, its checkpoints and a Hugging Face
    export at the end, no TensorBoard. Returns (run_dir, export_dir). Tests must not modify it (a
    resume goes on in a copy)."""
    from tests.helpers.cpu_runs import run, torchrun_cmd

    base = tmp_path_factory.mktemp("moe_default_run")
    run_dir, export_dir = base / "run", base / "export"
    run(torchrun_cmd(2, f"trainer.run_dir={run_dir}", 'model.arch="qwen3-moe-tiny"', "trainer.tensorboard=false",
                     f"trainer.export_hf_dir={export_dir}"))
    return run_dir, export_dir


@pytest.fixture(scope="module")
def env():
    """GPU tests: one process, a world of one (NCCL default group) on the current GPU, per module."""
    from spmd_rl.runtime.distributed import init_distributed
    from spmd_rl.runtime.lifecycle import destroy_process_group

    env = init_distributed("cuda")
    yield env
    destroy_process_group()  # the ordered teardown of spmd_rl.runtime.lifecycle, as a run's


class SmallFilesystem:
    """A real filesystem of a few MB: a size-limited tmpfs mounted at `path` (mount it, resize it)."""

    def __init__(self, path):
        self.path, self.mounted = str(path), False

    def mount(self, size_bytes: int) -> str:
        os.makedirs(self.path, exist_ok=True)
        p = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", self.path],
                           capture_output=True, text=True)
        if p.returncode != 0:
            pytest.skip(f"cannot mount a size-limited tmpfs here ({(p.stderr or p.stdout).strip()}): the real full-disk "
                        "tests need root with mount rights (CI runs as root); the ENOSPC-injection tests cover the same "
                        "code")
        self.mounted = True
        return self.path

    def resize(self, size_bytes: int) -> None:
        subprocess.run(["mount", "-o", f"remount,size={size_bytes}", self.path], check=True)

    def unmount(self) -> None:
        if self.mounted:
            subprocess.run(["umount", "-l", self.path], check=False)
            self.mounted = False


@pytest.fixture
def small_filesystem(tmp_path):
    """SmallFilesystem at tmp_path/fs, unmounted after the test; a test that mounts it skips where
    mounting is refused (not root)."""
    fs = SmallFilesystem(tmp_path / "fs")
    yield fs
    fs.unmount()
