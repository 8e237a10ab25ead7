"""The GPU path in one table: the shipped presets as shipped (3 steps, checkpoints, a resume for 2
more), the learning check, sequence parallelism, PPO with a critic, the kernels, the Qwen3, Llama 3
and Gemma 3 shapes through vLLM, a reward model, the export and the colocation checks, run over
every GPU the machine has. Prints one PASS/FAIL table with the GPUs
that ran each row, then the training runs' per-step seconds.

    bash scripts/gpu_check.sh OUT [options]      (the shell wrapper sets the environment)
    python scripts/gpu_check.py --out OUT [--only NAME,...] [--max-call-s S] [--continue [FILE]] [--budget-s S]
    python scripts/gpu_check.py --plan [--gpus N] [--gpu-gib G] [--max-call-s S]    (prints the schedule only)

Scheduling (`schedule`). Each check of PLAN is a pytest subprocess with CUDA_VISIBLE_DEVICES set to
its GPUs, its own work directory (--basetemp, logs under gpu_logs/<check>) and the vLLM compile
cache of its GPUs (VLLM_CACHE_ROOT per GPU set, reused by the next check there). Checks start in
PLAN order as soon as their GPUs are free: a 1-GPU check takes any free GPU (the 1-GPU checks run
side by side, one per GPU); a check of more GPUs waits for all of them, and no check after it in
PLAN starts before it. A `small` check (a tiny model with a fixed small KV cache) takes no GPU for
itself: it runs beside the others on the GPU(s) least loaded with small checks. A check started
where a small check runs gets SPMD_RL_GPU_SHARED=1 (its runs then skip the step-to-step check of
the device's free memory); a check started on GPUs of its own gets 0, and no small check joins it
later (a small check waits for GPUs that are free or already shared), so the drift check runs
wherever a check has its GPUs to itself. A small check itself is shared unless it is the last check
left. An `alone` check never has a small one beside it. A check may need fewer GPUs where the
cards have more memory (Check.gpus_by_memory: the 7B preset on 2 cards of >= 120 GiB, else on 4;
the cards' memory is nvidia-smi's memory.total of the smallest visible GPU, or --gpu-gib; unknown
counts as 80 GB cards). A check that needs more GPUs than the machine has is n/a; a check that
cannot start with its expected seconds left in the budget is NOT RUN, which fails the whole check
like a FAIL; a running check is stopped at the budget's end.

Results (`result_rows`). One row per test case of the check's JUnit report. A check whose pytest
exits non-zero, writes no report, runs no test (a test id that matches nothing: exit 4; nothing
collected: exit 5) or skips every test (no vLLM, say) is a FAIL row with that reason; a test
skipped because it needs more GPUs than the check has is n/a. A check cut at the budget is a FAIL
row naming the last step its newest run logged and its log's last line, and the logs of a check
that did not pass (its pytest output, its runs' trainer.log, stdout and metrics.jsonl) are kept
under gpu_logs/<check>, which OUT/gpu_logs.tgz holds. The table's total is PASS only if a test
passed and none failed or was not run. Exit status: 0 all passed; 1 a check failed or was not run;
3 all that ran passed, but checks are left for the next call (the command is printed).

Budget and calls. By default the budget follows the plan: twice its expected seconds plus 5
minutes (the expected seconds are an H200's). Where one command may only run so long (a batch
job's time limit, a lent machine's per-call limit), --max-call-s S splits the plan into calls that
each fit S (`split_calls`: the largest checks first, each in the first call it fits; the
wrapper's set-up time already spent counted in): the call runs the first group and prints the next command (`--continue` adds its rows to the
table of the calls before, kept in GPU_CHECK_WORK on the same machine). A plan longer than one
machine's loan goes on on another machine of the same kind: every call writes OUT/results.json (its
rows and those before, the code's fingerprint, the machine), and `--continue FILE` starts from such
a file (a --continue whose file is not there is refused before any check runs: the table would lose
the earlier rows). Rows of other code are refused (`earlier_results`: the fingerprint is a hash of the files
that decide what the checks run), and the table names every machine its rows ran on.
`--plan --max-call-s S --gpus N [--gpu-gib G]` prints the calls without running anything.

Expected seconds (2xH200, 2026-11-23: preset-7b 405 s, preset-0.5b 312 s, preset-1.5b over 370 s,
learning-1gpu 70 s, the learning-2gpu pair 60 s; the rest from earlier runs and estimates; each
preset starts vLLM with CUDA graphs twice (33-68 s each) and compiles its layers twice (22-36 s),
and the 7B one writes and reads an 86 GB checkpoint (40 s each way); families and reward-model:
215 s and 101 s, and the LoRA rows: lora 257 s, learning-lora 98 s, the one-GPU 7-8B LoRA presets
362-366 s, all on one H100 on 2026-11-26; side by side on four H100s, lora took 381 s and the LoRA
presets 417-454 s, which their seconds now are). The whole plan was about 30 minutes on
2xH200 and 27 on one GPU (the 2-GPU checks n/a) before families and reward-model (about 5 minutes
of 1-GPU work) and the LoRA rows (about 25); on two 80 GB GPUs preset-7b is n/a (it needs 4 of
them): with --max-call-s 570 and a quick set-up, 2 calls on eight 80 GB GPUs, 4 calls on four 80 GB GPUs,
7 on two 141 GB GPUs, 6 on two 80 GB ones, 8 on one (the tool preset at TP=2 needs two GPUs).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
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
MEMORY_RUNS = Path("/dev/shm/gpu_check/runs") if Path("/dev/shm").is_dir() else WORK / "memory_runs"
"""Where a check's runs that keep their checkpoints in RAM go (SPMD_RL_GPU_MEMORY_DIR, one folder per
check): their logs are kept and the folder removed however the check ends."""
PRESET_TEST = "tests/gpu/test_presets_gpu.py::test_preset_trains_saves_and_resumes"
TRAINER_TEST = "tests/gpu/test_trainer_gpu.py::test_training_steps_with_vllm"
LEARNING_TEST = "tests/gpu/test_learning_gpu.py::test_learns"
PYTEST: tuple[str, ...] = (sys.executable, "-m", "pytest")
"""The command that runs a check's tests (a CPU test puts a fake pytest in its place)."""
THIS_MACHINE = "this machine"
"""--continue without FILE: the results of the calls before on this machine (WORK/results.json)."""
TAIL_S = 20.0
"""Seconds a call needs after its checks: results, the logs tarball, the table."""
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
    """No small check beside it: it needs its GPUs' whole memory (qwen7b on two GPUs), or its tests
    read the device's free memory with no switch to turn that off (the colocation check)."""
    env: tuple[tuple[str, str], ...] = ()
    """Extra environment of its pytest."""
    archs: tuple[str, ...] = ()
    """Random-weight model directories it reads (tests/gpu/runs.py builds them in the background
    at the start, on the CPU)."""
    gpus_by_memory: tuple[tuple[float, int], ...] = ()
    """(GiB per card, GPUs) pairs, in order: where every card has at least that much memory, the check
    needs that many GPUs instead of `gpus` (`for_cards`; test_presets_gpu.Preset has the same pairs,
    and picks the same count from torch's view of the cards)."""

    def gpus_on(self, card_gib: float) -> int:
        """The GPUs it needs on cards of `card_gib` GiB each (0: unknown, `gpus`)."""
        return next((n for gib, n in self.gpus_by_memory if card_gib and card_gib >= gib), self.gpus)


