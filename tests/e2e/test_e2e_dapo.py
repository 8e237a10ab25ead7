"""A whole CPU run (torchrun, 2 ranks) with DAPO dynamic sampling, rollout correction and
pass@k validation: every step trains on exactly data.train_batch_size informative groups although
many groups are uniform, and a run resumed mid-way draws the same data and samples."""

import os
import re
import shutil

import pytest

from tests.e2e.test_e2e import documented_metrics
from tests.helpers import ROOT
from tests.helpers.cpu_runs import read_metrics, run, torchrun_cmd

BATCH = 4
COMMON = [f"data.train_batch_size={BATCH}", "data.synthetic_size=256", "rollout.n=8", "actor.ppo_mini_batch_size=4",
          "actor.micro_batch_size_per_gpu=16", "trainer.save_every=2", "trainer.tensorboard=false",
          "trainer.val_every=0", "algorithm.dynamic_sampling=true", "algorithm.dynamic_sampling_max_rounds=30",
          'algorithm.rollout_is="token"', 'algorithm.rollout_mask="token"', "algorithm.rollout_reject_sequences=true",
          "rollout.val_n=4", "rollout.val_temperature=1.0", "data.val_batch_size=64"]
COMPARED = ("reward/mean", "actor/pg_loss", "actor/grad_norm", "prompt/length_mean", "dynamic_sampling/rounds",
            "dynamic_sampling/dropped_groups")


def test_dynamic_sampling_trains_on_full_informative_batches_and_resumes_identically(tmp_path):
    straight = tmp_path / "straight"
    run(torchrun_cmd(2, f"trainer.run_dir={straight}", "trainer.total_steps=4", *COMMON))
    m = read_metrics(straight)
    assert sorted(m) == [1, 2, 3, 4]
    for s in m:
        assert m[s]["dynamic_sampling/train_groups"] == BATCH, m[s]
        assert m[s]["dynamic_sampling/informative_groups"] == BATCH and m[s]["dynamic_sampling/padded_groups"] == 0
        # every training row sits in a group whose rewards differ: the GRPO advantages are never all 0
        assert m[s]["reward/std"] > 0
        # the engine is the actor's exact fp32 copy here: IS weights are 1 and nothing is masked
        assert m[s]["rollout_corr/is_weight_mean"] == pytest.approx(1.0, abs=1e-4)
        assert m[s]["rollout_corr/token_masked_frac"] == 0.0
    dropped = sum(m[s]["dynamic_sampling/dropped_groups"] for s in m)
    assert dropped > 0, "no uniform group was ever dropped: the test does not exercise the filter"
    for s in m:  # groups seen = informative (at least the batch; the surplus is discarded) + dropped
        assert m[s]["dynamic_sampling/drawn_groups"] - m[s]["dynamic_sampling/dropped_groups"] >= BATCH
    assert any(m[s]["dynamic_sampling/rounds"] > 1 for s in m)
    assert 0 <= m[4]["val/pass@1"] <= m[4]["val/pass@2"] <= m[4]["val/pass@4"] <= 1
    assert m[4]["val/mean@4"] == pytest.approx(m[4]["val/acc"])  # every prompt has 4 samples

    with open(os.path.join(ROOT, "docs", "metrics.md")) as f:
        doc = f.read()
    for key in set().union(*(m[s] for s in m)):
        generic = re.sub(r"@\d+$", "@<k>", key.replace("/synthetic/successor/", "/<data_source>/"))
        assert key in ("step", "time") or key in documented_metrics() or f"`{generic}`" in doc, key

    # the run as if it had stopped after step 2: only that checkpoint and the metrics up to it
    resumed = tmp_path / "resumed"
    shutil.copytree(straight, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_4")
    (resumed / "checkpoints" / "latest").write_text("step_2")
    lines = (resumed / "metrics.jsonl").read_text().splitlines()
    (resumed / "metrics.jsonl").write_text("\n".join(lines[:2]) + "\n")
    out = run(torchrun_cmd(2, f"trainer.run_dir={resumed}", "trainer.total_steps=4", *COMMON))
    assert "at step 2" in out
    r = read_metrics(resumed)
    for step in (3, 4):  # same prompts drawn over the same rounds, same samples, same updates
        for key in COMPARED:
            assert r[step][key] == pytest.approx(m[step][key], rel=1e-6, abs=1e-9), (step, key)
