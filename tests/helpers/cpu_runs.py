"""The tiny CPU job (configs/tiny-cpu.toml) under torchrun, as the tests run it: its commands, running
them from the repository's root with this checkout's package, and reading the run's metrics.jsonl."""

import json
import os
import shutil
import signal
import subprocess
import sys

from tests.helpers import ROOT

TINY = os.path.join(ROOT, "configs", "tiny-cpu.toml")


def tiny_cmd(run_dir, *overrides, nproc=2):
    """torchrun of the tiny CPU preset for `run_dir`, a few steps, its synthetic data under
    `<run_dir>/data`."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            "-m", "spmd_rl.ppo", "--config", TINY,
            f"trainer.run_dir={run_dir}", "trainer.total_steps=2", "trainer.tensorboard=true",
            "data.synthetic_size=256", "data.val_batch_size=64", "trainer.val_every=0", *overrides]


def run_cmd(cmd, timeout=300, **env_vars):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, **env_vars)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def torchrun_cmd(nproc, *overrides):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            "-m", "spmd_rl.ppo", "--config", TINY, *overrides]


def read_metrics(run_dir):
    """step -> metrics, the last record of each step winning (a resumed run re-logs steps)."""
    out = {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            rec = json.loads(line)
            out.setdefault(rec["step"], {}).update(rec)
    return out


def stopped_after(run_dir, copy, step):
    """A copy at `copy` of the finished run `run_dir` as if it had stopped after `step` (a checkpoint
    step): its later checkpoints and the metrics and samples of later steps left out, `latest` naming
    step_<step>. A run that resumes there goes on from `run_dir`'s own checkpoint, without running its
    first `step` steps again."""
    shutil.copytree(run_dir, copy)
    ckpts = os.path.join(copy, "checkpoints")
    for name in os.listdir(ckpts):
        if name.startswith("step_") and int(name.split("_")[1].split(".")[0]) > step:
            shutil.rmtree(os.path.join(ckpts, name))
    with open(os.path.join(ckpts, "latest"), "w") as f:
        f.write(f"step_{step}")
    for name in ("metrics.jsonl", "samples.jsonl"):
        path = os.path.join(copy, name)
        if os.path.exists(path):
            with open(path) as f:
                kept = [line for line in f if json.loads(line)["step"] <= step]
            with open(path, "w") as f:
                f.writelines(kept)


def reward_ends(m, steps, n=10):
    """The mean reward/mean of the first and of the last `n` of `steps` in metrics `m` (read_metrics)."""
    return (sum(m[s]["reward/mean"] for s in steps[:n]) / n, sum(m[s]["reward/mean"] for s in steps[-n:]) / n)


def kill_matching(needle):
    """SIGKILL every process whose command line contains `needle` (torchrun's workers run in
    process groups of their own, so killing the launcher's group is not enough)."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if needle.encode() in f.read():
                    os.kill(int(pid), signal.SIGKILL)
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            pass


def run(cmd, timeout=600):
    """`cmd` to its end; asserts it succeeded and returns its stdout + stderr."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_matching(next(a for a in cmd if a.startswith("trainer.run_dir=")))  # no orphaned workers
        raise
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout + p.stderr