PLAN: list[Check] = [  # order = priority (the docstring's rules)
    # its model: drawn on its GPUs. The full 7B actor fits two 141 GB cards, not two 80 GB ones (the
    # start-up memory check refuses it there, naming 4 GPUs or LoRA): 4 of those
    Check("preset-7b", (f"{PRESET_TEST}[qwen7b]",), gpus=4, gpus_by_memory=((120.0, 2),), secs=430, alone=True),
    Check("learning-1gpu", (f"{LEARNING_TEST}[1gpu]",), secs=80, small=True),
    Check("learning-2gpu", (f"{LEARNING_TEST}[2gpu]",), gpus=2, secs=70, small=True),
    Check("preset-long", (f"{PRESET_TEST}[qwen1.5b-long]",), gpus=2, secs=250, archs=("qwen2-1.5b",)),
    Check("ulysses", ("tests/gpu/test_ulysses_gpu.py",), gpus=2, secs=150),
    # the tool preset through a TP=2 engine (multi-turn rollouts with tensor parallelism)
    Check("preset-0.5b-tool-tp2", (f"{PRESET_TEST}[qwen0.5b-gsm8k-tool-tp2]",), gpus=2, secs=330,
          archs=("qwen2-0.5b",)),
    # kernels before the presets: on one GPU the learning check runs beside it (whose tests read no
    # free memory), and the presets have their GPU to themselves (their free-memory drift check runs)
    Check("kernels", ("tests/gpu/test_checkpoint_gpu.py", "tests/gpu/test_offload_gpu.py",
                      "tests/gpu/test_sharded_init_gpu.py", "tests/gpu/test_packing_gpu.py",
                      "tests/gpu/test_fused_gpu.py", "tests/gpu/test_update_sync_gpu.py"), secs=150),
    # Qwen3, Llama 3 and Gemma 3 shapes through vLLM, 3 steps each; a run of 4 steps with a 1.5B reward
    # model (secs: 1xH100, 2026-11-26: 215 s and 101 s)
    Check("families", ("tests/gpu/test_model_families_gpu.py",), secs=230,
          archs=("qwen3-0.6b", "llama3.2-1b", "gemma3-1b")),
    Check("reward-model", ("tests/gpu/test_reward_model_gpu.py",), secs=120, archs=("qwen2-0.5b",)),
    # LoRA: the adapter's sync into vLLM both ways (0.5B), its learning check, the one-GPU 7-8B presets
    Check("lora", ("tests/gpu/test_lora_gpu.py", f"{TRAINER_TEST}[lora-1gpu-adapter]",
                   f"{TRAINER_TEST}[lora-1gpu-merged]"), secs=390, archs=("qwen2-0.5b",)),
    Check("learning-lora", (f"{LEARNING_TEST}[lora-1gpu]",), secs=100, small=True),
    # (their 7-8B models drawn on their GPU, in seconds: the CPU prebuild of a 7B shape took ~4 minutes;
    # secs: the four LoRA rows side by side on 4xH100, 2026-11-26: lora 381 s, the presets 417-454 s)
    Check("preset-7b-lora", (f"{PRESET_TEST}[qwen7b-lora]",), secs=470),
    Check("preset-qwen3-8b-lora", (f"{PRESET_TEST}[qwen3-8b-lora]",), secs=470),
    Check("preset-llama-8b-lora", (f"{PRESET_TEST}[llama3.1-8b-lora]",), secs=470),
    Check("preset-0.5b", (f"{PRESET_TEST}[qwen0.5b-gsm8k]",), secs=320, archs=("qwen2-0.5b",)),
    Check("preset-1.5b", (f"{PRESET_TEST}[qwen1.5b-gsm8k]",), secs=450, archs=("qwen2-1.5b",)),
    Check("multiturn-learning", (MULTITURN_TEST,), secs=170, small=True),
    Check("preset-0.5b-tool", (f"{PRESET_TEST}[qwen0.5b-gsm8k-tool]",), secs=330, archs=("qwen2-0.5b",)),
    Check("ppo", (f"{TRAINER_TEST}[ppo-1gpu-shipped]",), secs=150, archs=("qwen2-0.5b",)),
    Check("export", ("tests/gpu/test_export_gpu.py",), secs=90),
    Check("colocate", ("tests/gpu/test_colocate.py",), secs=90, alone=True,
          env=(("SPMD_RL_GPU_LAYOUTS", "0.5b-tp1"),)),
    Check("offload", (f"{TRAINER_TEST}[grpo-1gpu-tp1-offload]",), secs=100),
]


