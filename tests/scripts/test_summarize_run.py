"""scripts/summarize_run.py: the per-phase table of a run's metrics.jsonl."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT

REPO = Path(ROOT)
sys.path.insert(0, str(REPO / "scripts"))
import summarize_run  # noqa: E402


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_steady_means_skip_warmup_and_memory_is_max(tmp_path):
    rows = [
        {"step": 1, "time/step": 100.0, "time/generate": 50.0, "perf/tokens_per_sec_per_gpu": 1.0,
         "rollout/logprob_diff_mean": 0.5, "rollout/logprob_diff_max": 0.9,
         "memory/generate_peak_gb": 70.0, "memory/update_actor_peak_gb": 10.0, "memory/free_after_sleep_gb": 60.0},
        {"step": 2, "time/step": 4.0, "time/generate": 1.0, "perf/tokens_per_sec_per_gpu": 300.0,
         "rollout/logprob_diff_mean": 0.01, "rollout/logprob_diff_max": 0.05,
         "memory/generate_peak_gb": 20.0, "memory/update_actor_peak_gb": 30.0, "memory/free_after_sleep_gb": 55.0},
        {"step": 3, "time/step": 6.0, "time/generate": 2.0, "perf/tokens_per_sec_per_gpu": 500.0,
         "rollout/logprob_diff_mean": 0.03, "rollout/logprob_diff_max": 0.07,
         "memory/generate_peak_gb": 20.0, "memory/update_actor_peak_gb": 31.0, "memory/free_after_sleep_gb": 55.0},
        {"step": 3, "val/acc": 0.5},  # a validation row: not a training step
    ]
    s = summarize_run.summarize(summarize_run.read_steps(str(write_rows(tmp_path / "m.jsonl", rows))))
    assert s["steps"] == 3
    assert s["time/step"] == pytest.approx(5.0) and s["time/generate"] == pytest.approx(1.5)
    assert s["perf/tokens_per_sec_per_gpu"] == pytest.approx(400.0)
    assert s["rollout/logprob_diff_mean"] == pytest.approx(0.02)
    assert s["rollout/logprob_diff_max"] == pytest.approx(0.9)  # worst over every step, warm-up included
    assert (s["peak_phase"], s["peak_gb"]) == ("memory/generate_peak_gb", 70.0)
    assert s["free_after_sleep_gb"] == [60.0, 55.0, 55.0]
    assert s["time/update_critic"] is None


def test_resumed_run_keeps_last_row_per_step_and_cli_prints_table(tmp_path):
    rows = [{"step": 1, "time/step": 9.0}, {"step": 2, "time/step": 9.0}, {"step": 2, "time/step": 3.0},
            {"step": 3, "time/step": 5.0}]
    path = write_rows(tmp_path / "m.jsonl", rows)
    assert [r["time/step"] for r in summarize_run.read_steps(str(path))] == [9.0, 3.0, 5.0]
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "summarize_run.py"), f"grpo={path}"],
                         capture_output=True, text=True, check=True).stdout
    header, _, row = out.strip().splitlines()
    assert "step s" in header and row.startswith("| grpo | 3 |") and "| 4.000 |" in row


def test_run_without_steps_is_an_error(tmp_path):
    path = write_rows(tmp_path / "m.jsonl", [{"step": 0, "val/acc": 0.1}])
    with pytest.raises(SystemExit, match="no training steps"):
        summarize_run.read_steps(str(path))


def test_runs_with_and_without_the_old_logprob_pass_share_a_table(tmp_path):
    """An on-policy run logs no time/old_logprob (spmd_rl/train/old_logprobs.py): its cell is "–", the
    other run's column stays."""
    with_pass = write_rows(tmp_path / "a.jsonl", [{"step": s, "time/step": 5.0, "time/old_logprob": 1.0}
                                                  for s in (1, 2)])
    shortcut = write_rows(tmp_path / "b.jsonl", [{"step": s, "time/step": 4.0} for s in (1, 2)])
    named = [(n, summarize_run.summarize(summarize_run.read_steps(str(p)))) for n, p in
             (("pass", with_pass), ("shortcut", shortcut))]
    header, _, row_pass, row_short = summarize_run.table(named).splitlines()
    col = header.split(" | ").index("old_logprob s")
    assert row_pass.split(" | ")[col] == "1.000" and row_short.split(" | ")[col] == "–"
    only_shortcut = summarize_run.table(named[1:])
    assert "old_logprob" not in only_shortcut and "| 4.000 |" in only_shortcut


