"""Step metrics: TensorBoard, a JSON-lines file and a one-line console summary (rank 0 only).

Every name logged by the trainer is listed in docs/metrics.md.
"""

from __future__ import annotations

import json
import logging
import os
import time

log = logging.getLogger("spmd_rl")


def rank_reduction(key: str) -> str:
    """How a step metric combines over ranks: a memory figure is the fullest GPU's (the highest
    peak and device level, the least free memory, the smallest card), a `time/<phase>_max` the
    slowest rank's seconds, the rest (phase seconds included) the mean."""
    if key.startswith("memory/") and key.endswith(("_peak_gb", "_device_gb")):
        return "max"
    if key.startswith("time/") and key.endswith("_max"):
        return "max"
    if key in ("memory/free_after_sleep_gb", "memory/device_total_gb"):
        return "min"
    return "mean"


class MetricsLogger:
    def __init__(self, run_dir: str, enabled: bool, tensorboard: bool = True):
        self.enabled = enabled
        self.jsonl = os.path.join(run_dir, "metrics.jsonl")
        self.tb = None
        if enabled and tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(os.path.join(run_dir, "tensorboard"))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        if self.tb is not None:
            for k, v in metrics.items():
                self.tb.add_scalar(k, v, step)
            self.tb.flush()
        with open(self.jsonl, "a") as f:
            f.write(json.dumps({"step": step, "time": time.time(), **metrics}) + "\n")

    def log_text(self, tag: str, text: str) -> None:
        """`text` as a code block, TensorBoard text `tag` at step 0."""
        self.log_markdown(tag, "```\n" + text + "\n```", 0)

    def log_markdown(self, tag: str, markdown: str, step: int) -> None:
        if self.enabled and self.tb is not None:
            self.tb.add_text(tag, markdown, step)
            self.tb.flush()

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def summary_line(step: int, total: int, m: dict[str, float], pace: str = "") -> str:
    """The console line: the numbers one looks at while a run is going; `pace`, the seconds a step
    and the time left (telemetry.progress.StepClock), ends it."""

    def g(key: str, fmt: str = "{:.3f}") -> str:
        return fmt.format(m[key]) if key in m else "-"

    parts = [
        f"step {step}/{total}",
        f"reward {g('reward/mean')}±{g('reward/std', '{:.2f}')} acc {g('reward/acc')}",
        f"len {g('response/length_mean', '{:.1f}')}/{g('response/length_max', '{:.0f}')}",
        f"pg {g('actor/pg_loss', '{:.4f}')} clip {g('actor/clipfrac')} ent {g('actor/entropy')}",
    ]
    if "critic/vf_loss" in m:
        parts.append(f"vf {g('critic/vf_loss', '{:.4f}')}")
    if "actor/kl_loss" in m or "kl/reward_penalty" in m:
        parts.append(f"kl {g('actor/kl_loss', '{:.4f}') if 'actor/kl_loss' in m else g('kl/reward_penalty', '{:.4f}')}")
    parts.append(f"mismatch {g('rollout/logprob_diff_mean', '{:.1e}')}")
    parts.append(f"{g('time/step', '{:.2f}')}s (gen {g('time/generate', '{:.2f}')} "
                 f"sync {g('time/weight_sync', '{:.2f}')} upd {g('time/update_actor', '{:.2f}')})")
    parts.append(f"{g('perf/tokens_per_sec', '{:.0f}')} tok/s")
    if pace:
        parts.append(pace)
    return " | ".join(parts)
