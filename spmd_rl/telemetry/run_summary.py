"""How a run ended, in a few lines (rank 0, at the end of Trainer.fit): its status and step, the
final and the best validation (by val/reward_mean, with its step), the response tokens trained
(the sum of response/tokens), the latest checkpoint, and how to see the curves and the samples.
Everything comes from <run_dir>/metrics.jsonl, so a second run of a finished run (which trains
nothing) prints the same summary, after a line saying so and how to train longer."""

from __future__ import annotations

import json
import os

STATUS = {
    "finished": "finished",
    "preempted": "stopped on a signal after its checkpoint (a restart continues)",
    "not saved": "stopped without its last checkpoint",
}
"""Trainer.fit's return value -> how the summary says it."""


def read_steps(path: str) -> dict[int, dict]:
    """step -> its metrics from a metrics.jsonl, merged over the step's records, the last record of
    a step winning (a resumed run logs again the steps after its checkpoint); {} without the file."""
    steps: dict[int, dict] = {}
    if not os.path.isfile(path):
        return steps
    with open(path) as f:
        for line in f:
            if line.strip():
                record = json.loads(line)
                steps.setdefault(int(record["step"]), {}).update(record)
    return steps


def already_finished(step: int, total: int) -> str:
    """The line of a run started again after its last step: there is nothing to train."""
    return (f"this run already finished: its checkpoint is at step {step} and trainer.total_steps = {total}, so "
            f"there is nothing to train; to train longer, raise trainer.total_steps (e.g. "
            f"trainer.total_steps={max(step, total) * 2}), or start a new run in another trainer.run_dir")


def summary(status: str, step: int, total: int, steps: dict[int, dict], checkpoint: str | None,
            tensorboard_dir: str | None, samples_file: str | None) -> str:
    """The end-of-run lines. `steps`: read_steps' metrics (only steps up to `step` count);
    `checkpoint`: the latest complete one or None; `tensorboard_dir`, `samples_file`: None where
    there are none."""
    steps = {s: m for s, m in steps.items() if s <= step}
    lines = [f"run {STATUS.get(status, status)} at step {step}/{total}", validation_line(steps)]
    trained = [m for s, m in steps.items() if s >= 1 and "reward/mean" in m]
    tokens = sum(m.get("response/tokens", 0) for m in trained)
    uncounted = sum("response/tokens" not in m for m in trained)
    lines.append(f"trained: {tokens:,.0f} response tokens over {len(trained)} steps"
                 + (f" ({uncounted} of them logged no response/tokens)" if uncounted else ""))
    lines.append(f"checkpoint: {checkpoint}" if checkpoint else "checkpoint: none")
    if tensorboard_dir:
        lines.append(f"curves: tensorboard --logdir {tensorboard_dir}")
    if samples_file:
        lines.append(f"samples: {samples_file}")
    return "\n  ".join(lines)


def validation_line(steps: dict[int, dict]) -> str:
    val = {s: m for s, m in sorted(steps.items()) if "val/reward_mean" in m}
    if not val:
        return "validation: none"
    last = max(val)
    best = max(val, key=lambda s: (val[s]["val/reward_mean"], -s))  # the earliest of equal bests

    def at(s: int) -> str:
        acc = f", acc {val[s]['val/acc']:.3f}" if "val/acc" in val[s] else ""
        return f"reward {val[s]['val/reward_mean']:.3f}{acc} at step {s}"

    return f"validation: final {at(last)}; best {at(best)}"
