"""The SLURM launcher against a real one-node SLURM on localhost (tests/slurm/start_cluster.sh).

Needs Debian's slurmctld/slurmd/munge (tests/slurm/install.sh) and root. Each job is the real
trainer on configs/tiny-cpu.toml with 2 CPU ranks; its first ~30 s are start-up (imports, model,
synthetic data). Every wait is bounded; a job left behind by a failing test is cancelled.

Preemption is exercised the two ways SLURM ends a job early:
* the time-limit warning: `scancel --signal=USR2`, exactly what SLURM sends `--signal=USR2@delay`
  seconds before the time limit (and what submitit's own `job._interrupt(timeout=True)` sends);
* a real preemption: a job in the higher-priority partition `urgent` needs the node, SLURM sends
  SIGTERM (PreemptMode=REQUEUE, GraceTime=60).
Both must end with: checkpoint on the signal, requeue, resume, and every step logged exactly once.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from launch.jobs import FINAL_STATES, job_info, wait_finished, wait_for
from launch.slurm import LaunchSpec, executor_parameters, parse_args, submit
from launch.slurm import main as launch_main
from launch.task import node_exit_status, rendezvous_port
from tests.helpers import ROOT

REPO = Path(ROOT)
SCRIPTS = REPO / "tests" / "slurm"
CONFIG = str(REPO / "configs" / "tiny-cpu.toml")
# Bounds of the waits. On 2 idle cores a job's first checkpoint comes after 15-30 s, and a job
# ends 20-70 s after it started or was signalled (requeue included).
CKPT_TIMEOUT_S = 150
JOB_TIMEOUT_S = 180


# --------------------------------------------------------------------------- no cluster needed


def test_cli_parses_layout_and_overrides():
    spec = parse_args(["--config", CONFIG, "--nodes", "2", "--gpus-per-node", "8", "--partition", "gpu",
                       "--env", "NCCL_IB_HCA=mlx5", "trainer.total_steps=3", "actor.lr=1e-6"])
    assert (spec.nodes, spec.ranks_per_node, spec.world_size) == (2, 8, 16)
    assert spec.overrides == ["trainer.total_steps=3", "actor.lr=1e-6"]
    assert spec.env == {"NCCL_IB_HCA": "mlx5"}
    params = executor_parameters(spec)
    assert params["ntasks_per_node"] == 8 and params["gpus_per_node"] == 8 and params["partition"] == "gpu"
    torchrun = parse_args(["--config", CONFIG, "--nodes", "2", "--mode", "torchrun"])
    assert executor_parameters(torchrun)["ntasks_per_node"] == 1 and torchrun.world_size == 16
    with pytest.raises(SystemExit):
        parse_args(["--config", CONFIG, "--nodse", "2"])  # a typo must not become an override


def test_rendezvous_port_is_shared_by_all_tasks_and_changes_on_requeue():
    assert rendezvous_port("1234", 0) == rendezvous_port("1234", 0)
    assert rendezvous_port("1234", 0) != rendezvous_port("1234", 1)
    assert all(20000 <= rendezvous_port(str(j), r) < 32000 for j in range(200) for r in range(3))


@pytest.mark.parametrize("torchrun_rc, ranks, stopped, status", [
    (0, {0: 0, 1: 0}, False, 0),
    (1, {0: 3, 1: 3}, True, 3),     # preempted, checkpoint written: requeue
    (1, {0: 4, 1: 4}, True, 4),     # stopped, but the checkpoint was not written: no requeue
    (1, {0: 3, 1: 4}, True, 4),
    (1, {0: 3}, True, 3),           # rank 1 killed before it recorded anything
    (1, {}, True, 3),               # torchrun itself exited on the signal
    (1, {}, False, 1),
    (1, {0: 2, 1: 2}, False, 2),    # a user error
    (1, {0: 1, 1: 3}, True, 1),     # a rank crashed
])
def test_torchrun_node_status_is_its_ranks_own(torchrun_rc, ranks, stopped, status):
    """torchrun exits 1 for any failing rank; the task decides from what its ranks recorded."""
    assert node_exit_status(torchrun_rc, ranks, stopped) == status


def test_layout_splitting_a_tensor_parallel_group_across_nodes_is_refused_before_submitting(capsys, tmp_path):
    # 2 nodes x 2 GPUs with TP=4: every TP group would span two nodes.
    rc = launch_main(["--config", CONFIG, "--nodes", "2", "--gpus-per-node", "2", "--folder", str(tmp_path / "%j"),
                      "rollout.engine=vllm", "rollout.tensor_parallel_size=4", "trainer.device=cuda",
                      "actor.micro_batch_size_per_gpu=1"])  # only the TP layout is wrong
    err = capsys.readouterr().err
    assert rc == 2
    assert "not submitted" in err and "tensor_parallel_size = 4" in err and "span two nodes" in err
    assert not any(tmp_path.iterdir()), "nothing may be written or queued for a refused config"


def test_cpu_job_needs_ranks_per_node(capsys):
    assert launch_main(["--config", CONFIG, "--gpus-per-node", "0"]) == 2
    assert "--tasks-per-node" in capsys.readouterr().err


# --------------------------------------------------------------------------- the cluster


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A running one-node cluster; SLURM_CONF points the client commands at it."""
    missing = [c for c in ("sbatch", "slurmctld", "slurmd", "munged") if shutil.which(c) is None]
    if missing:
        pytest.skip(f"SLURM is not installed (no {', '.join(missing)}): run tests/slurm/install.sh as root")
    state = os.environ.get("SPMD_RL_SLURM_DIR", "/tmp/spmd_rl_slurm")
    env = dict(os.environ, SPMD_RL_SLURM_DIR=state)
    out = subprocess.run([str(SCRIPTS / "start_cluster.sh")], env=env, capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        pytest.fail(f"tests/slurm/start_cluster.sh failed:\n{out.stdout}{out.stderr}", pytrace=False)
    already_up = "already up" in out.stdout  # a cluster someone started by hand stays up
    old_conf = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = os.path.join(state, "slurm.conf")
    yield state
    if not already_up:
        subprocess.run([str(SCRIPTS / "stop_cluster.sh")], env=env, capture_output=True, timeout=120)
    if old_conf is None:
        os.environ.pop("SLURM_CONF", None)
    else:
        os.environ["SLURM_CONF"] = old_conf


@pytest.fixture
def launch(slurm_cluster, tmp_path):
    """launch(steps, *overrides, **spec) submits the tiny config as a 2-rank CPU job into tmp_path;
    jobs still in the queue when the test ends are cancelled."""
    jobs = []

    def _launch(steps: int, *overrides: str, **spec_fields):
        run = tmp_path / "run"
        fields = dict(gpus_per_node=0, tasks_per_node=2, time_min=10, folder=str(tmp_path / "slurm" / "%j"))
        fields.update(spec_fields)
        spec = LaunchSpec(config=CONFIG, overrides=[
            f"trainer.run_dir={run}", f"trainer.total_steps={steps}", "trainer.val_every=0",
            f'data.train_files=["{run}/data/train.parquet"]', "data.val_files=[]",  # no validation: faster
            *overrides], **fields)
        job = submit(spec)
        jobs.append(job)
        return job, run

    yield _launch
    for job in jobs:
        if job_info(job.job_id).get("JobState", "COMPLETED") not in FINAL_STATES:
            subprocess.run(["scancel", str(job.job_id)], timeout=30)


def metric_steps(run: Path) -> list[int]:
    """Steps of the training-step rows (a checkpoint's `time/checkpoint` row or a validation row
    may share a step number; they are not steps)."""
    with open(run / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r["step"] for r in rows if "time/step" in r]


def wait_for_file(path: Path, job_id: str, timeout_s: float) -> None:
    """Wait until `path` exists while the job is still alive."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        state = job_info(job_id).get("JobState")
        assert state not in FINAL_STATES, f"job {job_id} is {state} before {path} appeared"
        assert time.monotonic() < deadline, f"{path} did not appear within {timeout_s:.0f}s (job {job_id}: {state})"
        time.sleep(0.2)


def task_logs(job) -> str:
    subs = job._sub_jobs or [job]
    return "".join(p.read_text() for sub in subs for p in (sub.paths.stdout, sub.paths.stderr) if p.exists())


def task_results(job) -> list:
    """What each task returned, from submitit's result files. Checked for existence first:
    submitit's own job.results() would wait for them forever."""
    subs = job._sub_jobs or [job]
    missing = [str(sub.paths.result_pickle) for sub in subs if not sub.paths.result_pickle.exists()]
    assert not missing, f"no submitit result file: {missing}"
    return [sub.result() for sub in subs]


def assert_completed(job, info: dict[str, str], restarts: int, tasks: int = 2) -> None:
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, task_logs(job)[-3000:])
    assert info["Restarts"] == str(restarts), info
    assert task_results(job) == [0] * tasks, "every task returns the trainer's 0"


