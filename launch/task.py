"""What runs inside each SLURM task: rendezvous environment, the trainer, and the requeue.

submitit starts `python -m submitit.core._submit <folder>` once per SLURM task (through srun); that
process unpickles a `TrainerTask` and calls it. Two layouts:

* ``per-gpu`` (default): one task per GPU. The task sets torch.distributed's env:// variables
  (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) from SLURM's and calls
  the trainer's `main(argv)` in-process -- the same code path as under torchrun.
* ``torchrun``: one task per node, which runs torchrun with a c10d rendezvous on the first node;
  torchrun passes stop signals on to its workers and waits for their checkpoint.

Preemption (see spmd_rl/runtime/preemption.py and docs/multinode.md): submitit installs a SIGUSR2 handler
that checkpoints and requeues *immediately*. That would kill a half-done step, so the task installs
`StopFlag` over it first. The trainer then stops after the step, writes its checkpoint and returns
EXIT_PREEMPTED; only then does the first task hand over to submitit's handler, which dumps
`self.checkpoint()` and runs `scontrol requeue` -- on SIGUSR1/2, and on a SIGTERM of a preemption
(see `requeue_reason`). The requeued job reruns the same task with `trainer.resume=auto` and
continues from the checkpoint. A job that finished all steps returns normally and is never
requeued, whatever signal arrived late.
"""

from __future__ import annotations

import importlib
import logging
import os
import signal
import subprocess
import sys
import zlib
from dataclasses import dataclass, field, replace
from typing import NoReturn

import submitit
from submitit.core.job_environment import JobEnvironment

from spmd_rl.exit_codes import EXIT_PREEMPTED
from spmd_rl.launcher import graceful_stop_options, node_exit_status, torchrun_supports_graceful_stop
from spmd_rl.runtime.preemption import EXIT_STATUS_DIR_ENV, StopFlag, recorded_exit_statuses
from spmd_rl.runtime.resume_hint import TRAINER_MODULE

log = logging.getLogger("launch")

MODES = ("per-gpu", "torchrun")
PORT_BASE, PORT_SPAN = 20000, 12000  # below Linux's ephemeral range (32768+), so no client socket holds it


def rendezvous_port(job_id: str, restart_count: int) -> int:
    """A port every task of the job derives alike. The restart count is part of it so a requeued
    job, often back on the same node, never meets the listening socket of its previous run."""
    return PORT_BASE + zlib.crc32(f"{job_id}:{restart_count}".encode()) % PORT_SPAN


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks of this job meet, from the SLURM job environment."""

    master_addr: str
    master_port: int
    job_id: str
    restart: int
    """SLURM_RESTART_COUNT: how often the job was requeued before this run."""

    @property
    def run_id(self) -> str:
        return f"{self.job_id}-{self.restart}"

    @classmethod
    def from_slurm(cls, env: JobEnvironment, port: int | None = None) -> Rendezvous:
        restart = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
        return cls(
            master_addr=env.hostnames[0],  # submitit expands SLURM_JOB_NODELIST (node[01-04] -> node01, ...)
            master_port=port or rendezvous_port(env.job_id, restart),
            job_id=env.job_id,
            restart=restart,
        )


def rank_env(env: JobEnvironment, rdzv: Rendezvous) -> dict[str, str]:
    """torch.distributed env:// variables for one task = one rank, as torchrun would set them."""
    per_node = env.num_tasks // env.num_nodes
    return {
        "RANK": str(env.global_rank),
        "WORLD_SIZE": str(env.num_tasks),
        "LOCAL_RANK": str(env.local_rank),
        "LOCAL_WORLD_SIZE": str(per_node),
        "GROUP_RANK": str(env.node),
        "MASTER_ADDR": rdzv.master_addr,
        "MASTER_PORT": str(rdzv.master_port),
    }


def torchrun_command(env: JobEnvironment, rdzv: Rendezvous, nproc_per_node: int, module: str,
                     argv: list[str], log_dir: str, graceful_stop: bool = True) -> list[str]:
    """The torchrun command line of one node (this task)."""
    graceful = graceful_stop_options()
    return [
        sys.executable, "-m", "torch.distributed.run",
        f"--nnodes={env.num_nodes}",
        f"--node-rank={env.node}",
        f"--nproc-per-node={nproc_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={rdzv.master_addr}:{rdzv.master_port}",
        f"--rdzv-id={rdzv.run_id}",
        "--max-restarts=0",
        *(graceful if graceful_stop else []),
        f"--log-dir={log_dir}",
        "--redirects=3", "--tee=3",  # per-rank files under log_dir, and a copy on the task's log
        "-m", module, *argv,
    ]


