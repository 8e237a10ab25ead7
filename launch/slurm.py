"""Submit a training run to SLURM through submitit.

    python -m launch.slurm --config configs/X.toml --nodes 2 --gpus-per-node 8 \
        [--partition P] [--time 1440] [--mode per-gpu|torchrun] [section.key=value ...]

    # CPU-only (no GPUs requested; e.g. the test cluster):
    python -m launch.slurm --config configs/tiny-cpu.toml --gpus-per-node 0 --tasks-per-node 2

The config is loaded and validated for the job's layout *before* submitting, so a bad config fails
here and not after hours in the queue. Prints the job id, the log folder and the per-rank logs.
Every task runs the same trainer code path as torchrun (launch/task.py); timeouts and preemption
requeue the job, which resumes from its last checkpoint (docs/multinode.md).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from launch.task import MODES, TrainerTask

REPO_ROOT = Path(__file__).resolve().parent.parent


class LaunchError(ValueError):
    """A launch request that cannot work, with what to change."""


@dataclass
class LaunchSpec:
    """One SLURM job of the trainer. Times in minutes, memory in GB."""

    config: str
    overrides: list[str] = field(default_factory=list)
    nodes: int = 1
    gpus_per_node: int = 8
    """GPUs requested per node; 0 = a CPU job (no GPU gres), then set tasks_per_node."""
    tasks_per_node: int | None = None
    """per-gpu mode: ranks per node (default: gpus_per_node). torchrun mode: always 1."""
    nproc_per_node: int | None = None
    """torchrun mode: ranks per node (default: gpus_per_node)."""
    mode: str = "per-gpu"
    cpus_per_task: int | None = None
    mem_gb: float | None = None
    time_min: int = 24 * 60
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    job_name: str = "spmd_rl"
    folder: str = "logs/slurm/%j"
    """submitit's folder (%j = job id): its scripts, pickles and the per-task logs."""
    signal_delay_s: int = 120
    """How long before the time limit SLURM sends SIGUSR2; must cover one step plus a checkpoint."""
    max_requeues: int = 3
    """Most requeues after time-outs. submitit counts a stop as a time-out once the job has run
    80% of its time limit (or is within 10 minutes of it); earlier stops are preemptions, unlimited."""
    master_port: int | None = None
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment for the tasks (NCCL_*, ...); the submitting shell's environment is
    passed on as well, as sbatch does by default."""

    @property
    def ranks_per_node(self) -> int:
        if self.mode == "torchrun":
            return self.nproc_per_node or self.gpus_per_node
        return self.tasks_per_node or self.gpus_per_node

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    def argv(self) -> list[str]:
        return ["--config", str(Path(self.config).resolve()), *self.overrides]


def check(spec: LaunchSpec) -> None:
    """Refuse layouts and configs that cannot work, before anything is queued."""
    from spmd_rl import preflight
    from spmd_rl.config.run_config import load_config

    if spec.mode not in MODES:
        raise LaunchError(f"--mode {spec.mode!r} is not one of {', '.join(MODES)}")
    if spec.nodes < 1:
        raise LaunchError(f"--nodes must be >= 1, got {spec.nodes}")
    if spec.gpus_per_node < 0:
        raise LaunchError(f"--gpus-per-node must be >= 0, got {spec.gpus_per_node}")
    if spec.ranks_per_node < 1:
        flag = "--nproc-per-node" if spec.mode == "torchrun" else "--tasks-per-node"
        raise LaunchError(f"a CPU job (--gpus-per-node 0) needs the ranks per node: pass {flag} N")
    if spec.gpus_per_node and spec.ranks_per_node != spec.gpus_per_node:
        raise LaunchError(f"{spec.ranks_per_node} ranks per node with --gpus-per-node {spec.gpus_per_node}: "
                          "the trainer runs one rank per GPU, so leave --tasks-per-node/--nproc-per-node unset")
    # Same check the trainer makes at start-up, with the same numbers: a tensor-parallel group
    # must not span nodes, batches must divide by the ranks, files must exist...
    cfg = load_config(spec.config, spec.overrides)
    preflight.validate(cfg, world_size=spec.world_size, gpus_per_node=spec.ranks_per_node)
    if spec.gpus_per_node == 0 and cfg.trainer.device == "cuda":
        raise LaunchError("trainer.device = 'cuda' but the job requests no GPUs: pass --gpus-per-node N "
                          "or set trainer.device=cpu")


def executor_parameters(spec: LaunchSpec) -> dict:
    """submitit.SlurmExecutor parameters (sbatch options) for the spec."""
    params: dict = {
        "job_name": spec.job_name,
        "time": spec.time_min,
        "nodes": spec.nodes,
        "ntasks_per_node": 1 if spec.mode == "torchrun" else spec.ranks_per_node,
        "signal_delay_s": spec.signal_delay_s,
        # The job must import launch/ and spmd_rl/ even when the package is not installed.
        "setup": [f"export PYTHONPATH={shlex.quote(str(REPO_ROOT))}${{PYTHONPATH:+:$PYTHONPATH}}"],
    }
    if spec.gpus_per_node:
        params["gpus_per_node"] = spec.gpus_per_node
    if spec.cpus_per_task:
        params["cpus_per_task"] = spec.cpus_per_task
    if spec.mem_gb:
        params["mem"] = f"{int(spec.mem_gb * 1024)}M"
    for key in ("partition", "account", "qos", "constraint"):
        if getattr(spec, key):
            params[key] = getattr(spec, key)
    return params


def submit(spec: LaunchSpec):
    """Check the spec, submit the job and return the submitit Job (job.job_id, job.paths...)."""
    import submitit

    check(spec)
    executor = submitit.SlurmExecutor(folder=spec.folder, max_num_timeout=spec.max_requeues)
    executor.update_parameters(**executor_parameters(spec))
    task = TrainerTask(argv=spec.argv(), mode=spec.mode, nproc_per_node=spec.ranks_per_node,
                       master_port=spec.master_port, extra_env=dict(spec.env))
    return executor.submit(task)


def log_paths(job) -> list[Path]:
    """The stdout files of every task (stderr sits next to each, *_log.err)."""
    subs = getattr(job, "_sub_jobs", None) or [job]
    return [sub.paths.stdout for sub in subs]


# --------------------------------------------------------------------------- CLI


def parse_args(argv: list[str] | None = None) -> LaunchSpec:
    p = argparse.ArgumentParser(
        prog="python -m launch.slurm", description=__doc__.split("\n\n")[0],
        epilog="Remaining arguments are config overrides (section.key=value), passed to the trainer.")
    p.add_argument("--config", required=True, help="TOML config of the run")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=8, help="0 = CPU job (then give --tasks-per-node)")
    p.add_argument("--tasks-per-node", type=int, default=None, help="ranks per node in per-gpu mode (CPU jobs)")
    p.add_argument("--nproc-per-node", type=int, default=None, help="ranks per node in torchrun mode (CPU jobs)")
    p.add_argument("--mode", choices=MODES, default="per-gpu",
                   help="per-gpu: one SLURM task per rank (default); torchrun: one task per node running torchrun")
    p.add_argument("--cpus-per-task", type=int, default=None)
    p.add_argument("--mem-gb", type=float, default=None, help="memory per node")
    p.add_argument("--time", type=int, default=24 * 60, dest="time_min", help="time limit in minutes")
    p.add_argument("--partition")
    p.add_argument("--account")
    p.add_argument("--qos")
    p.add_argument("--constraint")
    p.add_argument("--job-name", default="spmd_rl")
    p.add_argument("--folder", default="logs/slurm/%j", help="job folder for scripts and logs (%%j = job id)")
    p.add_argument("--signal-delay-s", type=int, default=120,
                   help="SIGUSR2 this long before the time limit (time for one step + checkpoint)")
    p.add_argument("--max-requeues", type=int, default=3, help="requeues after time-outs")
    p.add_argument("--master-port", type=int, default=None, help="fixed rendezvous port (default: from the job id)")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="extra environment for the tasks (repeatable), e.g. --env NCCL_IB_HCA=mlx5")
    args, overrides = p.parse_known_args(argv)
    unknown = [o for o in overrides if o.startswith("--") or "=" not in o]
    if unknown:
        p.error(f"unrecognized arguments: {' '.join(unknown)} (config overrides look like section.key=value)")
    env = {}
    for item in args.env:
        if "=" not in item:
            p.error(f"--env {item!r} must look like NAME=VALUE")
        k, v = item.split("=", 1)
        env[k] = v
    fields = {k: v for k, v in vars(args).items() if k != "env"}
    return LaunchSpec(overrides=overrides, env=env, **fields)


def main(argv: list[str] | None = None) -> int:
    from submitit.core.utils import FailedJobError

    from spmd_rl.errors import ConfigError

    spec = parse_args(argv)
    try:
        job = submit(spec)
    except (ConfigError, LaunchError) as e:
        print(f"launch.slurm: not submitted: {e}", file=sys.stderr)
        return 2
    except FailedJobError as e:  # sbatch refused the job: its own message says why
        print(f"launch.slurm: sbatch refused the job:\n{str(e).strip()}", file=sys.stderr)
        return 1
    folder = Path(str(spec.folder).replace("%j", str(job.job_id))).resolve()
    print(f"submitted job {job.job_id}: {spec.nodes} node(s) x {spec.ranks_per_node} rank(s), mode {spec.mode}")
    print(f"job folder: {folder}")
    paths = log_paths(job)
    for rank, path in enumerate(paths[:16]):
        print(f"  task {rank} log: {path}")
    if len(paths) > 16:
        print(f"  ... {len(paths) - 16} more: {folder}/{job.job_id}_<task>_log.out")
    print(f"follow: tail -f {paths[0]}   cancel: scancel {job.job_id}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
