"""What a run reports about itself (spmd_rl/telemetry/): the time left on the step line (a fake
clock), the end-of-run summary from metrics.jsonl, and the warning on a share of failed scorings."""

import json

from spmd_rl.config.reward import RewardConfig
from spmd_rl.data.rewards import RewardFunction, ScoringErrors
from spmd_rl.telemetry import progress, run_summary
from spmd_rl.telemetry.metrics import summary_line
from spmd_rl.telemetry.progress import StepClock
from spmd_rl.telemetry.reward_errors import REPEAT_EVERY, RewardErrorWarning


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_time_left_is_the_mean_of_the_last_steps_times_the_steps_left():
    clock = FakeClock()
    c = StepClock(clock)
    c.start()
    assert c.pace(0, 80) == ""
    times = [30.0] + [1.0] * 9 + [2.0] * 5  # a slow first step, then a change of pace
    for step, dt in enumerate(times, 1):
        clock.now += dt
        c.tick()
        window = times[max(0, step - progress.WINDOW):step]
        mean = sum(window) / len(window)
        left = (80 - step) * mean
        assert c.pace(step, 80) == f"{mean:.3g} s/step, ~{progress.duration(left)} left", step
    # the last 10 steps: five of 1 s, five of 2 s -> 1.5 s/step, 65 steps left
    assert c.pace(15, 80) == "1.5 s/step, ~98 s left"
    assert c.pace(80, 80) == "1.5 s/step"
    assert [progress.duration(s) for s in (0.4, 59.4, 150, 5999, 6000, 12240)] == ["1 s", "60 s", "2 min", "100 min", "1.7 h", "3.4 h"]
    assert summary_line(31, 80, {}, "1.2 s/step, ~59 s left").endswith("| 1.2 s/step, ~59 s left")


def write_metrics(path, records):
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def test_summary_reads_final_best_validation_and_tokens_from_metrics_jsonl(tmp_path):
    path = tmp_path / "metrics.jsonl"
    write_metrics(path, [
        {"step": 0, "val/reward_mean": 0.1, "val/acc": 0.1},
        {"step": 1, "reward/mean": 0.1, "response/tokens": 100},
        {"step": 2, "reward/mean": 0.2, "response/tokens": 120, "val/reward_mean": 0.6, "val/acc": 0.5},
        {"step": 3, "reward/mean": 0.3, "response/tokens": 999},  # a killed run's step 3, logged again below
        {"step": 3, "reward/mean": 0.3, "response/tokens": 130},
        {"step": 3, "time/checkpoint": 0.5, "val/reward_mean": 0.6, "val/acc": 0.55},  # as good as step 2's: not best
        {"step": 4, "reward/mean": 0.3, "response/tokens": 140, "val/reward_mean": 0.4, "val/acc": 0.45},
        {"step": 5, "reward/mean": 0.3, "response/tokens": 150, "val/reward_mean": 0.9},  # beyond the run's step
    ])
    steps = run_summary.read_steps(str(path))
    assert steps[3]["response/tokens"] == 130 and steps[3]["time/checkpoint"] == 0.5
    text = run_summary.summary("finished", 4, 4, steps, "/r/checkpoints/step_4", "/r/tensorboard", "/r/samples.jsonl")
    assert text.split("\n  ") == [
        "run finished at step 4/4",
        "validation: final reward 0.400, acc 0.450 at step 4; best reward 0.600, acc 0.500 at step 2",
        f"trained: {100 + 120 + 130 + 140} response tokens over 4 steps",
        "checkpoint: /r/checkpoints/step_4",
        "curves: tensorboard --logdir /r/tensorboard",
        "samples: /r/samples.jsonl",
    ]
    bare = run_summary.summary("preempted", 1, 4, {1: {"reward/mean": 0.1}}, None, None, None)
    assert bare.split("\n  ") == ["run stopped on a signal after its checkpoint (a restart continues) at step 1/4",
                                  "validation: none", "trained: 0 response tokens over 1 steps (1 of them logged no "
                                  "response/tokens)", "checkpoint: none"]
    assert run_summary.read_steps(str(tmp_path / "none.jsonl")) == {}
    line = run_summary.already_finished(80, 80)
    assert "already finished" in line and "trainer.total_steps=160" in line


def test_reward_error_warning_first_time_then_when_it_doubles_or_after_a_while():
    w = RewardErrorWarning(0.05)
    first = "reward function m:f failed on data_source 's', row 3 (KeyError: 'a') for the response 'x'"
    said = {}
    for step, (count, n) in enumerate([(0, 64), (3, 64), (6, 64), (7, 64), (12, 64), (13, 64), (4, 64)], 1):
        said[step] = w.check(step, ScoringErrors(count, n, first if count else None))
    # 3/64 = 4.7% is under 5%; 6/64 the first above; 7 and 13 (< twice the last warned) are not said again
    assert [s for s, line in said.items() if line] == [3, 5]
    assert said[3] == ("step 3: the reward function failed on 6 of 64 responses (9.4%, above reward.warn_error_share "
                       f"= 0.05), scored 0 (reward.on_error = \"zero\"); the first: {first}. Fix the reward function, "
                       "or set reward.on_error = \"fail\" to stop at the first failure. Said again when the share "
                       f"doubles, or after {REPEAT_EVERY} steps")
    assert w.check(5 + REPEAT_EVERY - 1, ScoringErrors(13, 64, first)) is None
    assert w.check(5 + REPEAT_EVERY, ScoringErrors(13, 64, first)) is not None
    assert RewardErrorWarning(1.0).check(1, ScoringErrors(64, 64, first)) is None
    assert RewardErrorWarning(0.0).check(1, ScoringErrors(1, 64, first)) is not None


def test_the_reward_function_tallies_failures_responses_and_the_first_error(tmp_path):
    f = tmp_path / "r.py"
    f.write_text("def score(s, response, gt, info):\n    return {'score': int(response)}\n")
    fn = RewardFunction(RewardConfig(custom_function=f"{f}:score", on_error="zero"), defer_errors=True)
    fn(["s"] * 3, ["1", "x", "y"], ["1"] * 3, None, [10, 11, 12])
    fn(["s"], ["z"], ["1"], None, [13])
    tally = fn.sync_failures()
    assert tally[:2] == (3, 4)
    assert tally.first.startswith(f"reward function {f}:score failed on data_source 's', row 11 (ValueError: ")
    assert "reward.on_error" not in tally.first  # the warning gives the fix for on_error = "zero"
    assert fn.sync_failures() == ScoringErrors(0, 0, None)