@dataclass
class Row:
    item: str
    result: str  # PASS, FAIL, n/a, NOT RUN
    seconds: float
    gpus: str = "-"
    note: str = ""
    check: str = ""
    """The PLAN check it belongs to."""
    machine: str = ""
    """The GPUs it ran on (`machine_name`), for a table whose calls ran on several machines."""


@dataclass
class Slot:
    """A check placed on GPUs (what `schedule` hands the runner)."""
    check: Check
    gpus: tuple[int, ...]
    started: float = 0.0
    rows: list[Row] = field(default_factory=list)
    thread: threading.Thread | None = None


Runner = Callable[[Check, tuple[int, ...], float, bool], list[Row]]
"""runner(check, GPU indices, seconds it may take, shared: other checks may use its GPUs) -> its rows."""


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
            results[i] = [Row(c.name, "n/a", 0.0, "-", f"needs {c.gpus} GPUs, {n_gpus} visible", c.name)]
        else:
            pending.append(i)
    busy: dict[int, int] = {}  # GPU -> index of the big check on it
    shared_big: set[int] = set()  # big checks started beside a small one: more small ones may join them
    small_load = [0] * max(n_gpus, 1)
    running: dict[int, Slot] = {}

    def launch(i: int, gpus: tuple[int, ...], shared: bool) -> None:
        slot = Slot(checks[i], gpus, clock())
        left = deadline - clock()

        def work() -> None:
            try:
                slot.rows = runner(slot.check, gpus, left, shared)
            except Exception as e:  # a broken check is a FAIL with its reason; the others go on
                slot.rows = [Row(slot.check.name, "FAIL", clock() - slot.started, _label(gpus),
                                 f"{type(e).__name__}: {e}"[:120])]
            for row in slot.rows:
                row.check = row.check or slot.check.name

        slot.thread = threading.Thread(target=work, daemon=True)
        running[i] = slot
        say(f"[gpu_check] {checks[i].name}: started on GPU {_label(gpus)} at {clock() - start:.0f}s"
            + (", beside other checks (its free-memory drift check is off)" if shared else ""))
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
                results[i] = [Row(c.name, "NOT RUN", 0.0, "-", f"{left:.0f}s of the budget left, it needs about "
                                  f"{c.secs:.0f}s", c.name)]
                pending.remove(i)
                continue
            if c.small:  # on GPUs with no big check, or whose big check was started as shared
                allowed = [g for g in range(n_gpus) if g not in busy or busy[g] in shared_big]
                if len(allowed) < c.gpus:
                    continue
                order = sorted(allowed, key=lambda g: (small_load[g], g in busy, g))
                gpus = tuple(sorted(order[:c.gpus]))
                shared = any(g in busy or small_load[g] for g in gpus) or len(pending) > 1
                for g in gpus:
                    small_load[g] += 1
            else:
                free = [g for g in range(n_gpus) if g not in busy and not (c.alone and small_load[g])]
                if len(free) < c.gpus:
                    if c.gpus > 1:
                        break  # it waits for all its GPUs, and nothing after it goes first
                    continue
                gpus = tuple(free[:c.gpus])
                shared = any(small_load[g] for g in gpus)
                for g in gpus:
                    busy[g] = i
                if shared:
                    shared_big.add(i)
            pending.remove(i)
            launch(i, gpus, shared)
        if pending or running:
            time.sleep(poll_s)
    return [row for i in sorted(results) for row in results[i]]


