"""The GPU check's results: a check's rows from its pytest exit status and JUnit report, the
PASS/FAIL table, the per-step seconds of the training runs, and the rows of earlier calls
(results.json, read by --continue).

Results (`result_rows`). One row per test case of the check's JUnit report. A check whose pytest
exits non-zero, writes no report, runs no test (a test id that matches nothing: exit 4; nothing
collected: exit 5) or skips every test (no vLLM, say) is a FAIL row with that reason; a test
skipped because it needs more GPUs than the check has is n/a. A check cut at the budget is a FAIL
row naming the last step its newest run logged and its log's last line, and the logs of a check
that did not pass (its pytest output, its runs' trainer.log, stdout and metrics.jsonl) are kept
under gpu_logs/<check>, which OUT/gpu_logs.tgz holds. The table's total is PASS only if a test
passed and none failed or was not run.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import gpu_check_machine as machine
from gpu_check_plan import Check, Row
from summarize_run import read_steps

EXIT_MEANING = {1: "tests failed", 2: "interrupted", 3: "internal error", 4: "usage error",
                5: "no tests collected", 124: "time limit"}


def result_rows(check: Check, rc: int, xml: Path, label: str, secs: float, cut: str = "") -> list[Row]:
    """A check's rows from its pytest exit status and JUnit report (the module's docstring):
    `cut` says how far a check stopped at its time limit (rc 124) got."""
    def fail(note: str) -> Row:
        return Row(check.name, "FAIL", secs, label, note, check.name)

    exit_note = f"pytest exit {rc}" + (f": {EXIT_MEANING[rc]}" if rc in EXIT_MEANING else "")
    try:
        rows = junit_rows(xml, label) if xml.is_file() else None
    except ET.ParseError as e:
        return [fail(f"{exit_note}, unreadable report ({e})")]
    for r in rows or []:
        r.check = check.name
    if rc == 124:
        return [*(rows or []), fail(f"cut at the time limit after {secs:.0f}s; {cut}")]
    if rows is None:
        return [fail(f"{exit_note}, no report")]
    if not rows:
        return [fail(f"ran no test ({exit_note})")]
    skips = [r.note.removeprefix(SKIPPED) for r in rows if r.result == "FAIL" and r.note.startswith(SKIPPED)]
    if len(skips) == len(rows):
        return [fail("all skipped: " + "; ".join(dict.fromkeys(skips)))]
    failed = any(r.result == "FAIL" and not r.note.startswith(SKIPPED) for r in rows)
    if rc != 0 and not (rc == 1 and failed):  # pytest's own failure beyond the tests' (a crash, a teardown)
        rows.append(fail(exit_note))
    return rows


SKIPPED = "skipped: "


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
                rows.append(Row(name, "FAIL", t, label, f"{SKIPPED}{reason[:90]}"))
        else:
            rows.append(Row(name, "PASS", t, label))
    return rows


def earlier_results(path: Path, code: str) -> dict:
    """The rows and seconds of earlier calls (a results.json); refused, in one line, where they ran
    other code than `code` (their rows would not say anything about this checkout)."""
    earlier = json.loads(path.read_text())
    if earlier.get("code", code) != code:
        raise SystemExit(f"[gpu_check] {path} holds results of other code (fingerprint {earlier['code']}, this "
                         f"checkout {code}): run those checks again (drop --continue)")
    return earlier


def step_table() -> str:
    """Per-step seconds of the checks' training runs (their metrics, kept under gpu_logs/<check>)."""
    runs = {f.name.split(".metrics")[0]: f for f in sorted((machine.WORK / "gpu_logs").glob("*/*.metrics.jsonl"))}
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


def failed(rows: list[Row]) -> list[Row]:
    return [r for r in rows if r.result in ("FAIL", "NOT RUN")]


def table(rows: list[Row], seconds: float, still_to_run: int = 0) -> str:
    """The PASS/FAIL table; its total is PASS only if a test passed and none failed or was not run
    (PARTIAL: so far, with `still_to_run` checks left for later calls)."""
    bad, passed = failed(rows), sum(r.result == "PASS" for r in rows)
    total = "FAIL" if bad or not passed else ("PARTIAL" if still_to_run else "PASS")
    width = max([len(r.item) for r in rows] + [10])
    out = [f"{'check':<{width}} | GPUs | result  | seconds | note", f"{'-' * width}-|------|---------|---------|-----"]
    out += [f"{r.item:<{width}} | {r.gpus:<4} | {r.result:<7} | {r.seconds:7.1f} | {r.note}" for r in rows]
    machines = list(dict.fromkeys(r.machine for r in rows if r.machine))
    if len(machines) > 1:  # calls on several machines: which rows ran where
        out[2:] = [line + f" [{machines.index(r.machine) + 1}]" if r.machine else line for line, r in zip(out[2:], rows)]
        out.append("machines: " + "; ".join(f"[{i + 1}] {m}" for i, m in enumerate(machines)))
    out.append(f"{'TOTAL':<{width}} |      | {total:<7} | {seconds:7.1f} | {passed} passed, {len(bad)} failed or not run"
               + (f", {still_to_run} checks still to run" if still_to_run else ""))
    return "\n".join(out)
