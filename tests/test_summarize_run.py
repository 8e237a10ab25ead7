"""scripts/summarize_run.py: the per-phase table of a run's metrics.jsonl."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
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
