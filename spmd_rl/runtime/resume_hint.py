"""What a run that stopped before its end tells the user: its latest checkpoint and how to resume.

A run that stopped on a signal (Ctrl-C included), without its last checkpoint, or crashed ends
with two lines on rank 0 (spmd_rl/ppo.py; under the `spmd-rl` launcher, the launcher prints them
last):

    latest checkpoint: runs/tiny-cpu/checkpoints/step_20
    resume with: spmd-rl --nproc_per_node=2 --config tiny-cpu

The command is the one that started the run (LAUNCH_COMMAND_ENV, which the launcher sets; else
rebuilt from this process's arguments and torchrun's environment) less any `trainer.resume=`
override: the default, "auto", continues from the latest complete checkpoint.
"""

from __future__ import annotations

import os
import shlex

LAUNCH_COMMAND_ENV = "SPMD_RL_LAUNCH_COMMAND"
"""The command line that started the run, as the `spmd-rl` launcher was called (shell-quoted)."""

TRAINER_MODULE = "spmd_rl.ppo"


def launch_command(trainer_args: list[str]) -> list[str]:
    """The command that started this run; `trainer_args`: the trainer's own arguments."""
    if os.environ.get(LAUNCH_COMMAND_ENV):
        return shlex.split(os.environ[LAUNCH_COMMAND_ENV])
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return ["python", "-m", TRAINER_MODULE, *trainer_args]
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    nodes = int(os.environ.get("WORLD_SIZE", str(per_node))) // per_node
    return ["torchrun", *([f"--nnodes={nodes}"] if nodes > 1 else []), f"--nproc_per_node={per_node}",
            "-m", TRAINER_MODULE, *trainer_args]


def resume_command(command: list[str]) -> str:
    """`command` without its `trainer.resume=` overrides, shell-quoted, ready to paste."""
    return shlex.join([a for a in command if not a.startswith("trainer.resume=")])


def resume_lines(latest_checkpoint: str | None, trainer_args: list[str]) -> list[str]:
    """The two closing lines of a stopped run."""
    command = resume_command(launch_command(trainer_args))
    if latest_checkpoint is None:
        return ["latest checkpoint: none yet", f"start again with: {command}"]
    return [f"latest checkpoint: {latest_checkpoint}", f"resume with: {command}"]
