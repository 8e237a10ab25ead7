"""Per-phase table of one or more training runs, from their metrics.jsonl (what docs/performance.md
records for full training steps).

    python scripts/summarize_run.py grpo-tp2=runs/a/metrics.jsonl ppo-tp2=runs/b/metrics.jsonl

Step 1 is a warm-up (CUDA graphs, allocator, AdamW's moments appear) and is left out of the
averages unless it is the only step; memory columns are maxima over all steps, and "free after
sleep" lists every step so a leak shows as a falling sequence.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

PHASES = ["wake", "weight_sync", "generate", "sleep", "offload", "reload", "reward", "balance", "old_logprob",
          "ref_logprob", "values", "adv", "update_critic", "update_actor", "step"]


def read_steps(path: str) -> list[dict]:
    """Metrics rows of training steps, the last row per step (a resumed run may repeat a step)."""
    by_step: dict[int, dict] = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                if "time/step" in row:
                    by_step[int(row["step"])] = row
    if not by_step:
        raise SystemExit(f"{path}: no training steps (no 'time/step' rows)")
    return [by_step[s] for s in sorted(by_step)]


def summarize(rows: list[dict]) -> dict:
    """Means over the steady steps (all but the first), maxima of memory over all steps."""
    steady = rows[1:] if len(rows) > 1 else rows

    def mean(key: str) -> float | None:
        vals = [r[key] for r in steady if key in r]
        return statistics.fmean(vals) if vals else None

    out: dict = {"steps": len(rows)}
    for phase in PHASES:
        out[f"time/{phase}"] = mean(f"time/{phase}")
    for key in ("perf/tokens_per_sec_per_gpu", "perf/mfu_update_actor", "rollout/logprob_diff_mean",
                "rollout/mismatch_kl"):
        out[key] = mean(key)
    diff_max = [r["rollout/logprob_diff_max"] for r in rows if "rollout/logprob_diff_max" in r]
    out["rollout/logprob_diff_max"] = max(diff_max) if diff_max else None
    peaks = {k: max(r[k] for r in rows if k in r) for k in sorted({k for r in rows for k in r})
             if k.startswith("memory/") and k.endswith("_peak_gb")}
    out["peak_phase"], out["peak_gb"] = max(peaks.items(), key=lambda kv: kv[1]) if peaks else (None, None)
    out["free_after_sleep_gb"] = [r["memory/free_after_sleep_gb"] for r in rows if "memory/free_after_sleep_gb" in r]
    return out


def fmt(v, spec: str = "{:.3f}") -> str:
    return "–" if v is None else spec.format(v)


def table(named: list[tuple[str, dict]]) -> str:
    phases = [p for p in PHASES if any(s[f"time/{p}"] is not None for _, s in named)]
    head = ["run", "steps", *[f"{p} s" for p in phases], "tok/s/GPU", "MFU upd", "mismatch mean / max",
            "peak GiB (phase)", "free after sleep GiB"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, s in named:
        cells = [name, str(s["steps"]), *[fmt(s[f"time/{p}"]) for p in phases],
                 fmt(s["perf/tokens_per_sec_per_gpu"], "{:.0f}"), fmt(s["perf/mfu_update_actor"], "{:.1%}"),
                 f"{fmt(s['rollout/logprob_diff_mean'])} / {fmt(s['rollout/logprob_diff_max'])}",
                 f"{fmt(s['peak_gb'], '{:.1f}')} ({(s['peak_phase'] or '–').removeprefix('memory/').removesuffix('_peak_gb')})",
                 ", ".join(f"{x:.1f}" for x in s["free_after_sleep_gb"]) or "–"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="NAME=path/to/metrics.jsonl (or just the path)")
    args = ap.parse_args(argv)
    named = []
    for spec in args.runs:
        name, _, path = spec.rpartition("=")
        named.append((name or path, summarize(read_steps(path))))
    print(table(named))
    return 0


if __name__ == "__main__":
    sys.exit(main())
