"""Whole runs of the trainer on CPU: it learns, it resumes exactly, every algorithm runs."""

import json
import os
import subprocess
import time

import pytest

from tests.helpers import ROOT
from tests.helpers.cpu_runs import TINY, kill_matching, read_metrics, reward_ends, run, torchrun_cmd


def test_tiny_grpo_learns_on_two_ranks(tiny_default_run):
    run_dir, out = tiny_default_run
    m = read_metrics(run_dir)
    steps = sorted(s for s in m if "reward/mean" in m[s])
    assert steps == list(range(1, 81)), steps
    first, last = reward_ends(m, steps)
    assert last > first + 0.2, (first, last)
    assert m[80]["val/acc"] > m[40]["val/acc"] - 0.05 and m[80]["val/acc"] > 0.3, (m[40]["val/acc"], m[80]["val/acc"])
    # the rollout copy received exactly the actor's weights every step (fp32 on CPU)
    assert max(m[s]["rollout/logprob_diff_max"] for s in steps) < 1e-4
    assert "step 80/80" in out
    assert os.path.isfile(run_dir / "config.toml") and os.listdir(run_dir / "tensorboard")
    with open(run_dir / "checkpoints" / "latest") as f:
        assert f.read().strip() == "step_80"


FIRST_CHAR_DIGIT = """
from spmd_rl.data.rewards import score_synthetic

def score(data_source, response, ground_truth, extra_info):
    if not response[:1].isdigit():
        raise ValueError("the response does not start with a digit")
    return score_synthetic(response, ground_truth)
"""


def test_a_run_shows_samples_time_left_scoring_errors_and_a_summary(tmp_path):
    """The console and samples.jsonl of a short run: the samples at validations and every
    trainer.log_samples_every steps (what the engine sampled, scored as the reward function does),
    the time left on the step lines, one warning for a reward function failing on most responses,
    and the end summary, which a second run of the finished run prints again."""
    from spmd_rl.data.rewards import score_synthetic

    reward = tmp_path / "first_digit.py"
    reward.write_text(FIRST_CHAR_DIGIT)
    run_dir = tmp_path / "run"
    cmd = torchrun_cmd(2, f"trainer.run_dir={run_dir}", "trainer.total_steps=4", "trainer.val_every=2",
                       "trainer.log_samples_every=2", "data.synthetic_size=256", f'reward.custom_function="{reward}:score"',
                       'reward.on_error="zero"')
    out = run(cmd)
    samples = [json.loads(line) for line in open(run_dir / "samples.jsonl")]
    assert [(r["step"], r["split"]) for r in samples] == [(s, split) for s in (2, 4) for split in ("train", "val")
                                                          for _ in range(3)]
    val = [r for r in samples if r["split"] == "val"]
    assert [r["index"] for r in val[:3]] == [r["index"] for r in val[3:]]  # the same prompts every validation
    for r in samples:
        assert r["ground_truth"] == str((int(r["prompt"][-1]) + 1) % 10)  # the row's own prompt (successor task)
        expected = score_synthetic(r["response"], r["ground_truth"])["score"] if r["response"][:1].isdigit() else 0.0
        assert r["reward"] == expected, r
    assert "samples at step 2 (train" in out and "samples at step 4 (val" in out
    steps = [line for line in out.splitlines() if "step 1/4 |" in line or "step 4/4 |" in line]
    assert "s/step, ~" in steps[0] and " left" in steps[0] and steps[1].endswith("s/step"), steps
    warnings = [line for line in out.splitlines() if "the reward function failed on" in line]
    assert len(warnings) == 1 and "step 1: " in warnings[0] and "does not start with a digit" in warnings[0], warnings
    summary = out[out.index("run finished at step 4/4"):].splitlines()[:6]
    assert summary[1].strip().startswith("validation: final reward") and "at step 4; best" in summary[1]
    m = read_metrics(run_dir)
    for s in range(1, 5):  # the step's model tokens: 16 prompts x 16 responses of the mean length
        assert m[s]["response/tokens"] == pytest.approx(16 * 16 * m[s]["response/length_mean"]), s
    assert summary[2].strip() == f"trained: {sum(m[s]['response/tokens'] for s in range(1, 5)):,.0f} response tokens over 4 steps"
    assert summary[3:5] == [f"  checkpoint: {run_dir / 'checkpoints' / 'step_4'}",
                            f"  curves: tensorboard --logdir {run_dir / 'tensorboard'}"]
    again = run(cmd)
    assert "this run already finished" in again and "raise trainer.total_steps" in again
    assert again[again.index("run finished at step 4/4"):].splitlines()[:6] == summary


