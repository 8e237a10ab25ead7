"""An environment that holds a hidden digit and tells it to a model that asks: the smallest task
that needs more than one turn (`data.synthetic_task = "hidden"`, the multi-turn learning check).

Copy this file to write your own environment: `rollout.environment = "my_package.my_env:MyEnv"`.
One instance serves one trajectory; `reset` gets the data row, `step` each assistant message, and
returns the messages that follow it (any chat role the template renders: "user", "tool"), whether
the episode is over, and optionally its reward (the last reward given is the trajectory's; none:
the reward function scores the whole response).

The episode: a message that is one digit is the answer, and ends the episode with reward 1 when it
is the row's digit (ground_truth) and 0 otherwise. Any other message is a question: the first one is
answered with the digit on a new line, a second one ends the episode with reward 0. So a model that
has not learned anything yet mostly asks (few random turns are a lone digit), and what it must learn
is to repeat what the environment said, then to ask rather than guess. A model without the
environment's answer (rollout.max_turns = 1) can only guess: 0.1. (The multi-turn learning check
stops each turn at a digit or "?": rollout.stop_token_ids.)
"""

from __future__ import annotations

from typing import Any

from spmd_rl.rollout.multiturn import StepResult


class HiddenDigitEnv:
    def reset(self, row: dict[str, Any]) -> None:
        self.digit = str(row["ground_truth"]).strip()
        self.questions = 0  # state across turns: how often the model asked

    def step(self, message: dict[str, Any]) -> StepResult:
        text = message["content"].strip()
        if len(text) == 1 and text.isdigit():  # the answer
            return StepResult(messages=[], done=True, reward=float(text == self.digit))
        self.questions += 1
        if self.questions > 1:  # asked twice
            return StepResult(messages=[], done=True, reward=0.0)
        return StepResult(messages=[{"role": "tool", "content": "\n" + self.digit}], done=False, reward=0.0)
