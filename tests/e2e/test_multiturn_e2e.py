"""Multi-turn runs of the trainer on CPU (2 gloo ranks, the HF engine, the tiny model): the
hidden-digit environment (spmd_rl/envs/hidden_digit.py) through the whole step, and a resume in the
middle of a run continues exactly as the uninterrupted run."""

import json

import pytest

from tests.helpers.cpu_runs import read_metrics, run, stopped_after, torchrun_cmd

# ask with "?", get the digit, repeat it: each turn ends at a digit or "?" (the char tokenizer's ids)
HIDDEN = ["data.synthetic_task=hidden", "data.max_response_length=16",
          "rollout.environment=spmd_rl.envs.hidden_digit:HiddenDigitEnv", "rollout.max_turns=2",
          "rollout.stop_token_ids=[3,4,5,6,7,8,9,10,11,12,48]"]


def hidden_overrides(tmp_path, *more):
    return ["data.val_files=[]", "trainer.val_every=0",
            "trainer.tensorboard=false", *HIDDEN, *more]


def test_multi_turn_run_resumes_in_the_middle_exactly(tmp_path):
    """4 steps straight; its directory as if it had stopped after step 2 (stopped_after: its own
    checkpoint of step 2) goes on to step 4 as the run did."""
    common = hidden_overrides(tmp_path, "trainer.save_every=2", "trainer.log_samples_every=2")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run(torchrun_cmd(2, f"trainer.run_dir={straight}", "trainer.total_steps=4", *common))
    stopped_after(straight, resumed, 2)
    out = run(torchrun_cmd(2, f"trainer.run_dir={resumed}", "trainer.total_steps=4", *common))
    assert "at step 2" in out and "resumed from" in out, out[-2000:]
    a, b = read_metrics(straight), read_metrics(resumed)
    for step in (3, 4):  # same prompts, same trajectories (turns, bridges, rewards), same update
        for key in ("reward/mean", "actor/pg_loss", "actor/grad_norm", "multiturn/turns_mean",
                    "response/model_token_share", "response/length_mean", "multiturn/stop_answer"):
            assert b[step][key] == pytest.approx(a[step][key], rel=1e-6, abs=1e-9), (step, key)
    m = a[4]
    assert 0 < m["response/model_token_share"] <= 1 and m["rollout/logprob_diff_max"] < 1e-4
    # the conversations shown every 2 steps: the prompt's messages, then the model's turns and the
    # environment's answers with their roles; the first turn opens the decoded response region
    samples = [json.loads(line) for line in open(straight / "samples.jsonl")]
    assert [r["step"] for r in samples if r["split"] == "train"] == [2] * 3 + [4] * 3
    for r in samples:
        turns = r["messages"][r["prompt_messages"]:]
        assert r["prompt_messages"] >= 1 and turns[0]["role"] == "assistant", r
        assert {t["role"] for t in turns} <= {"assistant", "user", "tool"} and len(turns) <= 2 * 2 - 1, r
        assert r["response"].startswith(turns[0]["content"]), r
    assert any(len(r["messages"]) > r["prompt_messages"] + 1 for r in samples)  # some went on to a second turn
    assert sum(m[f"multiturn/stop_{r}"] for r in ("answer", "max_turns", "length", "bridge_overflow",
                                                   "env_error", "env_timeout")) == pytest.approx(1.0)
