"""This task as an environment: rollout.environment = "examples/my_task/env.py:FirstDigitEnv" in
env.toml. One instance per trajectory: `reset` gets the data row, `step` each of the model's turns.

A right first answer earns 1. A wrong one gets the reply "no" and a second try, worth 0.5. The
environment gives every reward, so env.toml needs no reward.custom_function: a data_source without
a scorer is the environment's alone (a trajectory it gives no reward, one cut short by the length
limit, scores 0).
"""

from spmd_rl.rollout.multiturn import StepResult


class FirstDigitEnv:
    def reset(self, row: dict) -> None:
        self.answer = row["ground_truth"]
        self.tries = 0

    def step(self, message: dict) -> StepResult:
        self.tries += 1
        if message["content"].strip()[:1] == self.answer:
            return StepResult(messages=[], done=True, reward=1.0 if self.tries == 1 else 0.5)
        if self.tries == 1:
            return StepResult(messages=[{"role": "user", "content": "no"}], done=False, reward=0.0)
        return StepResult(messages=[], done=True, reward=0.0)