@pytest.mark.slurm
def test_two_rank_cpu_job_finishes_with_metrics(launch):
    job, run = launch(4)
    info = wait_finished(job.job_id, JOB_TIMEOUT_S)
    assert_completed(job, info, restarts=0)
    assert metric_steps(run) == [1, 2, 3, 4]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if "time/step" in r][-1]
    assert last["step"] == 4 and "reward/mean" in last
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_4"
    # one log per rank, each from its own rank
    for rank, sub in enumerate(job._sub_jobs):
        assert f"global_rank={rank}(2)" in sub.paths.stderr.read_text() + sub.paths.stdout.read_text()


def assert_resumed_exactly_once(run: Path, total: int) -> int:
    """The run stopped on the signal with a checkpoint at step S, resumed from it, and logged every
    step 1..total exactly once. Returns S."""
    log = (run / "trainer.log").read_text()
    stopped = re.findall(r"checkpointing at step (\d+)", log)
    resumed = re.findall(r"resumed from \S*step_(\d+)", log)
    assert len(stopped) == 1 and resumed == stopped, f"stop/resume lines: {stopped} {resumed}\n{log[-3000:]}"
    assert metric_steps(run) == list(range(1, total + 1)), "a step was lost or logged twice across the requeue"
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step_{total}"
    return int(stopped[0])