def expected_schedule(checks: list[Check], n_gpus: int) -> tuple[list[str], float]:
    """The schedule the expected seconds give (printed at start, before any GPU time is spent):
    its lines and its expected total seconds. It places the checks as `schedule` does: each on the
    GPUs that are free first (a check of several GPUs waits for as many, not for all the machine's,
    and no check after it starts before it), a small one beside the others."""
    t = [0.0] * n_gpus  # when each GPU's checks end
    after = 0.0  # no check starts before a check of several GPUs placed before it
    alone_until = 0.0  # a small check starts after the alone checks placed before it
    end = 0.0
    lines = []
    for c in checks:
        if c.gpus > n_gpus:
            lines.append(f"  {c.name:14s} n/a (needs {c.gpus} GPUs)")
            continue
        if c.small:
            lines.append(f"  {c.name:14s} beside the others ({c.gpus} GPU{'s' if c.gpus > 1 else ''}): "
                         f"{alone_until:5.0f} -> {alone_until + c.secs:5.0f}s")
            end = max(end, alone_until + c.secs)
            continue
        gpus = tuple(sorted(sorted(range(n_gpus), key=lambda g: (t[g], g))[:c.gpus]))
        begin = max([after, *(t[g] for g in gpus)])
        finish = begin + c.secs
        lines.append(f"  {c.name:14s} GPU {_label(gpus)}: {begin:5.0f} -> {finish:5.0f}s")
        for g in gpus:
            t[g] = finish
        if c.gpus > 1:
            after = begin
        if c.alone:
            alone_until = max(alone_until, finish)
    total = max([end, *t])
    lines.append(f"  expected total: {total:.0f}s")
    return lines, total


