"""A checkpoint written by an earlier version of the package resumes with today's code.

tests/fixtures/checkpoint_0_1/step_2 was written by spmd_rl 0.1.0 at commit 9d108d1 (before the
package was laid out in folders by concern): the tiny CPU job, 2 ranks, synchronous saves, run as

    torchrun --nproc_per_node=2 -m spmd_rl.ppo --config tiny-cpu trainer.total_steps=3 \
        trainer.save_every=2 trainer.val_every=0 'data.val_files=[]' trainer.tensorboard=false \
        trainer.async_save=false trainer.run_dir=RUN data.train_files='["DATA/train.parquet"]'

step_3_metrics.json is what that run logged for step 3. Resumed from its step 2 today, step 3 must
train on the same prompts from the same weights, optimizer state and random state, so it logs the
same numbers.
"""

import json
import os
import shutil

import pytest

from tests.test_e2e import ROOT, read_metrics, run, torchrun_cmd

FIXTURE = os.path.join(ROOT, "tests", "fixtures", "checkpoint_0_1")


def test_a_checkpoint_of_version_0_1_resumes_and_continues_as_it_did(tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(os.path.join(FIXTURE, "step_2"), run_dir / "checkpoints" / "step_2")
    (run_dir / "checkpoints" / "latest").write_text("step_2")
    out = run(torchrun_cmd(2, f"trainer.run_dir={run_dir}", "trainer.total_steps=3", "trainer.save_every=0",
                           "trainer.val_every=0", "data.val_files=[]", "trainer.tensorboard=false"))
    assert f"resumed from {run_dir / 'checkpoints' / 'step_2'} at step 2" in out, out[-2000:]
    then = json.load(open(os.path.join(FIXTURE, "step_3_metrics.json")))
    now = read_metrics(run_dir)
    assert sorted(now) == [3]
    for key in ("reward/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/ppo_kl", "data/epoch"):
        assert now[3][key] == pytest.approx(then[key], rel=1e-4, abs=1e-7), key