@dataclass
class TrainerTask(submitit.helpers.Checkpointable):
    """The callable submitit runs in every task; `checkpoint()` makes the job requeueable."""

    argv: list[str]
    """Trainer arguments: ["--config", path, "section.key=value", ...]."""
    mode: str = "per-gpu"
    nproc_per_node: int = 1
    """torchrun mode: ranks (GPUs) per node."""
    master_port: int | None = None
    """Fixed rendezvous port; None = derived from the job id (rendezvous_port)."""
    extra_env: dict[str, str] = field(default_factory=dict)

    def __call__(self) -> int:
        # First thing: take the stop signals over from submitit (its SIGUSR2 handler is kept and
        # called once the trainer has checkpointed).
        stop = StopFlag.install()
        _setup_logging()
        env = submitit.JobEnvironment()
        rdzv = Rendezvous.from_slurm(env, self.master_port)
        os.environ.update(self.extra_env)
        log.info("%s: %s, rendezvous %s:%d, restart %d", self.mode, env, rdzv.master_addr, rdzv.master_port,
                 rdzv.restart)
        if self.mode == "per-gpu":
            os.environ.update(rank_env(env, rdzv))
            rc = self._run_in_process()
            leader = env.global_rank == 0
        elif self.mode == "torchrun":
            status_dir = self._torchrun_dir(env, rdzv) + "_exit_status"
            rc = self._run_torchrun(env, rdzv, status_dir)
            rc = node_exit_status(rc, recorded_exit_statuses(status_dir), stop.local())
            leader = env.node == 0
        else:
            raise ValueError(f"mode {self.mode!r} is not one of {MODES}")

        if rc == 0:
            log.info("trainer finished all steps")
            return 0
        if rc != EXIT_PREEMPTED:
            raise RuntimeError(f"trainer exited with status {rc}: see this task's log and the run's trainer.log")
        self._after_preemption(stop, leader)

    def _run_in_process(self) -> int:
        trainer = importlib.import_module(TRAINER_MODULE)
        return int(trainer.main(list(self.argv)))

    @staticmethod
    def _torchrun_dir(env: JobEnvironment, rdzv: Rendezvous) -> str:
        return os.path.join(str(env.paths.folder), f"{env.job_id}_torchrun", f"restart{rdzv.restart}", f"node{env.node}")

    def _run_torchrun(self, env: JobEnvironment, rdzv: Rendezvous, status_dir: str) -> int:
        """torchrun's exit status; its ranks write their own into `status_dir`."""
        log_dir = self._torchrun_dir(env, rdzv)
        graceful = torchrun_supports_graceful_stop()
        if not graceful:
            log.warning("this torchrun has no --signals-to-handle/--shutdown-timeout: it kills its workers 30 s "
                        "after SIGTERM, and SIGUSR1/2 stop torchrun itself; upgrade torch for clean preemption")
        cmd = torchrun_command(env, rdzv, self.nproc_per_node, TRAINER_MODULE, self.argv, log_dir, graceful)
        log.info("running %s", " ".join(cmd))
        return subprocess.run(cmd, env={**os.environ, EXIT_STATUS_DIR_ENV: status_dir}).returncode

    def _after_preemption(self, stop: StopFlag, leader: bool) -> NoReturn:
        """The trainer stopped on a signal and its checkpoint is complete: requeue, or just exit.

        Always ends in SystemExit, never a return: a return would write submitit's result file
        and mark the job finished."""
        names = ", ".join(sorted(s.name for s in stop.signals)) or "no signal"
        if not leader:
            # Status 0, so a cluster with KillOnBadExit does not kill the first task before it
            # has requeued the job.
            log.info("stopped on %s after a checkpoint; the first task decides about the requeue", names)
            sys.exit(0)
        reason = requeue_reason(stop)
        if reason is None:
            log.info("stopped on %s after a checkpoint; not requeueing: neither a time-limit warning nor a "
                     "preemption (scancel or the hard time limit)", names)
            sys.exit(EXIT_PREEMPTED)
        handler = stop.previous_handler(JobEnvironment._usr_sig())
        if not callable(handler):
            log.warning("stopped on %s (%s), but submitit's requeue handler is not installed: not requeued; "
                        "resubmit with the same trainer.run_dir to continue", names, reason)
            sys.exit(EXIT_PREEMPTED)
        log.info("stopped on %s (%s) after a checkpoint: requeueing through submitit", names, reason)
        try:
            # submitit's checkpoint_and_try_requeue: dumps self.checkpoint() as the job's pickle,
            # runs `scontrol requeue`, then sys.exit(-1); raises if out of requeues.
            handler(JobEnvironment._usr_sig(), None)
        except subprocess.CalledProcessError as e:
            log.error("scontrol requeue failed (%s): the job ends here; resubmit with the same trainer.run_dir "
                      "to continue from the checkpoint", e)
        sys.exit(EXIT_PREEMPTED)

    def checkpoint(self, *args, **kwargs) -> submitit.helpers.DelayedSubmission:
        """Called by submitit before a requeue: rerun the same task, resuming from the checkpoint
        (an explicit trainer.resume of the first run must not apply to the second)."""
        argv = [a for a in self.argv if not a.startswith("trainer.resume=")] + ["trainer.resume=auto"]
        return submitit.helpers.DelayedSubmission(replace(self, argv=argv), *args, **kwargs)


def requeue_reason(stop: StopFlag) -> str | None:
    """Why the job should go back to the queue after stopping on `stop`'s signals, or None.

    * SIGUSR1/SIGUSR2: the `--signal` warning before the time limit, or SLURM's preemption notice
      (PreemptParameters=send_user_signal).
    * SIGTERM of a preemption: SLURM requeues a preempted job itself (PreemptMode=REQUEUE) only if
      it is still running when GraceTime ends -- a job that checkpointed and exited early would
      just end as FAILED. slurmctld marks such a job with a PreemptTime.
    * any other SIGTERM (scancel, the hard time limit): no requeue; a cancelled job stays cancelled.
    """
    if stop.requeue_requested:
        return "time-limit warning or preemption notice"
    if signal.SIGTERM in stop.signals and os.environ.get("SLURM_JOB_ID"):
        from launch.jobs import job_info

        preempt_time = job_info(os.environ["SLURM_JOB_ID"]).get("PreemptTime", "None")
        if preempt_time not in ("None", "Unknown", ""):
            return f"preempted at {preempt_time}"
    return None


def _setup_logging() -> None:
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                            stream=sys.stderr)
