"""The machine the GPU check runs on: its GPUs (the visible ones, their memory, from nvidia-smi and
CUDA_VISIBLE_DEVICES), its name for the table, the work directory the checks keep on it, and the
fingerprint of the code that decides what the checks run (a table continued on another machine
must be of the same code)."""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORK = Path(os.environ.get("GPU_CHECK_WORK", "/tmp/gpu_check"))
MEMORY_RUNS = Path("/dev/shm/gpu_check/runs") if Path("/dev/shm").is_dir() else WORK / "memory_runs"
"""Where a check's runs that keep their checkpoints in RAM go (SPMD_RL_GPU_MEMORY_DIR, one folder per
check): their logs are kept and the folder removed however the check ends."""


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


def physical_gpus(gpus: tuple[int, ...]) -> list[str]:
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


CODE_PATHS = ("spmd_rl", "tests/gpu", "configs", "scripts", "pyproject.toml")
"""What decides what the checks run: a table continued from another machine must be of the same."""


def importable(package: str) -> bool:
    """Whether this Python can import `package` (found, not imported)."""
    import importlib.util

    return importlib.util.find_spec(package) is not None


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
