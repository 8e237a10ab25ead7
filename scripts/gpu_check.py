"""The GPU path in one table: the shipped presets as shipped (3 steps, a checkpoint, a resume), the
learning check, sequence parallelism, PPO with a critic, the kernels, the export and the
colocation checks, run over every GPU the machine has. Prints one PASS/FAIL table with the GPUs
that ran each row, then the training runs' per-step seconds.

    bash scripts/gpu_check.sh OUT [options]      (the shell wrapper sets the environment)
    python scripts/gpu_check.py --out OUT [--budget-s 560] [--only NAME,...] [--continue] [--plan]

Scheduling (`schedule`). Each check of PLAN is a pytest subprocess with CUDA_VISIBLE_DEVICES set to
its GPUs, its own work directory (--basetemp, logs under gpu_logs/<check>) and the vLLM compile
cache of its GPUs (VLLM_CACHE_ROOT per GPU set, reused by the next check there). Checks start in
PLAN order as soon as their GPUs are free: a 1-GPU check takes any free GPU (the 1-GPU checks run
side by side, one per GPU); a check of more GPUs waits for all of them, and no check after it in
PLAN starts before it. A `small` check (a tiny model with a fixed small KV cache) takes no GPU for
itself: it runs beside the others on the GPU(s) least loaded with small checks. A check that needs
more GPUs than the machine has is n/a; a check that cannot start with its expected seconds left in
the budget is NOT RUN, which fails the whole check like a FAIL; a running check is stopped at the
budget's end. Exit status 0 only if every check that could run passed.

On 2xH200 the whole PLAN takes about 27 minutes (the expected seconds below; measured on
2026-11-23: preset-7b 405 s, preset-0.5b 312 s, preset-1.5b over 370 s, learning-1gpu 70 s, the
learning-2gpu pair 60 s; the rest from earlier runs and estimates). Each preset starts vLLM with
CUDA graphs twice (33-68 s each) and compiles its layers twice (22-36 s), and the 7B one writes and
reads an 86 GB checkpoint (40 s each way). That is more than one device call (10 minutes): run it
as calls on one warm machine, each with --budget-s inside the call's limit:
`--only preset-7b` (~420 s), `--only learning-1gpu,learning-2gpu,preset-long,ulysses --continue`
(~390 s), `--only preset-0.5b,preset-1.5b,kernels --continue` (~450 s), `--only
ppo,export,colocate,offload --continue` (~280 s), `--only multiturn-learning,preset-0.5b-tool --continue`
(~340 s: multi-turn rollouts, the learning check beside the calculator preset); each --continue call
prints the table of all so far. On one GPU, the same calls: the 2-GPU checks show n/a.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from summarize_run import read_steps  # noqa: E402

WORK = Path(os.environ.get("GPU_CHECK_WORK", "/tmp/gpu_check"))
PRESET_TEST = "tests/gpu/test_presets_gpu.py::test_preset_trains_saves_and_resumes"
TRAINER_TEST = "tests/gpu/test_trainer_gpu.py::test_training_steps_with_vllm"
LEARNING_TEST = "tests/gpu/test_learning_gpu.py::test_learns"
MULTITURN_TEST = "tests/gpu/test_multiturn_learning_gpu.py::test_learns_a_task_that_needs_the_environment"


@dataclass(frozen=True)
class Check:
    name: str
    """What --only names."""
    targets: tuple[str, ...]
    """pytest node ids or files."""
    gpus: int = 1
    """GPUs it needs (of one host)."""
    secs: float = 60.0
    """Expected seconds on an H200 (the schedule printed at start; a check starts only if this much
    of the budget is left)."""
    small: bool = False
    """A tiny model with a fixed small KV cache: runs beside other checks on their GPUs."""
    alone: bool = False
    """Needs its GPUs' whole memory: no small check runs beside it (qwen7b on two GPUs)."""
    env: tuple[tuple[str, str], ...] = ()
    """Extra environment of its pytest."""
    archs: tuple[str, ...] = ()
    """Random-weight model directories it reads (tests/gpu/runs.py builds them in the background
    at the start, on the CPU)."""


