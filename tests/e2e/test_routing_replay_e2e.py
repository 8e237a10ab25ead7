"""Routing replay in whole CPU runs: the default job on the qwen3-moe-tiny model (8 experts, top-2),
2 ranks, HF engine, with actor.router_replay = "engine" (its default: conftest's moe_default_run, which
tests/e2e/test_moe_e2e.py reads too) and "off"."""

from tests.helpers.cpu_runs import read_metrics, run, torchrun_cmd


def learning(m):
    steps = sorted(s for s in m if "reward/mean" in m[s])
    assert steps == list(range(1, 81)), steps
    return (sum(m[s]["reward/mean"] for s in steps[:10]) / 10, sum(m[s]["reward/mean"] for s in steps[-10:]) / 10,
            steps)


def test_moe_learns_with_replay_as_without_and_replays_every_token(tmp_path, moe_default_run):
    """Both runs learn the task; with replay every token whose routing reaches a log-prob took the
    engine's routes (routing/replayed_share = 1, single-turn: the HF engine routes prompt and
    response), and the engine's log-probs stay the actor's (fp32 on CPU)."""
    run(torchrun_cmd(2, f"trainer.run_dir={tmp_path / 'off'}", "model.arch=qwen3-moe-tiny", 'actor.router_replay="off"'))
    out = {"engine": read_metrics(moe_default_run[0]), "off": read_metrics(tmp_path / "off")}
    (first, last, steps), (first_off, last_off, _) = learning(out["engine"]), learning(out["off"])
    assert last > first + 0.2 and last_off > first_off + 0.2, (first, last, first_off, last_off)
    assert last > last_off - 0.15, (last, last_off)  # replay learns as the trainer's own routing does
    assert all(out["engine"][s]["routing/replayed_share"] == 1.0 for s in steps)
    assert not any("routing/replayed_share" in m for m in out["off"].values())
    assert all(0 <= out["engine"][s]["routing/changed_share"] <= 1 for s in steps)  # tests/model/test_routing.py
    assert not any("routing/changed_share" in m for m in out["off"].values())
    assert max(out["engine"][s]["rollout/logprob_diff_max"] for s in steps) < 1e-4


def test_glm_family_replays_every_token_and_its_engine_keeps_the_actors_log_probs(tmp_path):
    """GLM-4.7-Flash's family (glm4-moe-lite-tiny: latent attention, a sigmoid router with a correction
    bias, a dense first layer) through a short run: every routed token replayed, the HF engine's log-probs
    the actor's, and a resume from its checkpoint (the biases' sync: tests/model/test_model_families.py)."""
    common = [f"trainer.run_dir={tmp_path}", 'model.arch="glm4-moe-lite-tiny"', "trainer.val_every=0",
              "data.val_files=[]", "trainer.tensorboard=false", "trainer.save_every=2"]
    run(torchrun_cmd(2, *common, "trainer.total_steps=2"))
    out = run(torchrun_cmd(2, *common, "trainer.total_steps=4"))
    assert "resumed from" in out and "at step 2" in out
    m = read_metrics(tmp_path)
    assert all(m[s]["routing/replayed_share"] == 1.0 for s in (1, 2, 3, 4)), m
    assert max(m[s]["rollout/logprob_diff_max"] for s in (1, 2, 3, 4)) < 1e-4
