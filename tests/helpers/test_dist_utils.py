"""run_distributed, the harness of the multi-process CPU tests: its processes start from a fork server
that outlives each call, yet see the environment and working directory of the call (as spawned
processes would), and a failing rank fails the call with its traceback."""

import os

import pytest

from tests.helpers.dist_utils import run_distributed


def nothing(rank, world):
    pass


def fails_on_rank_1(rank, world):
    if rank == 1:
        raise ValueError("rank 1 fails here")


def sees(rank, world, variable, value, cwd):
    assert os.environ.get(variable) == value and os.getcwd() == cwd, (os.environ.get(variable), os.getcwd())
    assert os.environ["RANK"] == str(rank) and os.environ["WORLD_SIZE"] == str(world)


def test_processes_see_the_calls_environment_and_directory(monkeypatch, tmp_path):
    run_distributed(nothing, 1)  # the fork server runs from here on, with the environment of this moment
    monkeypatch.setenv("SPMD_RL_TEST_DIST_UTILS", "set after the server started")
    monkeypatch.chdir(tmp_path)
    run_distributed(sees, 2, "SPMD_RL_TEST_DIST_UTILS", "set after the server started", str(tmp_path))


def test_a_failing_rank_fails_the_call_with_its_traceback():
    with pytest.raises(Exception, match="rank 1 fails here"):
        run_distributed(fails_on_rank_1, 2)