def split_calls(checks: list[Check], n_gpus: int, seconds: float) -> list[list[Check]]:
    """`checks` in groups whose expected schedule fits `seconds` each, one group per call: the
    largest first (GPU-seconds; small checks last, they take no GPU of their own), each into the
    first group it fits in; each group then runs in PLAN order, and the groups go in the order of
    their first check (a check longer than `seconds` by itself gets a call of its own)."""
    order = {c.name: i for i, c in enumerate(checks)}

    def in_plan_order(group: list[Check]) -> list[Check]:
        return sorted(group, key=lambda c: order[c.name])

    groups: list[list[Check]] = []
    for c in sorted(checks, key=lambda c: (c.small, -min(c.gpus, n_gpus) * c.secs, order[c.name])):
        for g in groups:
            if expected_schedule(in_plan_order(g + [c]), n_gpus)[1] <= seconds:
                g.append(c)
                break
        else:
            groups.append([c])
    return sorted((in_plan_order(g) for g in groups), key=lambda g: order[g[0].name])


def default_budget(checks: list[Check], n_gpus: int) -> float:
    """The budget that follows the plan: twice its expected seconds plus 5 minutes."""
    return 2 * expected_schedule(checks, max(n_gpus, 1))[1] + 300


def for_cards(checks: list[Check], card_gib: float) -> list[Check]:
    """`checks` with the GPU count each needs on cards of `card_gib` GiB (Check.gpus_by_memory):
    what the scheduler and the plan use, so that a check needing more GPUs than the machine has is n/a."""
    return [dataclasses.replace(c, gpus=c.gpus_on(card_gib)) for c in checks]


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


