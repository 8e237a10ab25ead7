"""A mixture-of-experts model (ARCH_PRESETS "qwen3-moe-tiny": 8 experts, top-2, in every layer) through
the whole CPU run: it learns the default job as the dense tiny model does, the export at the end is
the trained actor for transformers, and the checkpoint of 2 ranks resumes on 1. The 80-step run is
conftest's moe_default_run, which tests/e2e/test_routing_replay_e2e.py reads too."""

import shutil

import torch
from transformers import AutoModelForCausalLM

from tests.helpers.cpu_runs import read_metrics, reward_ends, run, torchrun_cmd
from tests.test_export import actor_from_dcp, logprobs


def test_moe_learns_exports_and_resumes_on_another_world_size(tmp_path, moe_default_run):
    run_dir, export_dir = moe_default_run
    m = read_metrics(run_dir)
    steps = sorted(s for s in m if "reward/mean" in m[s])
    assert steps == list(range(1, 81)), steps
    first, last = reward_ends(m, steps)
    assert last > first + 0.2 and m[80]["val/acc"] > 0.3, (first, last, m[80]["val/acc"])
    # the HF engine got exactly the actor's experts every step (fp32 on CPU)
    assert max(m[s]["rollout/logprob_diff_max"] for s in steps) < 1e-4

    exported = AutoModelForCausalLM.from_pretrained(export_dir)
    assert exported.config.model_type == "qwen3_moe" and exported.config.num_experts == 8
    reference = actor_from_dcp(run_dir / "init_model", run_dir / "checkpoints" / "step_80")
    initial = AutoModelForCausalLM.from_pretrained(run_dir / "init_model", dtype=torch.float32)
    ids = torch.randint(3, 64, (4, 12), generator=torch.Generator().manual_seed(0))
    ref_state = reference.state_dict()
    assert exported.state_dict().keys() == ref_state.keys()
    for name, t in exported.state_dict().items():
        assert torch.equal(t, ref_state[name]), name
    # (with equal weights the two models' forwards agree to about 1e-6, not bitwise as the dense ones do)
    lp_export, lp_ref = logprobs(exported, ids), logprobs(reference, ids)
    torch.testing.assert_close(lp_export, lp_ref, rtol=0, atol=1e-5)
    assert (lp_export - logprobs(initial, ids)).abs().max() > 1e-3  # the trained model, not the initial one

    resumed = tmp_path / "run"  # the shared run's copy, to go on in
    shutil.copytree(run_dir, resumed)
    out = run(torchrun_cmd(1, f"trainer.run_dir={resumed}", 'model.arch="qwen3-moe-tiny"', "trainer.tensorboard=false",
                           "trainer.total_steps=82"))
    assert "resuming a checkpoint of 2 ranks on 1" in out
    m = read_metrics(resumed)
    assert m[82]["reward/mean"] >= 0 and max(m[s]["rollout/logprob_diff_max"] for s in (81, 82)) < 1e-4


def test_the_router_aux_loss_is_logged_and_changes_the_update(tmp_path, moe_default_run):
    """actor.router_aux_loss_coef > 0: actor/router_aux_loss is logged every step, and the run's update differs
    from one without it (the shared run, at the default 0: its first 3 steps are those of a 3-step run)."""
    run_dir = tmp_path / "aux0.1"
    run(torchrun_cmd(2, f"trainer.run_dir={run_dir}", 'model.arch="qwen3-moe-tiny"', "trainer.total_steps=3",
                     "trainer.tensorboard=false", "trainer.val_every=0", "actor.router_aux_loss_coef=0.1"))
    runs = {0.0: read_metrics(moe_default_run[0]), 0.1: read_metrics(run_dir)}
    aux = [runs[0.1][s]["actor/router_aux_loss"] for s in (1, 2, 3)]
    assert all(1.5 < a < 4 for a in aux), aux  # transformers' loss is top-k (2) where experts are used evenly
    assert "actor/router_aux_loss" not in runs[0.0][1]
    assert runs[0.1][3]["actor/grad_norm"] != runs[0.0][3]["actor/grad_norm"]
