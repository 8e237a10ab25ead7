"""One warning line when the reward function fails on more than a share of a training step's
responses (reward.on_error = "zero" scores them 0; the metric reward/errors counts them).

When it warns (the rule, stated once here): at the first step whose share of failed responses is
above reward.warn_error_share; after that, at a step above it whose share is at least twice the
share of the last warning, or that comes REPEAT_EVERY or more steps after the last warning.
"""

from __future__ import annotations

from spmd_rl.data.rewards import ScoringErrors

REPEAT_EVERY = 50
"""Steps after which a share still above reward.warn_error_share is warned about again."""


class RewardErrorWarning:
    def __init__(self, share: float):
        self.share = share  # reward.warn_error_share
        self.last: tuple[int, float] | None = None  # the step and share of the last warning

    def check(self, step: int, errors: ScoringErrors) -> str | None:
        """The warning line for this step's tally of failed responses, or None (the rule: module docstring)."""
        if not errors.responses or not errors.count:
            return None
        share = errors.count / errors.responses
        if share <= self.share:
            return None
        if self.last is not None:
            last_step, last_share = self.last
            if share < 2 * last_share and step - last_step < REPEAT_EVERY:
                return None
        self.last = (step, share)
        return (f"step {step}: the reward function failed on {errors.count} of {errors.responses} responses "
                f"({share:.1%}, above reward.warn_error_share = {self.share:g}), scored 0 (reward.on_error = \"zero\"); "
                f"the first: {errors.first}. Fix the reward function, or set reward.on_error = \"fail\" to stop at the "
                f"first failure. Said again when the share doubles, or after {REPEAT_EVERY} steps")