def pytest_runner(out: Path) -> Runner:
    """The real runner: PYTEST -m gpu over a check's targets on its GPUs; its rows (`result_rows`).
    SPMD_RL_GPU_SHARED tells its runs whether other checks may use their GPUs meanwhile."""
    lock = threading.Lock()

    def runner(check: Check, gpus: tuple[int, ...], timeout: float, shared: bool) -> list[Row]:
        label = _label(gpus)
        base = WORK / f"pytest-{check.name}"
        memory = MEMORY_RUNS / check.name
        logs = WORK / "gpu_logs" / check.name
        for d in (base, memory):
            shutil.rmtree(d, ignore_errors=True)
        logs.mkdir(parents=True, exist_ok=True)
        xml = WORK / f"{check.name}.xml"
        xml.unlink(missing_ok=True)
        part = WORK / f"{check.name}.log"
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(_physical(gpus)),
                   VLLM_CACHE_ROOT=str(WORK / "vllm_cache" / f"gpu{label.replace(',', '_')}"),
                   SPMD_RL_GPU_LOG_DIR=str(logs), SPMD_RL_GPU_MEMORY_DIR=str(memory),
                   SPMD_RL_GPU_SHARED="1" if shared else "0", **dict(check.env))
        missing = [t for t in check.targets if not (ROOT / t.split("::")[0]).is_file()]
        if missing:
            return [Row(check.name, "FAIL", 0.0, label, f"missing: {', '.join(missing)}", check.name)]
        rc, secs = run([*PYTEST, "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider",
                        f"--basetemp={base}", f"--junitxml={xml}", *check.targets], part, timeout, env)
        shutil.copyfile(part, logs / "pytest.log")
        with lock, open(out / "pytest.log", "a") as f:
            f.write(f"===== {check.name} on GPU {label}: {' '.join(check.targets)} (exit {rc}, {secs:.0f}s)\n"
                    f"{part.read_text(errors='replace')}\n")
        rows = result_rows(check, rc, xml, label, secs, where_cut([base, memory]) if rc == 124 else "")
        if any(r.result != "PASS" for r in rows):
            keep_run_files([base, memory], logs / "run_files")
        for d in (base, memory):  # run dirs hold multi-GB models and checkpoints
            shutil.rmtree(d, ignore_errors=True)
        return rows

    return runner


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


def _run_files(dirs: list[Path]) -> list[tuple[Path, Path]]:
    """(folder, file) of the runs' logs under `dirs`: *.log, *.txt, *.jsonl (no models, no checkpoints)."""
    found = []
    for d in dirs:
        if d.is_dir():
            found += [(d, f) for f in d.rglob("*") if f.is_file() and not f.is_symlink()
                      and (f.suffix in (".log", ".txt") or f.name.endswith(".jsonl"))]
    return found


def where_cut(dirs: list[Path]) -> str:
    """How far a check stopped at its time limit got: the last step in its newest metrics.jsonl and
    the last line of its newest trainer.log (or of its newest other log)."""
    files = sorted(_run_files(dirs), key=lambda df: df[1].stat().st_mtime)
    said = []
    metrics = [f for _, f in files if f.name.endswith("metrics.jsonl")]
    if metrics:
        steps = []
        for line in metrics[-1].read_text(errors="replace").splitlines():
            try:
                steps.append(json.loads(line)["step"])
            except (ValueError, KeyError, TypeError):
                pass  # a line cut in the middle of its write
        said.append(f"last step {max(steps) if steps else 'none'} in {metrics[-1].parent.name}/metrics.jsonl")
    logs = [f for _, f in files if f.name == "trainer.log"] or [f for _, f in files if f.suffix in (".log", ".txt")]
    if logs:
        lines = [s.strip() for s in logs[-1].read_text(errors="replace").splitlines() if s.strip()]
        if lines:
            said.append(f"{logs[-1].name}'s last line: {lines[-1][-110:]}")
    return "; ".join(said) or "no run had logged a step or a line"


def keep_run_files(dirs: list[Path], dest: Path, max_bytes: int = 20 << 20) -> None:
    """Copy the runs' logs under `dirs` to `dest` (the end of a file over `max_bytes`)."""
    for d, f in _run_files(dirs):
        target = dest / d.name / f.relative_to(d)
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(f, "rb") as src, open(target, "wb") as dst:
            src.seek(max(f.stat().st_size - max_bytes, 0))
            shutil.copyfileobj(src, dst)


