"""Run directories written by earlier versions of the package resume with today's code.

Each directory under tests/fixtures/old_runs/ is what a real run of an earlier version wrote and a
resume reads: its config.toml, checkpoints/step_2 (checkpoints/latest names it: the run as if it
had stopped after that save) and the recipe of its synthetic data (in config.toml). written_by.json
names the version and commit that wrote it and the command (`torchrun --nproc_per_node=2 -m
spmd_rl.ppo --config tiny-cpu OVERRIDES`, RUN standing for the run directory); step_3_metrics.json
is what that uninterrupted run logged for step 3. Resumed from its step 2 with the same command
today, step 3 trains on the same prompts from the same weights, optimizer state and random state,
so it logs the same numbers. How to add a fixture: docs/checkpoints.md.
"""

import json
import os
import shutil

import pytest

from tests.helpers import ROOT
from tests.helpers.cpu_runs import read_metrics, run, torchrun_cmd

OLD_RUNS = os.path.join(ROOT, "tests", "fixtures", "old_runs")
FIXTURES = sorted(os.listdir(OLD_RUNS))


def written_by(name):
    with open(os.path.join(OLD_RUNS, name, "written_by.json")) as f:
        return json.load(f)


def copy_run(name, tmp_path):
    """The fixture's run directory, copied to where a test may write (a resume writes into it)."""
    run_dir = tmp_path / "run"
    shutil.copytree(os.path.join(OLD_RUNS, name), run_dir, ignore=shutil.ignore_patterns("hf_export", "adapter"))
    return run_dir


def test_the_fixtures_are_the_versions_the_compatibility_promise_names():
    """A run from before LoRA existed (9d108d1) and a LoRA run of the last version before checkpoints
    recorded their format (730471c)."""
    assert {written_by(n)["commit"] for n in FIXTURES} >= {"9d108d1", "730471c"}
    for name in FIXTURES:
        assert name.startswith(written_by(name)["spmd_rl_version"] + "-" + written_by(name)["commit"])


@pytest.mark.parametrize("name", FIXTURES)
def test_an_old_run_directory_resumes_and_continues_as_it_did(name, tmp_path):
    run_dir = copy_run(name, tmp_path)
    overrides = [o.replace("RUN", str(run_dir)) for o in written_by(name)["overrides"]]
    out = run(torchrun_cmd(2, *overrides, "trainer.resume=auto", "trainer.save_every=0"))
    assert f"resumed from {run_dir / 'checkpoints' / 'step_2'} at step 2" in out, out[-2000:]
    then = json.load(open(os.path.join(OLD_RUNS, name, "step_3_metrics.json")))
    now = read_metrics(run_dir)
    assert [s for s in sorted(now) if "reward/mean" in now[s]] == [3]
    for key in ("reward/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/ppo_kl", "data/epoch"):
        assert now[3][key] == pytest.approx(then[key], rel=1e-4, abs=1e-7), key
