"""The GPU path in one table: the shipped presets as shipped (3 steps, checkpoints, a resume for 2
more), the learning check, sequence parallelism, PPO with a critic, the kernels, the Qwen3, Llama 3
and Gemma 3 shapes through vLLM, a reward model, the export and the colocation checks, run over
every GPU the machine has. Prints one PASS/FAIL table with the GPUs
that ran each row, then the training runs' per-step seconds.

    bash scripts/gpu_check.sh OUT [options]      (the shell wrapper sets the environment)
    python scripts/gpu_check.py --out OUT [--only NAME,...] [--max-call-s S] [--continue [FILE]] [--budget-s S]
    python scripts/gpu_check.py --plan [--gpus N] [--gpu-gib G] [--max-call-s S]    (prints the schedule only)

Its parts: the checks and their scheduling (gpu_check_plan.py), running a check's pytest
(gpu_check_runner.py), its rows and the table (gpu_check_results.py), the machine's GPUs and
the code's fingerprint (gpu_check_machine.py); this file reads the options and runs them.
Exit status: 0 all passed; 1 a check failed or was not run; 3 all that ran passed, but checks
are left for the next call (the command is printed).

Budget and calls. By default the budget follows the plan: twice its expected seconds plus 5 minutes
(the expected seconds are an H200's). Where one command may only run so long (a batch job's time
limit, a lent machine's per-call limit), --max-call-s S splits the plan into calls that each fit S
(gpu_check_plan.split_calls: the largest checks first, each in the first call it fits; the wrapper's
set-up time already spent counted in): the call runs the first group and prints the next command
(`--continue` adds its rows to the table of the calls before, kept in GPU_CHECK_WORK on the same
machine). A plan longer than one machine's loan goes on on another machine of the same kind: every
call writes OUT/results.json (its rows and those before, the code's fingerprint, the machine), and
`--continue FILE` starts from such a file (a --continue whose file is not there is refused before
any check runs: the table would lose the earlier rows). Rows of other code are refused
(gpu_check_results.earlier_results: the fingerprint is a hash of the files that decide what the
checks run), and the table names every machine its rows ran on.
`--plan --max-call-s S --gpus N [--gpu-gib G]` prints the calls without running anything.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_check_machine  # noqa: E402
from gpu_check_machine import code_fingerprint, importable, machine_name, visible_gpu_gib, visible_gpus  # noqa: E402
from gpu_check_plan import PLAN, TAIL_S, Check, Row, default_budget, expected_schedule, for_cards, schedule, split_calls  # noqa: E402
from gpu_check_results import earlier_results, failed, step_table, table  # noqa: E402
from gpu_check_runner import logs_tarball, prebuild, pytest_runner  # noqa: E402

THIS_MACHINE = "this machine"
"""--continue without FILE: the results of the calls before on this machine (WORK/results.json)."""


def next_command(args: argparse.Namespace, later: list[Check]) -> str:
    """The command of the next call: the checks left, added to this call's table."""
    gpus = f" --gpus {args.gpus}" if args.gpus else ""
    gpus += f" --gpu-gib {args.gpu_gib:g}" if args.gpu_gib else ""
    budget = f" --budget-s {args.budget_s:.0f}" if args.budget_s else ""
    return (f"bash scripts/gpu_check.sh {args.out or 'OUT'} --continue --max-call-s {args.max_call_s:.0f}{gpus}{budget} "
            f"--only {','.join(c.name for c in later)}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", help="where the table, the tests' output and the logs go (not needed with --plan)")
    ap.add_argument("--budget-s", type=float, default=0,
                    help="wall-clock seconds for the checks (default: twice the plan's expected seconds + 300)")
    ap.add_argument("--max-call-s", type=float, default=0,
                    help="the longest one command may run: run the checks that fit, then print the next command")
    ap.add_argument("--only", default="", help="comma-separated check names (default: all), in PLAN's order")
    ap.add_argument("--continue", dest="cont", nargs="?", const=THIS_MACHINE, default="",
                    help="add to the table of earlier calls (on this machine, or FILE: an earlier call's "
                         "OUT/results.json, of the same code); without --only, run the checks they have not run")
    ap.add_argument("--plan", action="store_true", help="print the expected schedule (and the calls) and exit")
    ap.add_argument("--gpus", type=int, default=0, help="GPUs to plan for (default: the visible ones)")
    ap.add_argument("--gpu-gib", type=float, default=0,
                    help="memory of each GPU in GiB to plan for (default: the smallest visible one's, from "
                         "nvidia-smi; without one, 80 GB cards): some checks need fewer GPUs on larger cards")
    args = ap.parse_args()
    if not args.out and not args.plan:
        ap.error("--out is needed (unless --plan)")
    only = [n for n in args.only.split(",") if n]
    unknown = set(only) - {c.name for c in PLAN}
    if unknown:
        ap.error(f"unknown checks {sorted(unknown)}: choose from {', '.join(c.name for c in PLAN)}")
    n_gpus = args.gpus or visible_gpus()
    card_gib = args.gpu_gib or visible_gpu_gib()
    plan = for_cards(PLAN, card_gib)
    by_memory = [f"{c.name} needs {c.gpus_on(card_gib)} GPUs (" + ", ".join(f"{n} where each has >= {gib:.0f} GiB"
                                                                       for gib, n in c.gpus_by_memory)
                 + f", else {c.gpus})" for c in PLAN if c.gpus_by_memory and (not only or c.name in only)]
    if by_memory:
        print(f"[gpu_check] cards of {f'{card_gib:.1f} GiB' if card_gib else 'unknown memory (planned as 80 GB)'}: "
              + "; ".join(by_memory), flush=True)
    checks = [c for c in plan if not only or c.name in only]
    saved, code = gpu_check_machine.WORK / "results.json", code_fingerprint()
    given = (saved if args.cont == THIS_MACHINE else Path(args.cont)) if args.cont else None
    if given and not args.plan and not given.is_file():
        ap.error(f"--continue: no earlier results in {given} (a fresh machine, or a path on another one): copy "
                 "the earlier call's OUT/results.json to this machine and pass it (--continue FILE), or drop "
                 "--continue to start a new table")
    earlier = earlier_results(given, code) if given and given.is_file() else {"rows": [], "seconds": 0.0}
    earlier_rows = [Row(**r) for r in earlier["rows"]]
    if args.cont and not only:  # the checks the earlier calls have not run
        ran = {r.check for r in earlier_rows if r.result != "NOT RUN"}
        checks = [c for c in checks if c.name not in ran]
    missing: dict[str, list[str]] = {}  # package -> the checks that need it
    for c in checks:
        for package in c.needs:
            if not importable(package):
                missing.setdefault(package, []).append(c.name)
    if missing and not args.plan:
        ap.error("; ".join(f"{', '.join(names)} needs {p}, which this Python cannot import" for p, names in missing.items())
                 + ": pip install -e '.[gpu]' (offline: its wheel in .whl/, which scripts/gpu_check.sh installs), "
                 "or leave the check out (--only)")
    later: list[Check] = []
    budget = args.budget_s or default_budget(checks, n_gpus)
    if args.max_call_s:
        spent = time.time() - float(os.environ.get("GPU_CHECK_T0") or time.time())  # by the wrapper's set-up
        call_s = args.max_call_s - spent - TAIL_S
        if call_s < 60:
            ap.error(f"--max-call-s {args.max_call_s:.0f} leaves {call_s:.0f}s for the checks after {spent:.0f}s of "
                     f"set-up and {TAIL_S:.0f}s for the results: give more")
        calls = split_calls(checks, max(n_gpus, 1), call_s)
        print(f"[gpu_check] {len(calls)} call(s) of <= {args.max_call_s:.0f}s ({max(spent, 0):.0f}s of this one spent "
              f"setting up): " + " | ".join(",".join(c.name for c in g) for g in calls), flush=True)
        checks, later = (calls[0], [c for g in calls[1:] for c in g]) if calls else ([], [])
        if len(checks) == 1 and checks[0].secs > call_s:  # longer than a call by itself: it runs to the call's end
            print(f"[gpu_check] {checks[0].name} expects {checks[0].secs:.0f}s, more than a call leaves it "
                  f"({call_s:.0f}s): it runs until the call's end", flush=True)
            checks = [dataclasses.replace(checks[0], secs=0.0)]
        budget = min(budget, call_s)
    lines = expected_schedule(checks, max(n_gpus, 1))[0]
    print(f"[gpu_check] {n_gpus} GPU(s), budget {budget:.0f}s; expected schedule:\n" + "\n".join(lines), flush=True)
    if args.plan:
        if later:
            print(f"[gpu_check] then: {next_command(args, later)}")
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.cont:  # a fresh table: the logs and results of an earlier gpu_check go
        shutil.rmtree(gpu_check_machine.WORK / "gpu_logs", ignore_errors=True)
        saved.unlink(missing_ok=True)
    gpu_check_machine.WORK.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    builder = prebuild([c for c in checks if c.gpus <= n_gpus], out)
    rows = schedule(checks, n_gpus, budget, pytest_runner(out))
    machine = machine_name()
    rows = [dataclasses.replace(r, machine=machine) for r in rows]
    if builder is not None and builder.poll() is None:
        builder.kill()
    if args.max_call_s:  # a check this call had no time to start goes to the next call
        moved = {r.check for r in rows if r.result == "NOT RUN"}
        if moved:
            print(f"[gpu_check] not started in this call, left for the next: {', '.join(sorted(moved))}")
        rows = [r for r in rows if r.check not in moved]
        later = [c for c in plan if c.name in moved] + later
    names = {c.name for c in checks}
    rows = [r for r in earlier_rows if r.check not in names] + rows  # a check run again replaces its rows
    seconds = time.time() - t_start + earlier["seconds"]
    results = json.dumps({"rows": [r.__dict__ for r in rows], "seconds": seconds, "code": code})
    saved.write_text(results)
    (out / "results.json").write_text(results)  # for a call on another machine: --continue OUT/results.json
    logs_tarball(out)
    text = (table(rows, seconds, len(later)) + "\n\nPer-step seconds:\n" + step_table() + "\n"
            + (f"\nNext call ({len(later)} checks left, about {expected_schedule(later, max(n_gpus, 1))[1]:.0f}s):\n"
               f"{next_command(args, later)}\n" if later else ""))
    (out / "gpu_check.txt").write_text(text)
    print(text)
    if failed(rows) or not any(r.result == "PASS" for r in rows):
        return 1
    return 3 if later else 0


if __name__ == "__main__":
    sys.exit(main())
