"""Per-phase table of one or more training runs, from their metrics.jsonl (what docs/performance.md
records for full training steps).

    python scripts/summarize_run.py grpo-tp2=runs/a/metrics.jsonl ppo-tp2=runs/b/metrics.jsonl
    python scripts/summarize_run.py --details runs/a/metrics.jsonl     (and what the table leaves out)
    python scripts/summarize_run.py --scaling 1=runs/g1/metrics.jsonl 4=runs/g4/metrics.jsonl

Step 1 is a warm-up (CUDA graphs, allocator, AdamW's moments appear) and is left out of the
averages unless it is the only step; memory columns are maxima over all steps, and "free after
sleep" lists every step so a leak shows as a falling sequence. Memory figures are the fullest
GPU's (the trainer takes the highest over ranks, the least free memory: rank_reduction).

--details adds, per run: each phase's memory per GPU predicted at start-up (the `memory: predicted
peak per GPU` line of the trainer.log beside metrics.jsonl) against the measured, the seconds of
every step, the checkpoint stalls, each process's start-up and checkpoint load, and the weight sync
of every step.
--scaling prints weak scaling instead (NAME is the run's GPU count; its prompts per step are read
from the config.toml beside metrics.jsonl): step, generate (the ranks' mean and the slowest rank's, which
every rank waits for) and update seconds, efficiency t(1)/t(k).
--per-token prints the cost per trained token instead, for runs that train different tokens a step
(long-tailed lengths; partial rollouts against synchronous): over the steps after the first, the
response tokens trained, generate and step seconds per million of them, and each against the first
run's (the baseline); each step's generate seconds, and where logged the share of them after 90% of the
samples had finished (rollout/generate_tail_share), the engine's requests at once
(rollout/engine_max_running), its preemptions, the staleness, the batches of new prompts that joined the
run (rollout/partial_refills) and the carried tokens prefilled again (rollout/resumed_tokens, thousands).
A partial run's window also generates tokens it does not train and trains some it did not generate: the
tokens its groups carried into the window's first step (sampled before it) and out of its last (sampled in
it, trained after). Where rollout/carried_tokens is logged, "generated" counts the window's own: trained,
less those carried in, plus those carried out (a dropped group's tokens are not counted), and the generate
seconds per million of them.

    python scripts/summarize_run.py --per-token sync=a/metrics.jsonl partial=b/metrics.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

PHASES = ["wake", "weight_sync", "generate", "sleep", "offload", "reload", "reward", "balance", "old_logprob",
          "ref_logprob", "values", "adv", "update_critic", "update_actor", "step"]


def read_rows(path: str) -> list[dict]:
    """Every metrics row of a metrics.jsonl (steps, checkpoint stalls, start-ups, validations)."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def read_steps(path: str, rows: list[dict] | None = None) -> list[dict]:
    """Metrics rows of training steps, the last row per step (a resumed run may repeat a step);
    `rows`: the file's rows where already read."""
    by_step = {int(row["step"]): row for row in (read_rows(path) if rows is None else rows) if "time/step" in row}
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
                "rollout/mismatch_kl", "time/generate_max"):
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


def predicted_phases(log_text: str) -> tuple[dict[str, float], float | None]:
    """Each phase's predicted GiB per GPU and the card's GiB, from the last start-up memory line of a
    trainer.log (empty, None: no such line)."""
    lines = [ln for ln in log_text.splitlines() if "memory: predicted peak per GPU" in ln]
    if not lines:
        return {}, None
    line = lines[-1].rstrip()
    card = None
    if line.endswith(" GiB") and ") of " in line:
        line, _, of = line.rpartition(") of ")
        card = float(of.removesuffix(" GiB"))
    else:
        line = line.removesuffix(" (no GPU: not compared)").removesuffix(")")
    inner = line.split(" (", 1)[1]  # "actor update: params 5.3 + ... = 32.0; log-prob pass: ...; generation: ..."
    phases = {}
    for part in inner.split("; "):
        name, _, rest = part.partition(": ")
        phases[name] = float(rest.rpartition("= ")[2] if "=" in rest else rest)
    return phases, card


