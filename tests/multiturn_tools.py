"""Tools and environments the multi-turn tests import by path (tests/ is on sys.path)."""

import time

from spmd_rl.rollout.multiturn import StepResult


def add(a: int, b: int) -> str:
    """Add two integers.

    Args:
        a: the first integer.
        b: the second integer.
    """
    return str(a + b)


def mul(a: int, b: int) -> str:
    """Multiply two integers.

    Args:
        a: the first integer.
        b: the second integer.
    """
    return str(a * b)


def explode(x: int) -> str:
    """Always fails.

    Args:
        x: anything.
    """
    raise ValueError("boom")


def slow(x: int) -> str:
    """Sleeps far past any test timeout.

    Args:
        x: anything.
    """
    time.sleep(3)
    return "late"


def junk(x: int) -> str:
    """Returns a number, not a string.

    Args:
        x: anything.
    """
    return 42


def untyped(x):
    """No type hint.

    Args:
        x: anything.
    """
    return "x"


NOT_CALLABLE = 3


class CountingEnv:
    """Answers turn k with "k" (state across turns); ends after the model's `row['extra_info']['turns']` turns."""

    def reset(self, row):
        self.turns = 0
        self.limit = row["extra_info"]["turns"]

    def step(self, message):
        self.turns += 1
        if self.turns >= self.limit:
            return StepResult([], done=True, reward=float(self.turns))
        return StepResult([{"role": "user", "content": str(self.turns)}], done=False)