@pytest.mark.slurm
def test_time_limit_signal_checkpoints_requeues_and_resumes(launch):
    total = 40
    job, run = launch(total, "trainer.save_every=3")
    wait_for_file(run / "checkpoints" / "step_3", job.job_id, CKPT_TIMEOUT_S)
    subprocess.run(["scancel", "--signal=USR2", str(job.job_id)], check=True, timeout=30)
    wait_for(job.job_id, lambda i: int(i.get("Restarts", 0)) >= 1, 60, "a requeue")
    info = wait_finished(job.job_id, JOB_TIMEOUT_S)
    assert_completed(job, info, restarts=1)
    step = assert_resumed_exactly_once(run, total)
    assert 3 <= step < total
    assert "stopped on SIGUSR2 (time-limit warning or preemption notice) after a checkpoint" in task_logs(job)


def preempt_with_urgent_job(tmp_path: Path) -> str:
    """Submit a job that needs the whole node to the partition with the higher PriorityTier:
    SLURM preempts whatever holds the node (SIGTERM, GraceTime=60, PreemptMode=REQUEUE)."""
    return subprocess.run(["sbatch", "--parsable", "--partition=urgent", "--exclusive", "--time=2",
                           f"--output={tmp_path}/urgent.out", "--wrap=sleep 1"],
                          check=True, capture_output=True, text=True, timeout=30).stdout.strip()


@pytest.mark.slurm
def test_preemption_by_higher_priority_job_checkpoints_requeues_and_resumes(launch, tmp_path):
    total = 40
    job, run = launch(total, "trainer.save_every=3")
    wait_for_file(run / "checkpoints" / "step_3", job.job_id, CKPT_TIMEOUT_S)
    urgent = preempt_with_urgent_job(tmp_path)
    info = wait_finished(job.job_id, JOB_TIMEOUT_S)
    assert_completed(job, info, restarts=1)
    assert wait_finished(urgent, 30)["JobState"] == "COMPLETED"
    step = assert_resumed_exactly_once(run, total)
    assert 3 <= step < total
    assert re.search(r"stopped on SIGTERM \(preempted at \S+\) after a checkpoint", task_logs(job))


@pytest.mark.slurm
def test_torchrun_mode_is_preempted_requeued_and_resumes(launch, tmp_path):
    """One task per node running torchrun: torchrun passes the SIGTERM on and waits while its
    workers checkpoint; the task still requeues the job."""
    total = 40
    job, run = launch(total, "trainer.save_every=3", mode="torchrun", tasks_per_node=None, nproc_per_node=2)
    wait_for_file(run / "checkpoints" / "step_3", job.job_id, CKPT_TIMEOUT_S)
    preempt_with_urgent_job(tmp_path)
    assert_completed(job, wait_finished(job.job_id, JOB_TIMEOUT_S), restarts=1, tasks=1)
    assert_resumed_exactly_once(run, total)
    # torchrun's per-rank logs of both runs sit in the job folder
    folder = Path(job.paths.folder) / f"{job.job_id}_torchrun"
    for restart in (0, 1):
        assert len(list(folder.glob(f"restart{restart}/node0/**/stderr.log"))) == 2, list(folder.rglob("*"))


@pytest.mark.slurm
def test_torchrun_mode_stopped_without_its_checkpoint_is_not_requeued(launch, tmp_path):
    """torchrun mode, preempted after step 3's checkpoint, and every save from step 4 on fails
    (SPMD_RL_CHECKPOINT_FAULT=fail@4+): the ranks stop and exit 4 (EXIT_NOT_SAVED), torchrun 1. The
    task reads its ranks' own statuses and ends the job without a requeue (it would only repeat the
    failure); step_3 stays the latest checkpoint."""
    job, run = launch(40, "trainer.save_every=3", mode="torchrun", tasks_per_node=None, nproc_per_node=2,
                      env={"SPMD_RL_CHECKPOINT_FAULT": "fail@4+"})
    wait_for_file(run / "checkpoints" / "step_3", job.job_id, CKPT_TIMEOUT_S)
    preempt_with_urgent_job(tmp_path)
    info = wait_finished(job.job_id, JOB_TIMEOUT_S)
    logs = task_logs(job)
    assert info["JobState"] == "FAILED" and info["Restarts"] == "0", (info, logs[-3000:])
    assert "trainer exited with status 4" in logs and "requeueing" not in logs, logs[-3000:]
    assert re.search(r"stopped on a stop signal at step \d+ without its checkpoint", (run / "trainer.log").read_text())
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_3"