PLAN: list[Check] = [  # order = priority (the docstring's rules)
    Check("preset-7b", (f"{PRESET_TEST}[qwen7b]",), gpus=2, secs=420, alone=True),  # its model: drawn on its GPUs
    Check("learning-1gpu", (f"{LEARNING_TEST}[1gpu]",), secs=80, small=True),
    Check("learning-2gpu", (f"{LEARNING_TEST}[2gpu]",), gpus=2, secs=70, small=True),
    Check("preset-long", (f"{PRESET_TEST}[qwen1.5b-long]",), gpus=2, secs=240, archs=("qwen2-1.5b",)),
    Check("ulysses", ("tests/gpu/test_ulysses_gpu.py",), gpus=2, secs=150),
    Check("preset-0.5b", (f"{PRESET_TEST}[qwen0.5b-gsm8k]",), secs=320, archs=("qwen2-0.5b",)),
    Check("preset-1.5b", (f"{PRESET_TEST}[qwen1.5b-gsm8k]",), secs=450, archs=("qwen2-1.5b",)),
    Check("multiturn-learning", (MULTITURN_TEST,), secs=150, small=True),
    Check("preset-0.5b-tool", (f"{PRESET_TEST}[qwen0.5b-gsm8k-tool]",), secs=330, archs=("qwen2-0.5b",)),
    Check("kernels", ("tests/gpu/test_checkpoint_gpu.py", "tests/gpu/test_offload_gpu.py",
                      "tests/gpu/test_sharded_init_gpu.py", "tests/gpu/test_packing_gpu.py",
                      "tests/gpu/test_fused_gpu.py"), secs=90),
    Check("ppo", (f"{TRAINER_TEST}[ppo-1gpu-shipped]",), secs=150, archs=("qwen2-0.5b",)),
    Check("export", ("tests/gpu/test_export_gpu.py",), secs=90),
    Check("colocate", ("tests/gpu/test_colocate.py",), secs=90, env=(("SPMD_RL_GPU_LAYOUTS", "0.5b-tp1"),)),
    Check("offload", (f"{TRAINER_TEST}[grpo-1gpu-tp1-offload]",), secs=100),
]


@dataclass
class Row:
    item: str
    result: str  # PASS, FAIL, n/a, NOT RUN
    seconds: float
    gpus: str = "-"
    note: str = ""


@dataclass
class Slot:
    """A check placed on GPUs (what `schedule` hands the runner)."""
    check: Check
    gpus: tuple[int, ...]
    started: float = 0.0
    rows: list[Row] = field(default_factory=list)
    thread: threading.Thread | None = None


Runner = Callable[[Check, tuple[int, ...], float], list[Row]]
"""runner(check, GPU indices, seconds it may take) -> its rows."""