NOISE = ("is deprecated", "returned a view tensor", "no GPU: not compared", "memory: predicted peak")
"""What a CPU run once printed that says nothing to its user: torch's deprecation of a collective
we called, FSDP2's warning at a view among the actor's outputs, a GPU memory line without a GPU."""


def test_a_cpu_run_with_a_save_prints_no_noise(tiny_default_run):
    """GRPO: the tiny job's default run (saves at steps 40 and 80, validations at both)."""
    run_dir, out = tiny_default_run
    assert "step 80/80" in out and os.path.isdir(run_dir / "checkpoints" / "step_40"), out[-3000:]
    assert not [n for n in NOISE if n in out], out[-5000:]


def test_a_cpu_run_of_ppo_with_a_critic_and_a_save_prints_no_noise(tmp_path):
    """PPO with a critic (whose value head's output FSDP2 once warned about, as a view)."""
    run_dir = tmp_path / "run"
    out = run(torchrun_cmd(2, f"trainer.run_dir={run_dir}", "trainer.total_steps=3", "trainer.save_every=2",
                           "trainer.val_every=0", "algorithm.adv_estimator=gae"))
    assert "step 3/3" in out and os.path.isdir(run_dir / "checkpoints" / "step_2"), out[-3000:]
    assert not [n for n in NOISE if n in out], out[-5000:]


