"""`spmd-rl` (spmd_rl/launcher.py), the resume lines of a stopped run and `--check`.

The argument split and the exit-status choice are checked against torch's real torchrun parser
in-process; three runs go end to end on the tiny CPU job: a user error and a Ctrl-C through the
launcher (2 ranks), and --check (one process).
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys

import pytest
import tomllib

from spmd_rl import launcher, ppo
from spmd_rl.errors import LAUNCHER_REPORTS_ENV, ConfigError, closing_message, report, say_last
from spmd_rl.runtime import resume_hint
from tests.helpers import ROOT
from tests.helpers.cpu_runs import run_cmd

TINY = ["--config", "tiny-cpu", "trainer.tensorboard=false", "trainer.val_every=0", "data.synthetic_size=256",
        "data.val_batch_size=64"]


# --------------------------------------------------------------------------- in-process
def test_pyproject_names_the_launcher_as_the_spmd_rl_command():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        scripts = tomllib.load(f)["project"]["scripts"]
    module, _, function = scripts["spmd-rl"].partition(":")
    assert (module, function) == ("spmd_rl.launcher", "main") and callable(launcher.main)


def test_no_trainer_option_is_a_torchrun_option_or_a_prefix_torchrun_would_take():
    """torchrun takes any unambiguous prefix of its own options: a trainer option that were one
    would be eaten by torchrun (under the launcher and under plain torchrun alike)."""
    torchrun = launcher.torchrun_parser()
    options = {o for a in ppo.arg_parser()._actions for o in a.option_strings} - {"-h", "--help"}
    assert {"--config", "--check", "--list-configs"} <= options
    for option in options:
        assert launcher.torchrun_option(torchrun, option) is None, option
    # the rule the check applies is torchrun's own: a prefix of one of its options is that option
    assert launcher.torchrun_option(torchrun, "--nproc-per") is torchrun._option_string_actions["--nproc-per-node"]
    assert torchrun.parse_args(["--nproc-per=3", "-m", "x"]).nproc_per_node == "3"


@pytest.mark.parametrize("argv, split", [
    (["--nproc_per_node=2", "--config", "tiny-cpu", "actor.lr=1e-3"], 1),
    (["--standalone", "--nproc_per_node", "2", "--config", "tiny-cpu"], 3),
    (["--nproc-per=2", "--max-restarts", "0", "--check", "--config", "x.toml"], 3),
    (["--config", "tiny-cpu", "--nproc_per_node=2"], 0),  # after the trainer's first: the trainer's
    (["actor.lr=1e-3"], 0),
])
def test_torchrun_options_come_first_and_the_trainer_args_begin_at_the_first_other(argv, split):
    assert launcher.split_args(argv) == (argv[:split], argv[split:])


@pytest.mark.parametrize("ranks, stopped, torchrun_rc, status, rank", [
    ({0: 2, 1: 2}, False, 1, 2, 0),
    ({1: 2}, False, 1, 2, 1),              # rank 0 killed first: rank 1's line
    ({0: 3, 1: 3}, True, 130, 3, 0),       # Ctrl-C, checkpoint written
    ({0: 130, 1: 130}, True, 130, 130, 0),  # a second Ctrl-C
    ({0: 4, 1: 3}, True, 143, 4, 0),
])
def test_the_status_is_the_ranks_own_and_its_rank_speaks_last(ranks, stopped, torchrun_rc, status, rank):
    messages = {r: f"line of rank {r}\n" for r in ranks}
    assert launcher.node_exit_status(torchrun_rc, ranks, stopped) == status
    assert launcher.closing_lines(status, ranks, messages) == f"line of rank {rank}\n"


def test_graceful_stop_options_parse_with_this_torchrun_and_the_users_win():
    from torch.distributed.run import parse_args

    options = launcher.graceful_stop_options()
    if not launcher.torchrun_supports_graceful_stop():
        assert options == []
        return
    args = parse_args([*options, "--shutdown-timeout=60", "-m", "spmd_rl.ppo"])
    assert args.shutdown_timeout == 60 and "SIGINT" in args.signals_to_handle
    assert parse_args([*options, "-m", "spmd_rl.ppo"]).shutdown_timeout == launcher.TORCHRUN_SHUTDOWN_TIMEOUT_S


def test_under_the_launcher_a_rank_records_its_lines_instead_of_printing(monkeypatch, capsys):
    monkeypatch.setattr("spmd_rl.errors._closing", [])
    monkeypatch.setenv(LAUNCHER_REPORTS_ENV, "1")
    monkeypatch.setenv("RANK", "1")
    report(ConfigError("actor.lr = -1.0 must be > 0"))
    say_last("latest checkpoint: none yet")
    assert capsys.readouterr().err == ""
    assert closing_message() == "error: actor.lr = -1.0 must be > 0\nlatest checkpoint: none yet\n"


@pytest.mark.parametrize("env, args, expected", [
    ({}, ["--config", "tiny-cpu", "trainer.resume=none"], "python -m spmd_rl.ppo --config tiny-cpu"),
    ({"TORCHELASTIC_RUN_ID": "x", "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "2"}, ["--config", "a b.toml"],
     "torchrun --nproc_per_node=2 -m spmd_rl.ppo --config 'a b.toml'"),
    ({"TORCHELASTIC_RUN_ID": "x", "LOCAL_WORLD_SIZE": "4", "WORLD_SIZE": "8"}, ["actor.lr=1e-6"],
     "torchrun --nnodes=2 --nproc_per_node=4 -m spmd_rl.ppo actor.lr=1e-6"),
    ({resume_hint.LAUNCH_COMMAND_ENV: "spmd-rl --nproc_per_node=2 --config tiny-cpu trainer.resume=/c/step_3"},
     ["ignored"], "spmd-rl --nproc_per_node=2 --config tiny-cpu"),
])
def test_the_resume_command_is_the_launch_command_without_its_resume_override(monkeypatch, env, args, expected):
    for name in ("TORCHELASTIC_RUN_ID", "LOCAL_WORLD_SIZE", "WORLD_SIZE", resume_hint.LAUNCH_COMMAND_ENV):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert resume_hint.resume_lines("/r/checkpoints/step_3", args) == [
        "latest checkpoint: /r/checkpoints/step_3", f"resume with: {expected}"]


# --------------------------------------------------------------------------- end to end
def launcher_cmd(run_dir, *args):
    return [sys.executable, "-m", "spmd_rl.launcher", "--standalone", "--nproc_per_node=2", *TINY,
            f"trainer.run_dir={run_dir}", *args]


def test_a_user_error_under_the_launcher_ends_with_its_line_and_status_2(tmp_path):
    p = run_cmd(launcher_cmd(tmp_path / "run", "actor.lr=-1"))
    out = (p.stdout + p.stderr).strip()
    assert p.returncode == 2, out[-3000:]
    assert out.splitlines()[-1] == "error: actor.lr = -1.0 must be > 0", out[-3000:]
    assert out.count("error: ") == 1 and "Traceback" not in out and "ChildFailedError" not in out, out[-3000:]


def test_ctrl_c_under_the_launcher_checkpoints_the_step_and_says_how_to_resume(tmp_path):
    """SIGINT after step 3 of 50 (checkpoints every 2): the ranks finish the step they are in,
    write its checkpoint, and the launcher exits 3 with the checkpoint and the command last."""
    run_dir = tmp_path / "run"
    cmd = launcher_cmd(run_dir, "trainer.total_steps=50", "trainer.save_every=2")
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT))
    lines = []
    for line in p.stdout:
        lines.append(line.rstrip("\n"))
        if re.search(r"step 3/50 ", line):
            p.send_signal(signal.SIGINT)
    p.wait(timeout=300)
    out = "\n".join(lines)
    stopped = re.search(r"stop signal received: checkpointing at step (\d+)", out)
    assert p.returncode == 3 and stopped, out[-3000:]
    latest = run_dir / "checkpoints" / f"step_{stopped.group(1)}"
    assert int(stopped.group(1)) >= 3 and latest.is_dir(), out[-3000:]
    assert lines[-2:] == [f"latest checkpoint: {latest}",
                          f"resume with: {shlex.join(['python', '-m', 'spmd_rl.launcher', *cmd[3:]])}"], out[-3000:]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-3000:]


def test_check_runs_the_start_up_checks_and_exits_without_training(tmp_path):
    base = [sys.executable, "-m", "spmd_rl.ppo", "--check", *TINY, f"trainer.run_dir={tmp_path / 'run'}"]
    p = run_cmd(base)
    assert p.returncode == 0 and p.stdout.splitlines()[-1] == "check: OK", p.stdout + p.stderr[-3000:]
    assert [line.split(":")[0] for line in p.stdout.splitlines()] == ["config", "reward", "memory", "data", "check"]
    assert "data: 256 training prompts, 64 validation prompts" in p.stdout
    assert os.listdir(tmp_path / "run") == ["data"]  # the run's synthetic data, nothing else: no run
    bad = run_cmd([*base, 'reward.custom_function="no_such_module:score"'])
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith("error: reward.custom_function")
    assert "check: OK" not in bad.stdout