def shipped_7b_line(gpus: int, tmp_path, *overrides: str) -> tuple[str, dict[str, float]]:
    """The start-up memory line of configs/qwen7b.toml (with `overrides`) on `gpus` 80 GB cards, as the
    trainer logs it, and its phases' GiB."""
    from spmd_rl.config.run_config import load_config
    from spmd_rl.preflight.memory import plan_for

    cfg = load_config(str(REPO / "configs" / "qwen7b.toml"), ['model.init="random"', 'model.arch="qwen2-7b"',
                                                              'model.path=""', f'trainer.run_dir="{tmp_path}"',
                                                              *overrides])
    plan = plan_for(cfg, gpus, 79.2 * 2**30)
    return plan.line(), {p.name: round(p.total / 2**30, 1) for p in plan.phases}


def test_details_predicted_against_measured_stall_startup_and_sync(tmp_path):
    """--details: the phases of the trainer.log's start-up line (the real line of the shipped 7B preset) beside
    the measured levels of their step phases, each save's stall, each process's start-up, every weight sync."""
    line, phases = shipped_7b_line(8, tmp_path)
    assert summarize_run.predicted_phases(f"12:00:01 [r0] INFO spmd_rl: {line}\nother\n") == (phases, 79.2)
    assert summarize_run.predicted_phases("nothing here") == ({}, None)
    (tmp_path / "trainer.log").write_text(f"12:00:00 [r0] INFO spmd_rl: start\n12:00:01 [r0] INFO spmd_rl: {line}\n")
    rows = [{"step": s, "time/step": 90.0, "time/weight_sync": 0.1 + s / 100, "memory/generate_device_gb": 50.0 + s,
             "memory/wake_device_gb": 40.0, "memory/generate_peak_gb": 9.0, "memory/update_actor_device_gb": 30.0,
             "memory/update_actor_peak_gb": 25.0 + s} for s in range(1, 8)]
    rows[0]["time/startup_total"] = 150.0
    rows[5].update({"time/startup_total": 120.0, "time/startup_checkpoint_load": 40.5})
    rows.insert(5, {"step": 5, "time/checkpoint": 41.8})
    write_rows(tmp_path / "metrics.jsonl", rows)
    out = summarize_run.details(str(tmp_path / "metrics.jsonl"))
    assert f"| generation | {phases['generation']:.1f} | 57.0 (generate, step 7) | 9.0 | " in out, out
    assert f"| actor update | {phases['actor update']:.1f} | 30.0 (update_actor, step 1) | 32.0 | " in out, out
    assert f"| log-prob pass | {phases['log-prob pass']:.1f} | – | – | – |" in out, out
    assert "each step (a process's first one warms up): 1: 90.0, 2: 90.0, " in out and ", 7: 90.0\n" in out
    assert "checkpoint stall (time/checkpoint): step 5: 41.8 s\n" in out
    assert "before step 1: 150.0 s; before step 6: 120.0 s (checkpoint load 40.5 s)" in out
    assert "steps 1: 0.110, 2: 0.120" in out and "mean after the first 0.145" in out
    cli = subprocess.run([sys.executable, str(REPO / "scripts" / "summarize_run.py"), "--details",
                          f"qwen7b={tmp_path / 'metrics.jsonl'}"],
                         capture_output=True, text=True, check=True).stdout
    assert cli.startswith("| run |") and "\nqwen7b:\nmemory per GPU, predicted at start-up" in cli and out in cli


def test_details_with_offload_sets_the_weight_sync_beside_its_own_prediction(tmp_path):
    """With rollout.offload_train_states the plan predicts the weight sync (training state and the engine's
    weights) apart from generation (the engine alone): the weight sync, offload and reload levels go to the
    first, the rest of the rollout to the second. Before, the weight sync's level (the 7B PPO run on four
    GPUs: 60.8 GiB) was set against generation's 43.8 as +39%."""
    line, phases = shipped_7b_line(2, tmp_path, "rollout.offload_train_states=true")
    assert set(phases) >= {"generation", "weight sync"} and phases["weight sync"] > phases["generation"] + 10
    (tmp_path / "trainer.log").write_text(f"12:00:01 [r0] INFO spmd_rl: {line}\n")
    rows = [{"step": s, "time/step": 20.0, "memory/wake_device_gb": 44.0, "memory/weight_sync_device_gb": 60.0 + s,
             "memory/weight_sync_peak_gb": 50.0, "memory/offload_device_gb": 55.0, "memory/generate_device_gb": 45.0,
             "memory/generate_peak_gb": 46.0 + s, "memory/reload_device_gb": 52.0, "memory/reload_peak_gb": 47.0}
            for s in (1, 2)]
    write_rows(tmp_path / "metrics.jsonl", rows)
    out = summarize_run.details(str(tmp_path / "metrics.jsonl"))
    sync, gen = phases["weight sync"], phases["generation"]
    assert f"| weight sync | {sync:.1f} | 62.0 (weight_sync, step 2) | 50.0 | {(62.0 - sync) / sync:+.1%} |" in out, out
    assert f"| generation | {gen:.1f} | 45.0 (generate, step 1) | 48.0 | {(45.0 - gen) / gen:+.1%} |" in out, out