def measured_phases(rows: list[dict], plan_phases=()) -> dict[str, dict]:
    """Per phase of the start-up plan (`plan_phases`: its names, which tell whether the training state
    was offloaded): the highest driver-view level at the end of any of its step phases
    (memory/<phase>_device_gb, which phase) and the highest PyTorch peak, over all steps."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository's spmd_rl
    if root not in sys.path:
        sys.path.insert(0, root)
    from spmd_rl.preflight.memory import PLAN_PHASE, plan_phase

    out: dict[str, dict] = {}
    for row in rows:
        for step_phase in PLAN_PHASE:
            m = out.setdefault(plan_phase(step_phase, plan_phases), {"device": None, "at": None, "peak": None})
            dev, peak = row.get(f"memory/{step_phase}_device_gb"), row.get(f"memory/{step_phase}_peak_gb")
            if dev is not None and (m["device"] is None or dev > m["device"]):
                m["device"], m["at"] = dev, f"{step_phase}, step {row['step']}"
            if peak is not None and (m["peak"] is None or peak > m["peak"]):
                m["peak"] = peak
    return {k: v for k, v in out.items() if v["device"] is not None or v["peak"] is not None}


def details(path: str) -> str:
    """What the table leaves out of one run (module docstring, --details)."""
    every_row = read_rows(path)
    rows = read_steps(path, every_row)
    log_path = os.path.join(os.path.dirname(path), "trainer.log")
    predicted, card = predicted_phases(open(log_path).read() if os.path.isfile(log_path) else "")
    measured = measured_phases(rows, list(predicted))
    cards = f", {card:.1f} GiB cards" if card else ""
    out = [f"memory per GPU, predicted at start-up ({log_path}{cards}) against measured (the fullest GPU, highest "
           "step; device: driver view at the phase's end; PyTorch: its tensors' peak):",
           "| phase | predicted GiB | measured device GiB (where) | measured PyTorch peak GiB | device vs predicted |",
           "|---|---|---|---|---|"]
    for phase in [*predicted, *(p for p in measured if p not in predicted)]:
        pred, m = predicted.get(phase), measured.get(phase, {"device": None, "at": None, "peak": None})
        diff = f"{(m['device'] - pred) / pred:+.1%}" if pred and m["device"] is not None else "–"
        where = f" ({m['at']})" if m["at"] else ""
        out.append(f"| {phase} | {fmt(pred, '{:.1f}')} | {fmt(m['device'], '{:.1f}')}{where} | "
                   f"{fmt(m['peak'], '{:.1f}')} | {diff} |")
    stalls, starts = [], []
    for row in every_row:
        if "time/checkpoint" in row:
            parts = [f"{k.removeprefix('time/checkpoint_').replace('_', ' ')} {v:.1f}" for k, v in row.items()
                     if k.startswith("time/checkpoint_")]
            stalls.append(f"step {row['step']}: {row['time/checkpoint']:.1f} s"
                          + (f" ({', '.join(parts)})" if parts else ""))
        if "time/startup_total" in row:
            load = row.get("time/startup_checkpoint_load")
            starts.append(f"before step {row['step']}: {row['time/startup_total']:.1f} s"
                          + (f" (checkpoint load {load:.1f} s)" if load is not None else ""))
    out.append("step s (time/step), each step (a process's first one warms up): "
               + ", ".join(f"{r['step']}: {r['time/step']:.1f}" for r in rows))
    out.append("checkpoint stall (time/checkpoint): " + ("; ".join(stalls) or "no save"))
    out.append("process start-up (time/startup_total): " + ("; ".join(starts) or "–"))
    sync = [(r["step"], r["time/weight_sync"]) for r in rows if "time/weight_sync" in r]
    later = [v for s, v in sync[1:]]
    out.append("weight sync s (time/weight_sync), steps " + (", ".join(f"{s}: {v:.3f}" for s, v in sync) or "–")
               + (f"; mean after the first {statistics.fmean(later):.3f}" if later else ""))
    return "\n".join(out)


def scaling_table(runs: list[tuple[int, str]]) -> str:
    """Weak scaling (module docstring, --scaling): one row per GPU count, efficiency against 1 GPU."""
    import tomllib

    lines = ["| GPUs | prompts | steps | step s | generate s | generate s, slowest rank | update s | efficiency vs 1 GPU |",
             "|---|---|---|---|---|---|---|---|"]
    summaries = {gpus: summarize(read_steps(path)) for gpus, path in runs}
    one = summaries.get(1, {}).get("time/step")
    for gpus, path in sorted(runs):
        s, config = summaries[gpus], os.path.join(os.path.dirname(path), "config.toml")
        prompts = tomllib.load(open(config, "rb"))["data"]["train_batch_size"] if os.path.isfile(config) else None
        eff = one / s["time/step"] if one and s["time/step"] else None
        lines.append(f"| {gpus} | {prompts if prompts is not None else '–'} | {s['steps']} | {fmt(s['time/step'])} | "
                     f"{fmt(s['time/generate'])} | {fmt(s['time/generate_max'])} | {fmt(s['time/update_actor'])} | "
                     f"{fmt(eff, '{:.1%}')} |")
    return "\n".join(lines)


def per_token_table(runs: list[tuple[str, str]]) -> str:
    """The cost per trained token (module docstring, --per-token): one row per run, ratios against the first."""
    lines = ["| run | steps | trained tokens | generate s / M tokens | step s / M tokens | generated tokens "
             "(carried in / out, k) | generate s / M generated | generate s, each step | tail share, each step | "
             "vLLM at once | preempted | staleness mean | refills | resumed k tokens |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    base = None
    for i, (name, path) in enumerate(runs):
        rows = read_steps(path)
        steady = rows[1:] if len(rows) > 1 else rows
        tokens = sum(r.get("response/tokens", 0.0) for r in steady)
        if not tokens:
            raise SystemExit(f"{path}: no response/tokens in its steps")
        gen_s = sum(r.get("time/generate", 0.0) for r in steady)
        gen, step = gen_s / tokens * 1e6, sum(r["time/step"] for r in steady) / tokens * 1e6
        base = base or (gen, step)
        ratio = f" ({gen / base[0]:.2f}x, {step / base[1]:.2f}x)" if i else ""
        generated, own = f"{tokens:,.0f}", f"{gen:.1f}"
        if "rollout/carried_tokens" in steady[-1]:
            before = rows[0].get("rollout/carried_tokens", 0.0) if len(rows) > 1 else 0.0
            after = steady[-1]["rollout/carried_tokens"]
            window = tokens - before + after
            generated = f"{window:,.0f} ({before / 1e3:.0f} / {after / 1e3:.0f})"
            own = f"{gen_s / window * 1e6:.1f}" + (f" ({gen_s / window * 1e6 / base[0]:.2f}x)" if i else "")

        def seq(key, spec="{:.0f}", scale=1.0):
            vals = [spec.format(r[key] * scale) for r in steady if key in r]
            return ", ".join(vals) or "–"

        lines.append(f"| {name} | {steady[0]['step']}-{steady[-1]['step']} | {tokens:,.0f} | {gen:.1f} | {step:.1f}"
                     f"{ratio} | {generated} | {own} | {seq('time/generate', '{:.1f}')} | "
                     f"{seq('rollout/generate_tail_share', '{:.0%}')} | "
                     f"{seq('rollout/engine_max_running')} | {seq('rollout/engine_preempted')} | {seq('rollout/staleness_mean', '{:.2f}')} | "
                     f"{seq('rollout/partial_refills')} | {seq('rollout/resumed_tokens', scale=1e-3)} |")
    lines.append("(x: against the first run, generate and step)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="NAME=path/to/metrics.jsonl (or just the path)")
    ap.add_argument("--details", action="store_true", help="after the table, what it leaves out (see above)")
    ap.add_argument("--scaling", action="store_true", help="weak scaling: NAME is each run's GPU count")
    ap.add_argument("--per-token", action="store_true", help="the cost per trained token, against the first run")
    args = ap.parse_args(argv)
    specs = [spec.rpartition("=")[::2] for spec in args.runs]
    if args.per_token:
        print(per_token_table([(name or path, path) for name, path in specs]))
        return 0
    if args.scaling:
        print(scaling_table([(int(name), path) for name, path in specs]))
        return 0
    print(table([(name or path, summarize(read_steps(path))) for name, path in specs]))
    for name, path in specs if args.details else []:
        print(f"\n{name or path}:\n{details(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
