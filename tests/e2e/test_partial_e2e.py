"""Partial rollouts (rollout.partial_rollouts) in whole 2-rank CPU runs of the tiny job: it learns as a
run without them does, no token trains older than the bound, and a resume goes on as an uninterrupted
run does (a save drops the carried groups in both)."""

import pytest

from tests.helpers.cpu_runs import read_metrics, run, stopped_after, torchrun_cmd

# rounds of one token: the tiny job's two-token responses are cut after the first round, and the pool
# of two batches carries a batch of groups (one version old) into every other step
PARTIAL = ["rollout.partial_rollouts=true", "rollout.partial_chunk_tokens=1", 'algorithm.rollout_is="token"']


def test_the_tiny_job_learns_with_partial_rollouts_as_without(tmp_path, tiny_default_run):
    run(torchrun_cmd(2, f"trainer.run_dir={tmp_path / 'on'}", "trainer.save_every=0", "trainer.tensorboard=false",
                     *PARTIAL))
    off, on = read_metrics(tiny_default_run[0]), read_metrics(tmp_path / "on")  # off: the default run
    steps = sorted(s for s in on if "reward/mean" in on[s])
    assert steps == list(range(1, 81))
    assert max(on[s]["rollout/staleness_max"] for s in steps) == 1  # max_staleness: 1
    assert sum(on[s]["rollout/staleness_share_1"] for s in steps) > 20  # carried groups did train
    assert all(on[s]["rollout/stale_dropped"] == 0 for s in steps)
    first = sum(on[s]["reward/mean"] for s in steps[:10]) / 10
    last = sum(on[s]["reward/mean"] for s in steps[-10:]) / 10
    assert last > first + 0.2, (first, last)
    # both learn, and partial rollouts no worse than without: the tiny job's 80 steps are chaotic in the CPU's
    # arithmetic (one CPU's validation at step 80 gave 0.74 without and 0.55 with them, where its training
    # rewards of steps 41-80 were 0.52 and 0.50), so the runs are compared on the mean training reward of
    # their second half, 40 steps of 256 responses, not on one validation
    assert min(on[80]["val/acc"], off[80]["val/acc"]) > 0.3, (on[80]["val/acc"], off[80]["val/acc"])
    second_half = [{s: m[s]["reward/mean"] for s in range(41, 81)} for m in (on, off)]
    on_mean, off_mean = (sum(half.values()) / len(half) for half in second_half)
    assert on_mean > off_mean - 0.1, (on_mean, off_mean)


def test_a_resume_with_carried_groups_goes_on_as_an_uninterrupted_run(tmp_path):
    """The uninterrupted run's directory as if it had stopped after step 2 (stopped_after: its own
    checkpoint of step 2, saved while groups were carried) goes on to step 4 as the run did."""
    common = ["trainer.save_every=2", "trainer.val_every=0", "data.val_files=[]", "trainer.tensorboard=false",
              *PARTIAL]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run(torchrun_cmd(2, f"trainer.run_dir={straight}", "trainer.total_steps=4", *common))
    stopped_after(straight, resumed, 2)
    out = run(torchrun_cmd(2, f"trainer.run_dir={resumed}", "trainer.total_steps=4", *common))
    assert "at step 2" in out and "resumed from" in out
    a, b = read_metrics(straight), read_metrics(resumed)
    assert a[2]["rollout/carried_groups"] > 0 and a[3]["rollout/dropped_at_save"] == a[2]["rollout/carried_groups"]
    for step in (3, 4):  # same prompts, samples and updates: the carried groups were dropped at the save in both
        for key in ("reward/mean", "actor/pg_loss", "actor/grad_norm", "prompt/length_mean",
                    "rollout/partial_rounds", "rollout/staleness_mean"):
            assert b[step][key] == pytest.approx(a[step][key], rel=1e-6, abs=1e-9), (step, key)


def test_wait_trains_the_lengths_the_policy_writes_and_drop_trains_shorter_ones(tmp_path):
    """With a long tail of lengths (rollout.length_profile) the groups that go stale are the long ones:
    "wait" (the default) trains responses as long as a run without partial rollouts does, "drop" drops
    groups and trains shorter ones (docs/training.md, "Long-tailed response lengths"). A prompt's
    responses share the length it drew, so 4 a prompt (not 16) give the same lengths, drops and refills."""
    common = ["trainer.total_steps=20", "trainer.val_every=0", "data.val_files=[]", "trainer.tensorboard=false",
              "trainer.save_every=-1", "data.max_response_length=64", "rollout.n=4", "actor.micro_batch_size_per_gpu=8",
              'rollout.length_profile="lognormal:mean=12,sigma=0.9,cap=64"']
    partial = ["rollout.partial_rollouts=true", "rollout.partial_chunk_tokens=4", 'algorithm.rollout_is="token"']
    runs = {"sync": [], "wait": partial, "drop": [*partial, 'rollout.stale_policy="drop"']}
    lengths, dropped, refills = {}, {}, {}
    for name, extra in runs.items():
        run(torchrun_cmd(2, f"trainer.run_dir={tmp_path / name}", *common, *extra))
        m = read_metrics(tmp_path / name)
        lengths[name] = sum(m[s]["response/length_mean"] for s in range(5, 21)) / 16
        dropped[name] = sum(m[s].get("rollout/stale_dropped", 0) for s in range(1, 21))
        refills[name] = sum(m[s].get("rollout/partial_refills", 0) for s in range(1, 21))
    assert abs(lengths["wait"] - lengths["sync"]) < 0.15 * lengths["sync"] and dropped["wait"] == 0, (lengths, dropped)
    assert refills["wait"] > 0, refills  # the pool took new prompts while the step waited (partial_pool_batches)
    assert lengths["drop"] < 0.8 * lengths["sync"] and dropped["drop"] > 0, (lengths, dropped)
