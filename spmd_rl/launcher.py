"""`spmd-rl`: torchrun for the trainer, ending the way a single process does.

    spmd-rl --nproc_per_node=2 --config tiny-cpu actor.lr=1e-3

runs `torchrun --nproc_per_node=2 -m spmd_rl.ppo --config tiny-cpu actor.lr=1e-3` in this process
(torch.distributed.run): torchrun's options first, then the trainer's, which begin at the first
argument that is not a torchrun option. What differs from plain torchrun (which works too):

* the exit status is the ranks' own (spmd_rl/ppo.py's docstring: 2 a user error, 3 stopped after a
  checkpoint, 4 without it, 130 interrupted, 1 crashed), where torchrun exits 1 for any failing
  rank: the ranks record theirs (preemption.record_exit_status) and `node_exit_status` picks one;
* the closing lines of the rank with that status -- its `error:` line, or the latest checkpoint
  and the command that resumes -- come last, after torchrun's own output, without its traceback;
* a stop signal (Ctrl-C, SIGTERM, SIGUSR1/2) is passed on to the ranks, and torchrun waits up to
  TORCHRUN_SHUTDOWN_TIMEOUT_S for their checkpoint before it kills them (its own default is 30 s),
  where this torch has --signals-to-handle and --shutdown-timeout (2.12 and later); given
  explicitly, the user's values win. A second Ctrl-C stops the ranks at once, without a checkpoint.

`spmd-rl --help` shows the trainer's arguments; `torchrun --help` lists torchrun's.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
import tempfile
from argparse import Action, ArgumentParser

from spmd_rl.errors import LAUNCHER_REPORTS_ENV
from spmd_rl.exit_codes import EXIT_CRASHED, EXIT_NOT_SAVED, EXIT_PREEMPTED
from spmd_rl.runtime.preemption import EXIT_STATUS_DIR_ENV, recorded_exit_statuses, recorded_messages
from spmd_rl.runtime.resume_hint import LAUNCH_COMMAND_ENV, TRAINER_MODULE

# torchrun passes these signals on to its workers and then waits this long for them to exit before
# SIGKILL (its default, 30 s, can be shorter than a step + checkpoint). On SLURM, its own SIGKILL
# after GraceTime/KillWait still bounds the wait.
TORCHRUN_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2"
TORCHRUN_SHUTDOWN_TIMEOUT_S = 900


def torchrun_parser() -> ArgumentParser:
    from torch.distributed.run import get_args_parser

    return get_args_parser()


def torchrun_supports_graceful_stop(parser: ArgumentParser | None = None) -> bool:
    """Whether this torch's torchrun has --signals-to-handle and --shutdown-timeout (newer ones)."""
    parser = parser or torchrun_parser()
    options = {o for action in parser._actions for o in action.option_strings}
    return {"--signals-to-handle", "--shutdown-timeout"} <= options


def graceful_stop_options(parser: ArgumentParser | None = None) -> list[str]:
    """torchrun options that pass every stop signal on and wait for the checkpoint ([] where this
    torch lacks them)."""
    if not torchrun_supports_graceful_stop(parser):
        return []
    return [f"--signals-to-handle={TORCHRUN_SIGNALS}", f"--shutdown-timeout={TORCHRUN_SHUTDOWN_TIMEOUT_S}"]


def torchrun_option(parser: ArgumentParser, name: str) -> Action | None:
    """The torchrun option that `name` is, or that it starts (torchrun's parser takes a prefix of its
    long options as that option, or refuses it as ambiguous), or None: not torchrun's."""
    options = parser._option_string_actions
    if name in options:
        return options[name]
    if not name.startswith("--") or not parser.allow_abbrev:
        return None
    return next((action for option, action in options.items() if option.startswith(name)), None)


def split_args(argv: list[str], parser: ArgumentParser | None = None) -> tuple[list[str], list[str]]:
    """(torchrun's options, the trainer's arguments): the trainer's begin at the first argument
    that is not a torchrun option or its value."""
    parser = parser or torchrun_parser()
    i = 0
    while i < len(argv) and argv[i].startswith("-") and argv[i] not in ("-h", "--help"):
        action = torchrun_option(parser, argv[i].split("=", 1)[0])
        if action is None:
            break
        i += 1 if "=" in argv[i] or action.nargs == 0 else 2
    return argv[:i], argv[i:]


def node_exit_status(torchrun_rc: int, ranks: dict[int, int], stopped: bool) -> int:
    """The trainer's exit status on a node that ran torchrun, which reports any failing worker as
    its own status 1. `ranks`: the statuses the node's ranks recorded (a rank killed first has
    none); `stopped`: the launcher got a stop signal too.

    A rank's own failure wins (EXIT_NOT_SAVED above all: a stop whose checkpoint was not written
    must not be requeued, the requeue would only repeat it); then EXIT_PREEMPTED when a rank
    recorded it or the launcher was stopped (torchrun exits on the signal too); else torchrun's."""
    if torchrun_rc == 0:
        return 0
    failed = [code for code in ranks.values() if code not in (0, EXIT_PREEMPTED)]
    if failed:
        return EXIT_NOT_SAVED if EXIT_NOT_SAVED in failed else failed[0]
    if stopped or EXIT_PREEMPTED in ranks.values():
        return EXIT_PREEMPTED
    return torchrun_rc


def closing_lines(status: int, ranks: dict[int, int], messages: dict[int, str]) -> str:
    """The closing lines of the first rank that exited with `status` ('' if it has none)."""
    rank = next((r for r, code in ranks.items() if code == status and r in messages), None)
    return messages[rank] if rank is not None else ""


def launched_as() -> list[str]:
    """How this launcher was called, for the resume command: `spmd-rl` or `python -m ...`."""
    if os.path.basename(sys.argv[0]) == "spmd-rl":
        return ["spmd-rl"]
    return ["python", "-m", __spec__.name if __spec__ else "spmd_rl.launcher"]


def run_torchrun(argv: list[str]) -> tuple[int, bool]:
    """torchrun's own outcome: (0 or 1, or 128 + the signal that stopped it; whether a signal did)."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        torchrun.run(torchrun.parse_args(argv))
    except ChildFailedError:
        return EXIT_CRASHED, False
    except SignalException as e:
        return 128 + int(e.sigval), True
    return 0, False


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = torchrun_parser()
    torchrun_args, trainer_args = split_args(argv, parser)
    if {"-h", "--help", "--list-configs"} & set(trainer_args):  # no ranks needed
        if "--list-configs" not in trainer_args:
            print(__doc__)
        from spmd_rl import ppo

        return ppo.main(trainer_args)
    status_dir = tempfile.mkdtemp(prefix="spmd_rl_exit_status_")
    os.environ.update({EXIT_STATUS_DIR_ENV: status_dir, LAUNCHER_REPORTS_ENV: "1",
                       LAUNCH_COMMAND_ENV: shlex.join([*launched_as(), *argv])})
    try:
        rc, stopped = run_torchrun([*graceful_stop_options(parser), *torchrun_args, "-m", TRAINER_MODULE,
                                    *trainer_args])
        ranks, messages = recorded_exit_statuses(status_dir), recorded_messages(status_dir)
    finally:
        shutil.rmtree(status_dir, ignore_errors=True)
    status = node_exit_status(rc, ranks, stopped) if ranks else rc
    sys.stdout.flush()
    sys.stderr.write(closing_lines(status, ranks, messages))
    sys.stderr.flush()
    return status


if __name__ == "__main__":
    sys.exit(main())