def schedule(checks: list[Check], n_gpus: int, budget_s: float, runner: Runner, poll_s: float = 0.5,
             clock: Callable[[], float] = time.monotonic, say: Callable[[str], None] = print) -> list[Row]:
    """Run `checks` over `n_gpus` GPUs under `budget_s` seconds (the module's docstring); rows in
    PLAN order."""
    start = clock()
    deadline = start + budget_s
    results: dict[int, list[Row]] = {}
    pending = []
    for i, c in enumerate(checks):
        if c.gpus > n_gpus:
            results[i] = [Row(c.name, "n/a", 0.0, "-", f"needs {c.gpus} GPUs, {n_gpus} visible")]
        else:
            pending.append(i)
    busy: dict[int, int] = {}  # GPU -> index of the big check on it
    small_load = [0] * max(n_gpus, 1)
    running: dict[int, Slot] = {}

    def launch(i: int, gpus: tuple[int, ...]) -> None:
        slot = Slot(checks[i], gpus, clock())
        left = deadline - clock()

        def work() -> None:
            try:
                slot.rows = runner(slot.check, gpus, left)
            except Exception as e:  # a broken check is a FAIL with its reason; the others go on
                slot.rows = [Row(slot.check.name, "FAIL", clock() - slot.started, _label(gpus),
                                 f"{type(e).__name__}: {e}"[:120])]

        slot.thread = threading.Thread(target=work, daemon=True)
        running[i] = slot
        say(f"[gpu_check] {checks[i].name}: started on GPU {_label(gpus)} at {clock() - start:.0f}s")
        slot.thread.start()

    while pending or running:
        for i, slot in list(running.items()):
            if not slot.thread.is_alive():
                results[i] = slot.rows
                del running[i]
                for g in slot.gpus:
                    if busy.get(g) == i:
                        del busy[g]
                if slot.check.small:
                    for g in slot.gpus:
                        small_load[g] -= 1
                say(f"[gpu_check] {slot.check.name}: done in {clock() - slot.started:.0f}s")
        for i in list(pending):
            c = checks[i]
            left = deadline - clock()
            if left < c.secs:
                results[i] = [Row(c.name, "NOT RUN", 0.0, "-", f"{left:.0f}s of the budget left, it needs about {c.secs:.0f}s")]
                pending.remove(i)
                continue
            if c.small:
                allowed = [g for g in range(n_gpus) if not (g in busy and checks[busy[g]].alone)]
                if len(allowed) < c.gpus:
                    continue
                order = sorted(allowed, key=lambda g: (small_load[g], g in busy, g))
                gpus = tuple(sorted(order[:c.gpus]))
                for g in gpus:
                    small_load[g] += 1
            else:
                free = [g for g in range(n_gpus) if g not in busy and not (c.alone and small_load[g])]
                if len(free) < c.gpus:
                    if c.gpus > 1:
                        break  # it waits for all its GPUs, and nothing after it goes first
                    continue
                gpus = tuple(free[:c.gpus])
                for g in gpus:
                    busy[g] = i
            pending.remove(i)
            launch(i, gpus)
        if pending or running:
            time.sleep(poll_s)
    return [row for i in sorted(results) for row in results[i]]


def expected_schedule(checks: list[Check], n_gpus: int) -> list[str]:
    """The schedule the expected seconds give (printed at start, before any GPU time is spent)."""
    t = [0.0] * n_gpus
    lines = []
    for c in checks:
        if c.gpus > n_gpus:
            lines.append(f"  {c.name:14s} n/a (needs {c.gpus} GPUs)")
            continue
        if c.small:
            lines.append(f"  {c.name:14s} beside the others ({c.gpus} GPU{'s' if c.gpus > 1 else ''}), ~{c.secs:.0f}s")
            continue
        if c.gpus == 1:
            g = min(range(n_gpus), key=lambda k: t[k])
            lines.append(f"  {c.name:14s} GPU {g}: {t[g]:5.0f} -> {t[g] + c.secs:5.0f}s")
            t[g] += c.secs
        else:
            begin = max(t)
            lines.append(f"  {c.name:14s} GPU {_label(tuple(range(c.gpus)))}: {begin:5.0f} -> {begin + c.secs:5.0f}s")
            t = [begin + c.secs if g < c.gpus else max(t[g], begin) for g in range(n_gpus)]
    lines.append(f"  expected total: {max(t):.0f}s")
    return lines


def _label(gpus: tuple[int, ...]) -> str:
    return ",".join(str(g) for g in gpus) or "-"


# --------------------------------------------------------------------------- running pytest


def run(cmd: list[str], log: Path, timeout: float, env: dict | None = None) -> tuple[int, float]:
    """Run `cmd` with output to `log`; (exit status, seconds). 124 when it ran past `timeout`."""
    t0 = time.time()
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        try:
            rc = p.wait(timeout=max(timeout, 1))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, 9)
            p.wait()
            rc = 124
    return rc, time.time() - t0