def test_kill_and_resume_continues_identically(tmp_path, tiny_default_run):
    """A run of 8 steps killed with a save in flight, resumed past a broken checkpoint: its steps after
    the resume are those of the uninterrupted default run (whose total_steps, saves and validations
    change none of its first 8 steps)."""
    common = ["trainer.total_steps=8", "trainer.save_every=2", "trainer.val_every=0", 'data.val_files=[]',
              "trainer.tensorboard=false"]
    straight = tiny_default_run[0]

    resumed = tmp_path / "resumed"
    cmd = torchrun_cmd(2, f"trainer.run_dir={resumed}", *common)
    # The asynchronous save of step 6 is written but held back from its commit (a save in flight)
    # while training goes on; the kill must leave step_4 as the latest. A file of step_4 is then
    # truncated: the resume must name it and fall back to step_2.
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, SPMD_RL_CHECKPOINT_FAULT="delay@6:600")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    ckpts = resumed / "checkpoints"
    deadline = time.time() + 300
    while proc.poll() is None and time.time() < deadline and not (
            (resumed / "metrics.jsonl").exists() and '"step": 7,' in (resumed / "metrics.jsonl").read_text()):
        time.sleep(0.05)
    kill_matching(str(resumed))  # torchrun and its workers, no chance to clean up: like a node failure
    proc.wait()
    assert "step_6: training stalled" in (resumed / "trainer.log").read_text()
    assert os.path.isdir(ckpts / "step_6.tmp") and not os.path.exists(ckpts / "step_6")
    assert (ckpts / "latest").read_text().strip() == "step_4", "the save in flight must not become the latest"
    shard = ckpts / "step_4" / sorted(f for f in os.listdir(ckpts / "step_4") if f.endswith(".distcp"))[0]
    os.truncate(shard, os.path.getsize(shard) // 2)
    resumed_at = 2

    out = run(cmd)
    assert f"checkpoint {ckpts / 'step_4'} is broken: {shard.name}" in out, out[-2000:]
    assert f"resumed from {ckpts / f'step_{resumed_at}'} at step {resumed_at}" in out, out[-2000:]
    a, b = read_metrics(straight), read_metrics(resumed)
    assert sorted(b) == list(range(1, 9))
    for step in range(resumed_at + 1, 9):  # same data, same samples, same updates
        for key in ("reward/mean", "actor/pg_loss", "actor/grad_norm", "prompt/length_mean", "data/epoch"):
            assert b[step][key] == pytest.approx(a[step][key], rel=1e-6, abs=1e-9), (step, key)



def test_balance_ranks_keeps_the_update_and_evens_the_ranks_tokens(tmp_path, tiny_run):
    """2 ranks with trainer.balance_ranks on and off: the first step trains on the same rollouts and
    gives the same update either way; on, the metrics show the busiest rank's tokens before and after.
    On (the default) is conftest's tiny_run: 2 steps of the same 256 prompts (the validation after
    the last step and the export change no step)."""
    # each run writes the same synthetic data (deterministic in the seed) under its own directory
    run_dir = tmp_path / "balance_false"
    run(torchrun_cmd(2, f"trainer.run_dir={run_dir}", "trainer.balance_ranks=false", "trainer.total_steps=2",
                     "trainer.val_every=0", 'data.val_files=[]', "trainer.tensorboard=false", "data.synthetic_size=256"))
    on, off = read_metrics(tiny_run[0]), read_metrics(run_dir)
    assert sorted(s for s in on if "reward/mean" in on[s]) == [1, 2]
    for key in ("reward/mean", "prompt/length_mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy"):
        assert on[1][key] == pytest.approx(off[1][key], rel=1e-5, abs=1e-7), key
    for step in (1, 2):
        before, after = on[step]["batch/rank_tokens_max_over_mean_before"], on[step]["batch/rank_tokens_max_over_mean_after"]
        assert 1.0 <= after <= before, (step, before, after)
        assert "batch/rank_tokens_max_over_mean_before" not in off[step]
        # the slowest rank's generation, beside the ranks' mean (metrics.rank_reduction)
        assert on[step]["time/generate_max"] >= on[step]["time/generate"] > 0, step


ALGOS = {
    "ppo_gae_kl_reward_adaptive": ['algorithm.adv_estimator="gae"', "algorithm.use_kl_in_reward=true",
                                   'algorithm.kl_ctrl="adaptive"', "algorithm.kl_coef=0.05", "algorithm.target_kl=0.001",
                                   "critic.lr=1e-3", "critic.ppo_mini_batch_size=4", "critic.micro_batch_size_per_gpu=16"],
    "grpo_kl_loss_entropy_seqmean": ["actor.use_kl_loss=true", 'actor.kl_loss_type="k3"', "actor.entropy_coeff=0.01",
                                     'actor.loss_agg_mode="seq-mean-token-mean"', "algorithm.norm_adv_by_std_in_grpo=false",
                                     "actor.ppo_epochs=2"],
    "rloo": ['algorithm.adv_estimator="rloo"', 'actor.loss_agg_mode="seq-mean-token-sum"'],
    # the reference is the actor with its LoRA adapter disabled (no second model)
    "lora_grpo_kl_loss": ["model.lora_rank=4", "actor.lr=5e-3", "actor.use_kl_loss=true", 'actor.kl_loss_type="k3"',
                          "actor.entropy_coeff=0.01", "actor.ppo_epochs=2"],
    "reinforce_plus_plus": ['algorithm.adv_estimator="reinforce_plus_plus"', "algorithm.use_kl_in_reward=true",
                            'algorithm.kl_penalty="k2"'],
}


@pytest.mark.parametrize("name", sorted(ALGOS))
def test_every_algorithm_runs_and_updates(tmp_path, name):
    """One rank in-process, a few steps: losses finite, the pieces each algorithm needs show up
    in the metrics and move."""
    from spmd_rl.ppo import main

    run_dir = tmp_path / "run"
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(k, None)
    rc = main(["--config", TINY, f"trainer.run_dir={run_dir}", "trainer.total_steps=3", "trainer.val_every=0",
               "data.train_batch_size=4", "data.synthetic_size=64", "trainer.tensorboard=false",
               "rollout.n=4", "actor.micro_batch_size_per_gpu=8", *ALGOS[name]])
    assert rc == 0
    m = read_metrics(run_dir)
    assert sorted(s for s in m if "reward/mean" in m[s]) == [1, 2, 3]
    for s in (1, 2, 3):
        for k, v in m[s].items():
            assert v == v and abs(v) != float("inf"), (s, k, v)
    if "gae" in name:
        assert m[1]["critic/values_mean"] == 0.0  # zero-initialised value head
        assert m[3]["critic/values_mean"] != 0.0 and m[3]["critic/vf_loss"] > 0
        assert m[1]["kl/coef"] == 0.05 and m[3]["kl/coef"] != 0.05  # the adaptive controller moved
    if "kl_loss" in name:
        # the policy starts as the reference and drifts away from it (2 epochs: step 1 is not 0)
        assert 0 < m[1]["actor/kl_loss"] < m[3]["actor/kl_loss"]
    if name == "reinforce_plus_plus":
        assert "kl/reward_penalty" in m[3]
    for k in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "time/generate", "time/update_actor"):
        assert k in m[3], k
    # one rank: weight sync takes the local tensors without a collective; the copy must still be exact
    assert max(m[s]["rollout/logprob_diff_max"] for s in (1, 2, 3)) < 1e-4
    documented = documented_metrics()
    for k in m[3]:
        per_source = k.startswith("val/") and k.rsplit("/", 1)[1] in ("reward_mean", "acc")  # val/<data_source>/...
        assert k in ("step", "time") or k in documented or per_source, f"metric {k} is not in docs/metrics.md"


def documented_metrics():
    import re

    with open(os.path.join(ROOT, "docs", "metrics.md")) as f:
        names = set(re.findall(r"`([a-z_]+/[a-z_<>/]+)`", f.read()))
    # expand `memory/<phase>_peak_gb` for the phases the trainer times
    phases = [n.split("/")[1] for n in names if n.startswith("time/")]
    return names | {f"memory/{p}_peak_gb" for p in phases}
