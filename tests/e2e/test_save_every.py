"""trainer.save_every = -1: no checkpoint, not even after the last step (benchmarks, and the GPU
check's 7B runs, whose ~90 GB checkpoints would fill the device's disk); a stop signal still
writes one before the requeue exit, so a preempted run loses nothing."""

import os
import signal
import subprocess
import time

from spmd_rl.exit_codes import EXIT_PREEMPTED
from tests.helpers import ROOT
from tests.helpers.cpu_runs import tiny_cmd


def test_save_every_minus_one_writes_no_checkpoint_at_the_end(tiny_run_without_saves_or_validations):
    """conftest's run with trainer.save_every = -1 (and val_every = -1, which tests/e2e/test_val_every.py reads)."""
    run_dir, out = tiny_run_without_saves_or_validations
    assert "step 2/2" in out
    ckpts = run_dir / "checkpoints"
    assert not (ckpts.is_dir() and os.listdir(ckpts)), os.listdir(ckpts)


def test_save_every_minus_one_still_checkpoints_on_a_stop_signal(tmp_path):
    run_dir = tmp_path / "run"
    cmd = tiny_cmd(run_dir, "trainer.save_every=-1", "trainer.tensorboard=false",
                   "trainer.total_steps=100000", nproc=1)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        metrics = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 240
        while proc.poll() is None and time.monotonic() < deadline and not (
                metrics.exists() and metrics.read_text().count("\n") >= 2):
            time.sleep(0.1)
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        ranks = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        assert ranks, "no rank process under torchrun"
        for pid in ranks:  # what SLURM sends the job's tasks before it ends (--signal=USR1@...)
            os.kill(int(pid), signal.SIGUSR1)
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0 and "stop signal received: checkpointing" in out, out[-3000:]
    assert f"exit code {EXIT_PREEMPTED}" in out or f"exitcode: {EXIT_PREEMPTED}" in out, out[-3000:]
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    assert latest.startswith("step_") and int(latest[5:]) >= 2, latest