def logs_tarball(out: Path) -> Path:
    """OUT/gpu_logs.tgz: every check's logs so far (gpu_logs/<check>)."""
    path = out / "gpu_logs.tgz"
    with tarfile.open(path, "w:gz") as tar:
        if (WORK / "gpu_logs").is_dir():
            tar.add(WORK / "gpu_logs", arcname="gpu_logs")
    return path


def _cuda_visible() -> list[str]:
    """CUDA_VISIBLE_DEVICES given to gpu_check, as a list (empty: every GPU)."""
    return [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]


def _nvidia_smi(fields: str) -> list[str]:
    """nvidia-smi's `--query-gpu=fields` lines, one per GPU of the machine (none: no nvidia-smi)."""
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def _physical(gpus: tuple[int, ...]) -> list[str]:
    """Scheduler GPU indices -> the machine's (CUDA_VISIBLE_DEVICES given to gpu_check respected)."""
    visible = _cuda_visible()
    return [visible[g] if visible else str(g) for g in gpus]


def visible_gpus() -> int:
    gpus = _nvidia_smi("index")
    return (len(_cuda_visible()) or len(gpus)) if gpus else 0


def visible_gpu_gib() -> float:
    """The smallest memory of the GPUs gpu_check uses, in GiB (nvidia-smi's memory.total;
    CUDA_VISIBLE_DEVICES respected, by index or UUID); 0 when unknown (no nvidia-smi)."""
    return smallest_card_gib("\n".join(_nvidia_smi("index,uuid,memory.total")), ",".join(_cuda_visible()))


def smallest_card_gib(nvidia_smi_csv: str, visible: str = "") -> float:
    """The smallest memory.total (MiB, as `nvidia-smi --query-gpu=index,uuid,memory.total
    --format=csv,noheader,nounits` prints it) among the `visible` GPUs (CUDA_VISIBLE_DEVICES's
    value: indices or UUIDs; empty: all), in GiB; 0 when none is listed."""
    cards = []
    for line in nvidia_smi_csv.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3 and parts[2].replace(".", "", 1).isdigit():
            cards.append((parts[0], parts[1], float(parts[2]) / 1024))
    wanted = [v.strip() for v in visible.split(",") if v.strip()]
    if wanted:
        cards = [c for c in cards if c[0] in wanted or any(c[1].startswith(w) for w in wanted)] or cards
    return min((gib for _, _, gib in cards), default=0.0)


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


CODE_PATHS = ("spmd_rl", "tests/gpu", "configs", "scripts", "pyproject.toml")
"""What decides what the checks run: a table continued from another machine must be of the same."""


def code_fingerprint(root: Path = ROOT) -> str:
    """A hash of CODE_PATHS' files (their paths and bytes; caches and compiled files left out)."""
    h = hashlib.sha256()
    for top in CODE_PATHS:
        base = root / top
        files = [base] if base.is_file() else sorted(p for p in base.rglob("*") if p.is_file())
        for f in files:
            if "__pycache__" in f.parts or f.suffix in (".pyc", ".pyo"):
                continue
            h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def machine_name() -> str:
    """'4x NVIDIA H100 80GB HBM3' (the visible GPUs, from nvidia-smi), or 'no GPU'."""
    names = _nvidia_smi("name")
    return f"{len(_cuda_visible()) or len(names)}x {names[0]}" if names else "no GPU"


def earlier_results(path: Path, code: str) -> dict:
    """The rows and seconds of earlier calls (a results.json); refused, in one line, where they ran
    other code than `code` (their rows would not say anything about this checkout)."""
    earlier = json.loads(path.read_text())
    if earlier.get("code", code) != code:
        raise SystemExit(f"[gpu_check] {path} holds results of other code (fingerprint {earlier['code']}, this "
                         f"checkout {code}): run those checks again (drop --continue)")
    return earlier


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
    saved, code = WORK / "results.json", code_fingerprint()
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
        shutil.rmtree(WORK / "gpu_logs", ignore_errors=True)
        saved.unlink(missing_ok=True)
    WORK.mkdir(parents=True, exist_ok=True)
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
