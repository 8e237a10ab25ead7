"""The whole single-GPU path in one device call: every 1-GPU GPU test under tests/gpu, among them the
shipped 0.5B config at random weights of its shape with a checkpoint every step and a resume that
trains on (several asynchronous saves in one process: test_trainer_gpu's grpo-1gpu-shipped), PPO
with a critic (ppo-1gpu-packed-offload) and the Hugging Face export served by vLLM
(test_export_gpu). Prints one PASS/FAIL table, then the per-step seconds of the training runs.

    bash scripts/gpu_check.sh OUT            (the shell wrapper sets the environment)
    python scripts/gpu_check.py --out OUT [--budget-s 570] [--only NAME,...]

Each check runs as a subprocess under the time left of the budget; a check that cannot start in
time is NOT RUN, which fails the whole check like a FAIL. A test that skips itself on one GPU is
listed only when its reason is a second GPU (the 2-GPU layouts); any other skip is a FAIL: on a
GPU machine with the vLLM bundle every 1-GPU test must run. Exit status 0 only if all passed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from summarize_run import read_steps  # noqa: E402

WORK = Path(os.environ.get("GPU_CHECK_WORK", "/tmp/gpu_check"))


class Check:
    def __init__(self, name: str):
        self.name = name
        self.rows: list[tuple[str, str, float, str]] = []  # (item, PASS/FAIL/..., seconds, note)

    def add(self, item: str, result: str, seconds: float, note: str = "") -> None:
        self.rows.append((item, result, seconds, note))


def run(cmd: list[str], log: Path, timeout: float) -> tuple[int, float]:
    """Run `cmd` with output to `log`; (exit status, seconds). 124 when it ran past `timeout`."""
    t0 = time.time()
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = p.wait(timeout=max(timeout, 1))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, 9)
            p.wait()
            rc = 124
    return rc, time.time() - t0


def pytest_check(check: Check, files: list[str], out: Path, timeout: float) -> None:
    """pytest -m gpu over `files`; one row per test from its JUnit XML."""
    base = WORK / f"pytest-{check.name}"
    shutil.rmtree(base, ignore_errors=True)
    xml = WORK / f"{check.name}.xml"
    log = out / "pytest.log"
    part = WORK / f"{check.name}.log"
    rc, secs = run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider",
                    f"--basetemp={base}", f"--junitxml={xml}", *files], part, timeout)
    with open(log, "a") as f:
        f.write(f"===== {check.name}: {' '.join(files)} (exit {rc}, {secs:.0f}s)\n{part.read_text()}\n")
    shutil.rmtree(base, ignore_errors=True)  # run dirs hold multi-GB models and checkpoints
    if not xml.is_file():
        check.add(check.name, "FAIL", secs, f"pytest exit {rc}, no report" + (" (time limit)" if rc == 124 else ""))
        return
    for case in ET.parse(xml).getroot().iter("testcase"):
        name = f"{Path(case.get('file') or case.get('classname', '').replace('.', '/')).stem}::{case.get('name')}"
        t = float(case.get("time", 0))
        failure = case.find("failure") or case.find("error")
        skipped = case.find("skipped")
        if failure is not None:
            msg = (failure.get("message") or "").splitlines()[0][:100] if failure.get("message") else "failed"
            check.add(name, "FAIL", t, msg)
        elif skipped is not None:
            reason = skipped.get("message") or ""
            if "GPUs," in reason and "visible" in reason:  # a 2-GPU layout on one GPU
                check.add(name, "n/a", t, reason)
            else:
                check.add(name, "FAIL", t, f"skipped: {reason[:90]}")
        else:
            check.add(name, "PASS", t)
    if rc == 124:
        check.add(check.name, "FAIL", secs, "time limit reached (tests after it did not run)")


def step_table(out: Path) -> str:
    """Per-step seconds of the GPU tests' training runs (their metrics, kept in SPMD_RL_GPU_LOG_DIR)."""
    runs = {}
    logs = Path(os.environ["SPMD_RL_GPU_LOG_DIR"])
    for f in sorted(logs.glob("*.metrics.jsonl")) if logs.is_dir() else []:
        runs[f.name.split(".metrics")[0]] = f
    lines = ["| run | step s, each step | generate s | update_actor s | update_critic s | values s | checkpoint stall s |",
             "|---|---|---|---|---|---|---|"]
    for name, path in runs.items():
        rows = read_steps(str(path))
        stall = {}
        for line in path.read_text().splitlines():  # a save's stall is a row of its own
            row = json.loads(line)
            if "time/checkpoint" in row:
                stall[row["step"]] = row["time/checkpoint"]

        def col(key: str) -> str:
            vals = [r[key] for r in rows if key in r]
            return ", ".join(f"{v:.1f}" for v in vals) if vals else "-"
        lines.append(f"| {name} | {col('time/step')} | {col('time/generate')} | {col('time/update_actor')} | "
                     f"{col('time/update_critic')} | {col('time/values')} | "
                     f"{', '.join(f'{stall[k]:.1f}' for k in sorted(stall)) or '-'} |")
    steady = {}  # mean step seconds after step 1 (warm-up) of the first process of a run
    for name, path in runs.items():
        rows = [r for r in read_steps(str(path)) if 1 < r["step"] <= 3]
        if rows:
            steady[name] = sum(r["time/step"] for r in rows) / len(rows)
    if "ppo-1gpu-shipped" in steady and "grpo-1gpu-shipped" in steady:
        lines.append(f"\nPPO / GRPO step ratio on the shipped 0.5B work (steps 2-3): "
                     f"{steady['ppo-1gpu-shipped']:.2f} s / {steady['grpo-1gpu-shipped']:.2f} s = "
                     f"{steady['ppo-1gpu-shipped'] / steady['grpo-1gpu-shipped']:.2f}x")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget-s", type=float, default=570, help="wall-clock seconds for all checks")
    ap.add_argument("--only", default="", help="comma-separated check names (default: all)")
    ap.add_argument("--continue", dest="cont", action="store_true",
                    help="add to the results of an earlier call on the same machine (a check list split over "
                         "two calls), and print the table of both")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    WORK.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("SPMD_RL_GPU_LOG_DIR", str(WORK / "gpu_logs"))
    t_start = time.time()
    deadline = t_start + args.budget_s
    fused = ["tests/gpu/test_fused_gpu.py"] if (ROOT / "tests/gpu/test_fused_gpu.py").is_file() else []
    plan = [  # cheap and independent of vLLM first, then the runs that start engines
        ("kernels", 60, ["tests/gpu/test_checkpoint_gpu.py", "tests/gpu/test_offload_gpu.py",
                         "tests/gpu/test_sharded_init_gpu.py", "tests/gpu/test_packing_gpu.py", *fused]),
        ("trainer", 240, ["tests/gpu/test_trainer_gpu.py"]),  # the shipped config with saves and a resume, PPO
        ("export", 90, ["tests/gpu/test_export_gpu.py"]),
        ("colocate", 90, ["tests/gpu/test_colocate.py"]),
    ]
    only = set(filter(None, args.only.split(",")))
    checks = []
    for name, needs, files in plan:
        if only and name not in only:
            continue
        check = Check(name)
        checks.append(check)
        left = deadline - time.time()
        if left < needs:
            check.add(name, "NOT RUN", 0.0, f"{left:.0f}s of the budget left, it needs about {needs}s")
            continue
        t0 = time.time()
        try:
            pytest_check(check, files, out, left)
        except Exception as e:  # a broken check is a FAIL with its reason, the others still run
            check.add(name, "FAIL", time.time() - t0, f"{type(e).__name__}: {e}"[:120])
        print(f"[gpu_check] {name}: {time.time() - t0:.0f}s", flush=True)
    rows = [r for c in checks for r in c.rows]
    saved = WORK / "results.json"
    if args.cont and saved.is_file():
        earlier = json.loads(saved.read_text())
        rows = [tuple(r) for r in earlier["rows"]] + rows
        t_start -= earlier["seconds"]
    saved.write_text(json.dumps({"rows": rows, "seconds": time.time() - t_start}))
    failed = [r for r in rows if r[1] in ("FAIL", "NOT RUN")]
    width = max([len(r[0]) for r in rows] + [10])
    table = [f"{'check':<{width}} | result  | seconds | note", f"{'-' * width}-|---------|---------|-----"]
    table += [f"{item:<{width}} | {res:<7} | {secs:7.1f} | {note}" for item, res, secs, note in rows]
    table.append(f"{'TOTAL':<{width}} | {'FAIL' if failed else 'PASS':<7} | {time.time() - t_start:7.1f} | "
                 f"{sum(r[1] == 'PASS' for r in rows)} passed, {len(failed)} failed or not run")
    text = "\n".join(table) + "\n\nPer-step seconds:\n" + step_table(out) + "\n"
    (out / "gpu_check.txt").write_text(text)
    print(text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
