"""Running the GPU check's checks: a check's pytest on its GPUs (its own work directory, logs and
vLLM compile cache; its rows read by gpu_check_results), the logs of a check that did not pass,
the logs tarball, and the random-weight models the checks read, built in the background."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import gpu_check_machine as machine
from gpu_check_machine import ROOT, physical_gpus
from gpu_check_plan import Check, Row, Runner, gpu_label
from gpu_check_results import result_rows

PYTEST: tuple[str, ...] = (sys.executable, "-m", "pytest")
"""The command that runs a check's tests (a CPU test puts a fake pytest in its place)."""


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
        label = gpu_label(gpus)
        base = machine.WORK / f"pytest-{check.name}"
        memory = machine.MEMORY_RUNS / check.name
        logs = machine.WORK / "gpu_logs" / check.name
        for d in (base, memory):
            shutil.rmtree(d, ignore_errors=True)
        logs.mkdir(parents=True, exist_ok=True)
        xml = machine.WORK / f"{check.name}.xml"
        xml.unlink(missing_ok=True)
        part = machine.WORK / f"{check.name}.log"
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(physical_gpus(gpus)),
                   VLLM_CACHE_ROOT=str(machine.WORK / "vllm_cache" / f"gpu{label.replace(',', '_')}"),
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


ASSERTING_KERNEL = re.compile(r"(/\S+\.py):\d+: unknown: block: .* Assertion `")
"""A device-side assert of an Inductor-generated Triton kernel, as a run's log prints it (the kernel's file)."""


def logs_tarball(out: Path) -> Path:
    """OUT/gpu_logs.tgz: every check's logs so far (gpu_logs/<check>), and the Inductor kernels whose
    device-side asserts they print (inductor_kernels/<file>: the ops fused into the kernel name the
    op that indexed out of bounds; the kernels live in this machine's cache only)."""
    path = out / "gpu_logs.tgz"
    logs = machine.WORK / "gpu_logs"
    with tarfile.open(path, "w:gz") as tar:
        if logs.is_dir():
            tar.add(logs, arcname="gpu_logs")
            for kernel in sorted(asserting_kernels(logs)):
                tar.add(kernel, arcname=f"inductor_kernels/{kernel.name}")
    return path


def asserting_kernels(logs: Path) -> set[Path]:
    """The existing kernel files named by device-side asserts in the .log files under `logs`."""
    found = set()
    for log in logs.rglob("*.log"):
        with open(log, errors="replace") as f:
            for line in f:
                hit = ASSERTING_KERNEL.search(line)
                if hit and Path(hit.group(1)).is_file():
                    found.add(Path(hit.group(1)))
    return found


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