def pytest_runner(out: Path, shared: bool) -> Runner:
    """The real runner: pytest -m gpu over a check's targets on its GPUs; one row per test (JUnit XML).
    `shared`: small checks run beside the others (SPMD_RL_GPU_SHARED=1 for all but the `alone`
    ones: the tests then skip their step-to-step check of the device's free memory)."""
    lock = threading.Lock()

    def runner(check: Check, gpus: tuple[int, ...], timeout: float) -> list[Row]:
        label = _label(gpus)
        base = WORK / f"pytest-{check.name}"
        shutil.rmtree(base, ignore_errors=True)
        xml = WORK / f"{check.name}.xml"
        xml.unlink(missing_ok=True)
        part = WORK / f"{check.name}.log"
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(_physical(gpus)),
                   VLLM_CACHE_ROOT=str(WORK / "vllm_cache" / f"gpu{label.replace(',', '_')}"),
                   SPMD_RL_GPU_LOG_DIR=str(WORK / "gpu_logs" / check.name),
                   SPMD_RL_GPU_SHARED="1" if shared and not check.alone else "0", **dict(check.env))
        missing = [t for t in check.targets if not (ROOT / t.split("::")[0]).is_file()]
        if missing:
            return [Row(check.name, "FAIL", 0.0, label, f"missing: {', '.join(missing)}")]
        rc, secs = run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider",
                        f"--basetemp={base}", f"--junitxml={xml}", *check.targets], part, timeout, env)
        with lock, open(out / "pytest.log", "a") as f:
            f.write(f"===== {check.name} on GPU {label}: {' '.join(check.targets)} (exit {rc}, {secs:.0f}s)\n"
                    f"{part.read_text()}\n")
        shutil.rmtree(base, ignore_errors=True)  # run dirs hold multi-GB models and checkpoints
        if not xml.is_file():
            return [Row(check.name, "FAIL", secs, label, f"pytest exit {rc}, no report"
                        + (" (time limit)" if rc == 124 else ""))]
        rows = junit_rows(xml, label)
        if rc == 124:
            rows.append(Row(check.name, "FAIL", secs, label, "time limit reached (tests after it did not run)"))
        return rows

    return runner


def junit_rows(xml: Path, label: str) -> list[Row]:
    rows = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        name = f"{Path(case.get('file') or case.get('classname', '').replace('.', '/')).stem}::{case.get('name')}"
        t = float(case.get("time", 0))
        failure = case.find("failure")
        if failure is None:
            failure = case.find("error")
        skipped = case.find("skipped")
        if failure is not None:
            msg = (failure.get("message") or "failed").splitlines()[0][:100] if failure.get("message") else "failed"
            rows.append(Row(name, "FAIL", t, label, msg))
        elif skipped is not None:
            reason = skipped.get("message") or ""
            if "GPUs," in reason and "visible" in reason:  # a layout of more GPUs than this check has
                rows.append(Row(name, "n/a", t, label, reason))
            else:
                rows.append(Row(name, "FAIL", t, label, f"skipped: {reason[:90]}"))
        else:
            rows.append(Row(name, "PASS", t, label))
    return rows


def _physical(gpus: tuple[int, ...]) -> list[str]:
    """Scheduler GPU indices -> the machine's (CUDA_VISIBLE_DEVICES given to gpu_check respected)."""
    visible = [v for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    return [visible[g] if visible else str(g) for g in gpus]


def visible_gpus() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=60).stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        return 0
    visible = [v for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    return len(visible) if visible else len(out)


def prebuild(checks: list[Check], out: Path) -> subprocess.Popen | None:
    """Build the random-weight model directories the checks read, on the CPU, in the background
    (tests/gpu/runs.py; a check that needs one still being built waits for it)."""
    archs = list(dict.fromkeys(a for c in checks for a in c.archs))
    if not archs:
        return None
    log = open(out / "prebuild.log", "w")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=f"{ROOT}:{os.environ.get('PYTHONPATH', '')}")
    return subprocess.Popen([sys.executable, str(ROOT / "tests" / "gpu" / "runs.py"), "--prebuild", *archs], cwd=ROOT,
                            stdout=log, stderr=subprocess.STDOUT, env=env)