def test_scaling_table_efficiency_against_one_gpu(tmp_path):
    """--scaling: one row per GPU count (sorted), prompts from the config.toml beside the metrics, steady step
    means (generation: the ranks' mean and the slowest rank's), t(1)/t(k)."""
    specs = []
    for k, step in ((4, 12.5), (1, 10.0), (2, 11.0)):
        run = tmp_path / f"gpus{k}"
        run.mkdir()
        (run / "config.toml").write_text(f"[data]\ntrain_batch_size = {64 * k}\n")
        write_rows(run / "metrics.jsonl", [{"step": 1, "time/step": 60.0, "time/generate": 30.0},
                                           {"step": 2, "time/step": step, "time/generate": 6.0,
                                            "time/generate_max": 6.0 + step - 10.0, "time/update_actor": 4.0}])
        specs.append(f"{k}={run / 'metrics.jsonl'}")
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "summarize_run.py"), "--scaling", *specs],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[2:] == ["| 1 | 64 | 2 | 10.000 | 6.000 | 6.000 | 4.000 | 100.0% |",
                       "| 2 | 128 | 2 | 11.000 | 6.000 | 7.000 | 4.000 | 90.9% |",
                       "| 4 | 256 | 2 | 12.500 | 6.000 | 8.500 | 4.000 | 80.0% |"], out


def test_per_token_costs_against_the_first_run(tmp_path):
    """Runs that train different tokens a step compare per trained token, steps after the first only."""
    sync = write_rows(tmp_path / "sync.jsonl", [
        {"step": 1, "time/step": 500.0, "time/generate": 400.0, "response/tokens": 9.0},  # warm-up: left out
        {"step": 2, "time/step": 60.0, "time/generate": 40.0, "response/tokens": 200_000.0,
         "rollout/generate_tail_share": 0.25},
        {"step": 3, "time/step": 90.0, "time/generate": 70.0, "response/tokens": 300_000.0,
         "rollout/generate_tail_share": 0.404}])
    partial = write_rows(tmp_path / "partial.jsonl", [
        {"step": 1, "time/step": 50.0, "time/generate": 30.0, "response/tokens": 250_000.0,
         "rollout/carried_tokens": 100_000.0},  # sampled before the window, trained in it
        {"step": 2, "time/step": 45.0, "time/generate": 25.0, "response/tokens": 250_000.0,
         "rollout/engine_max_running": 512.0, "rollout/engine_preempted": 3.0, "rollout/staleness_mean": 0.5},
        {"step": 3, "time/step": 55.0, "time/generate": 30.0, "response/tokens": 250_000.0,
         "rollout/engine_max_running": 400.0, "rollout/engine_preempted": 0.0, "rollout/staleness_mean": 0.75,
         "rollout/partial_refills": 1.0, "rollout/resumed_tokens": 81_400.0, "rollout/carried_tokens": 150_000.0}])
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "summarize_run.py"), "--per-token", f"sync={sync}",
                          f"partial={partial}"], capture_output=True, text=True, check=True).stdout.splitlines()
    # 110 s, 150 s / 0.5 M; nothing carried: what it generated is what it trained
    assert out[2] == "| sync | 2-3 | 500,000 | 220.0 | 300.0 | 500,000 | 220.0 | 40.0, 70.0 | 25%, 40% | – | – | – | – | – |"
    # 55 s and 100 s over 0.5 M tokens: 110 and 200 s / M, 0.50x and 0.67x the synchronous run's; the window
    # generated 0.5 M - 0.1 M carried in + 0.15 M carried out = 0.55 M: 55 s / 0.55 M = 100 s / M, 0.45x
    assert out[3] == ("| partial | 2-3 | 500,000 | 110.0 | 200.0 (0.50x, 0.67x) | 550,000 (100 / 150) | 100.0 (0.45x) | "
                      "25.0, 30.0 | – | 512, 400 | 3, 0 | 0.50, 0.75 | 1 | 81 |")
