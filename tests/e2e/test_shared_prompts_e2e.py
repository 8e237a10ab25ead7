"""Shared prompts (model.share_prompts) in whole 2-rank CPU runs of the tiny job: packed rows with a
token budget, a reference model for the KL loss (and a critic, for GAE; a mixture of experts with the
engine's routes replayed), and each prompt of 16 responses
fed once train exactly as the same rows fed whole (the same losses, KL, values and gradient norms, to
float32 rounding)."""

import pytest

from tests.helpers.cpu_runs import read_metrics, run, torchrun_cmd

COMMON = ["trainer.total_steps=4", "trainer.val_every=-1", "trainer.save_every=0", "trainer.val_before_train=false",
          "trainer.tensorboard=false", "data.synthetic_size=256", "model.remove_padding=true",
          "actor.max_token_len_per_gpu=128", "actor.use_kl_loss=true"]


@pytest.mark.parametrize("variant", ["grpo", "gae", "moe-replay"])
def test_shared_prompts_train_as_whole_rows(tmp_path, variant):
    extra = {"grpo": [], "gae": ['algorithm.adv_estimator="gae"'],
             "moe-replay": ["model.arch=qwen3-moe-tiny"]}[variant]  # the engine's routes replayed (the default)
    for share in ("false", "true"):
        run(torchrun_cmd(2, f"trainer.run_dir={tmp_path / share}", f"model.share_prompts={share}", *extra, *COMMON))
    whole, shared = read_metrics(tmp_path / "false"), read_metrics(tmp_path / "true")
    keys = ["reward/mean", "actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/entropy"]
    if variant == "gae":  # the critic's values, loss and gradients too
        keys += ["critic/vf_loss", "critic/vpred_mean", "critic/grad_norm"]
    if variant == "moe-replay":  # a shared prompt's tokens take the routes of the first of its rows
        assert all(shared[step]["routing/replayed_share"] == 1.0 for step in range(1, 5))
    for step in range(1, 5):
        for key in keys:
            assert shared[step][key] == pytest.approx(whole[step][key], rel=1e-4, abs=1e-7), (step, key)