# --------------------------------------------------------------------------- reporting


def step_table() -> str:
    """Per-step seconds of the checks' training runs (their metrics, kept under gpu_logs/<check>)."""
    runs = {f.name.split(".metrics")[0]: f for f in sorted((WORK / "gpu_logs").glob("*/*.metrics.jsonl"))}
    lines = ["| run | step s, each step | generate s | update_actor s | update_critic s | checkpoint stall s |",
             "|---|---|---|---|---|---|"]
    steady = {}
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
                     f"{col('time/update_critic')} | {', '.join(f'{stall[k]:.1f}' for k in sorted(stall)) or '-'} |")
        later = [r for r in rows if 1 < r["step"] <= 3]
        if later:
            steady[name] = sum(r["time/step"] for r in later) / len(later)
    if "ppo-1gpu-shipped" in steady and "qwen0.5b-gsm8k" in steady:
        lines.append(f"\nPPO / GRPO step ratio on the shipped 0.5B work (steps 2-3): "
                     f"{steady['ppo-1gpu-shipped']:.2f} s / {steady['qwen0.5b-gsm8k']:.2f} s = "
                     f"{steady['ppo-1gpu-shipped'] / steady['qwen0.5b-gsm8k']:.2f}x")
    return "\n".join(lines)


def table(rows: list[Row], seconds: float) -> str:
    failed = [r for r in rows if r.result in ("FAIL", "NOT RUN")]
    width = max([len(r.item) for r in rows] + [10])
    out = [f"{'check':<{width}} | GPUs | result  | seconds | note", f"{'-' * width}-|------|---------|---------|-----"]
    out += [f"{r.item:<{width}} | {r.gpus:<4} | {r.result:<7} | {r.seconds:7.1f} | {r.note}" for r in rows]
    out.append(f"{'TOTAL':<{width}} |      | {'FAIL' if failed else 'PASS':<7} | {seconds:7.1f} | "
               f"{sum(r.result == 'PASS' for r in rows)} passed, {len(failed)} failed or not run")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget-s", type=float, default=560, help="wall-clock seconds for all checks")
    ap.add_argument("--only", default="", help="comma-separated check names (default: all), in PLAN's order")
    ap.add_argument("--continue", dest="cont", action="store_true",
                    help="add to the results of an earlier call on the same machine (a plan split over two calls)")
    ap.add_argument("--plan", action="store_true", help="print the expected schedule and exit")
    ap.add_argument("--gpus", type=int, default=0, help="GPUs to plan for (default: the visible ones)")
    args = ap.parse_args()
    only = [n for n in args.only.split(",") if n]
    unknown = set(only) - {c.name for c in PLAN}
    if unknown:
        ap.error(f"unknown checks {sorted(unknown)}: choose from {', '.join(c.name for c in PLAN)}")
    checks = [c for c in PLAN if not only or c.name in only]
    n_gpus = args.gpus or visible_gpus()
    print(f"[gpu_check] {n_gpus} GPU(s); expected schedule:\n" + "\n".join(expected_schedule(checks, max(n_gpus, 1))),
          flush=True)
    if args.plan:
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    WORK.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    builder = prebuild(checks, out)
    rows = schedule(checks, n_gpus, args.budget_s, pytest_runner(out, shared=any(c.small for c in checks)))
    if builder is not None and builder.poll() is None:
        builder.kill()
    saved = WORK / "results.json"
    if args.cont and saved.is_file():
        earlier = json.loads(saved.read_text())
        rows = [Row(**r) for r in earlier["rows"]] + rows
        t_start -= earlier["seconds"]
    saved.write_text(json.dumps({"rows": [r.__dict__ for r in rows], "seconds": time.time() - t_start}))
    text = table(rows, time.time() - t_start) + "\n\nPer-step seconds:\n" + step_table() + "\n"
    (out / "gpu_check.txt").write_text(text)
    print(text)
    return 1 if any(r.result in ("FAIL", "NOT RUN") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
