"""scripts/bench/bench_step.sh on CPU with a stand-in for torchrun: it reports the run's exit status and
steps, leaves no random weights in OUT (they are drawn again from the seed; a 7B shape's are 30 GB), and
with a length profile adds the run's per-token table (its generate tail)."""

from __future__ import annotations

import os
import subprocess

from tests.helpers import ROOT

BENCH_STEP = os.path.join(ROOT, "scripts", "bench", "bench_step.sh")

TORCHRUN = """#!/usr/bin/env bash
# stands in for torchrun: writes what a random-weight run leaves in its run directory, then fails
for a in "$@"; do case "$a" in trainer.run_dir=*) run=${a#trainer.run_dir=}; run=${run//\\"/} ;; esac; done
mkdir -p "$run/init_model" && echo weights > "$run/init_model/model.safetensors"
echo '{"step": 1, "time/step": 2.0, "time/generate": 1.0, "response/tokens": 100, "rollout/generate_tail_share": 0.5}' \
  > "$run/metrics.jsonl"
exit 3
"""


def bench_step(tmp_path, *overrides: str) -> str:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "torchrun").write_text(TORCHRUN)
    (bin_dir / "torchrun").chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    done = subprocess.run(["bash", BENCH_STEP, str(tmp_path / "out"), "qwen2-0.5b", "after", "1", *overrides],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    return done.stdout + done.stderr


def test_the_run_reports_its_exit_and_leaves_no_random_weights(tmp_path):
    out = bench_step(tmp_path)
    run = tmp_path / "out" / "step-qwen2-0.5b-after" / "run"
    assert "qwen2-0.5b after: exit 3 (1 steps;" in out, out
    assert (run / "metrics.jsonl").exists() and not (run / "init_model").exists()
    assert "tail share" not in out  # no length profile: every response the same length, no tail to show


def test_a_length_profile_adds_the_per_token_table_with_the_generate_tail(tmp_path):
    out = bench_step(tmp_path, 'rollout.length_profile="uniform:8"')
    assert "| tail share, each step |" in out and "| qwen2-0.5b-after | 1-1 | 100 |" in out and "| 50% |" in out, out
