"""What the GPU tests that train through `torchrun -m spmd_rl.ppo` share (test_trainer_gpu,
test_presets_gpu, test_learning_gpu): skip reasons, launching a run, its metrics, and random-weight
model directories of real shapes built once per machine.

    python tests/gpu/runs.py --prebuild qwen2-7b qwen2-1.5b     (scripts/gpu_check.py, in the background)

builds the model directories the preset checks use (SPMD_RL_GPU_MODEL_ROOT, default
/tmp/spmd_rl_models) on the CPU (CUDA_VISIBLE_DEVICES="") while the GPUs run other checks; a test
that needs one that is still being built waits for it (a file lock per shape), and one that finds
none builds it on its GPU.
"""

from __future__ import annotations

import argparse
import fcntl
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


SMALL_ON_VLLM = [
    "--config", str(REPO / "configs" / "tiny-cpu.toml"), 'model.arch="small"', 'model.compute_dtype="bfloat16"',
    "model.remove_padding=true", "actor.max_token_len_per_gpu=8192", 'trainer.device="cuda"',
    'rollout.engine="vllm"', "rollout.enforce_eager=true", "rollout.gpu_memory_utilization=0.05",
    "rollout.kv_cache_tokens=131072",
    "actor.lr=1e-3", "data.train_batch_size=32", "actor.ppo_mini_batch_size=32",
    'data.val_files=[]', "trainer.val_every=0", "trainer.save_every=-1", "trainer.tensorboard=false",
]
"""The learning checks' setting (test_learning_gpu.py says how it was chosen): a small random Qwen2
(4 layers, hidden 256, the character tokenizer) on the shipped GPU path (fp32 masters, bf16 compute,
packed rows, vLLM eager with a fixed KV cache of 131,072 tokens, 256 MiB at the small shape's 2 KiB a
token, so that it runs beside other checks), 32
prompts per step in one mini-batch (one optimizer step: on-policy), lr 1e-3."""


def skip_reason(nproc: int) -> str | None:
    """Why a test of `nproc` GPUs cannot run here (None: it can). "needs N GPUs, M visible" is how
    scripts/gpu_check.py tells a 2-GPU test on one GPU (n/a) from a broken one (FAIL)."""
    if not torch.cuda.is_available():
        return "needs CUDA"
    if importlib.util.find_spec("vllm") is None:
        return "needs vllm (pip install -e .[vllm])"
    if torch.cuda.device_count() < nproc:
        return f"needs {nproc} GPUs, {torch.cuda.device_count()} visible"
    return None


def card_gib() -> float:
    """The smallest visible GPU's memory in GiB, as torch reports it (0 without CUDA): what
    test_presets_gpu.Preset.gpus_on picks a preset's GPU count from."""
    if not torch.cuda.is_available():
        return 0.0
    return min(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count())) / 2**30


def read_metrics(run_dir: Path) -> dict[int, dict]:
    """Step -> its metrics: a step's training row merged with the row of its checkpoint's stall."""
    steps: dict[int, dict] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        steps[rec["step"]] = {**steps.get(rec["step"], {}), **rec}
    return steps


def command(nproc: int, overrides: list[str], run_dir: Path, total: int, resume: str) -> list[str]:
    """`torchrun -m spmd_rl.ppo` of `overrides` (a --config among them, if any) for `total` steps;
    RUN_DIR in an override stands for `run_dir`. Training data: <run_dir>/data/train.parquet."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            "-m", "spmd_rl.ppo", *(o.replace("RUN_DIR", str(run_dir)) for o in overrides), f"trainer.run_dir={run_dir}",
            f"trainer.total_steps={total}", f'data.train_files=["{run_dir}/data/train.parquet"]',
            f'trainer.resume="{resume}"']


def run_env(**extra: str) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=f"{REPO}:{os.environ.get('PYTHONPATH', '')}", **extra)


def run_worker(worker: str, args: list[str], out: Path, timeout: float) -> dict:
    """`torchrun --nproc-per-node=1 tests/gpu/<worker> ARGS --out OUT`, waited for; the JSON it wrote to
    `out` (the worker must exit 0 and write it). Its log goes to SPMD_RL_GPU_LOG_DIR as <worker>.log."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
           str(Path(__file__).with_name(worker)), *args, "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=run_env(PYTHONUNBUFFERED="1"), capture_output=True, text=True,
                          timeout=timeout)
    log = proc.stdout + proc.stderr
    if os.environ.get("SPMD_RL_GPU_LOG_DIR"):
        Path(os.environ["SPMD_RL_GPU_LOG_DIR"]).mkdir(parents=True, exist_ok=True)
        (Path(os.environ["SPMD_RL_GPU_LOG_DIR"]) / f"{Path(worker).stem}.log").write_text(log)
    errors = [i for i, line in enumerate(log.splitlines()) if line.startswith("Traceback")]
    first = "\n".join(log.splitlines()[errors[0]:errors[0] + 60]) if errors else ""
    assert proc.returncode == 0 and out.is_file(), first + "\n...\n" + log[-3000:]
    return json.loads(out.read_text())


def train(name: str, nproc: int, overrides: list[str], run_dir: Path, total: int, resume: str,
          timeout: float = 420) -> str:
    """One run to `total` steps, waited for; its log (the run must exit 0)."""
    log_path = run_dir / f"stdout-{total}.log"
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        p = subprocess.run(command(nproc, overrides, run_dir, total, resume), cwd=REPO, env=run_env(), stdout=log,
                           stderr=subprocess.STDOUT, timeout=timeout)
    text = log_path.read_text()
    assert p.returncode == 0, f"{name}: exit {p.returncode}\n{text[-4000:]}"
    return text


def train_side_by_side(runs: list[tuple[str, int, list[str]]], base: Path, total: int,
                       timeout: float = 300) -> dict[str, tuple[Path, str]]:
    """Fresh runs started at once (they share the GPUs: small models, fixed KV caches), each
    (name, ranks, overrides) in base/name, to `total` steps; {name: (run dir, log)} once every one
    has exited 0."""
    procs = []
    for name, nproc, overrides in runs:
        run_dir = base / name
        run_dir.mkdir(parents=True)
        log = open(run_dir / "stdout.log", "w")
        procs.append((name, run_dir, log, subprocess.Popen(command(nproc, overrides, run_dir, total, "none"),
                                                           cwd=REPO, env=run_env(), stdout=log,
                                                           stderr=subprocess.STDOUT)))
    out = {}
    for name, run_dir, log, p in procs:
        rc = p.wait(timeout=timeout)
        log.close()
        text = (run_dir / "stdout.log").read_text()
        assert rc == 0, f"{name}: exit {rc}\n{text[-4000:]}"
        out[name] = (run_dir, text)
    return out


def keep_logs(name: str, logs: list[str], run_dir: Path) -> None:
    """Logs and metrics to SPMD_RL_GPU_LOG_DIR (scripts/gpu_check.py prints their per-step table);
    the run dir itself holds models and checkpoints and goes."""
    keep = os.environ.get("SPMD_RL_GPU_LOG_DIR")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        (Path(keep) / f"{name}.stdout.log").write_text("\n".join(logs))
        (Path(keep) / f"{name}.metrics.jsonl").write_text((run_dir / "metrics.jsonl").read_text())


def model_root() -> Path:
    return Path(os.environ.get("SPMD_RL_GPU_MODEL_ROOT", "/tmp/spmd_rl_models"))


def random_model_dir(arch: str) -> str:
    """A Hugging Face directory of a random-weight model of shape `arch` (spmd_rl.model.loading.ARCH_PRESETS)
    with the character tokenizer, bfloat16 files (the presets' fp32 masters load them exactly),
    built once per machine under model_root(); concurrent callers wait for the first."""
    from spmd_rl.model.loading import materialize_random_model, random_model_config
    from spmd_rl.model.tokenizer import build_char_tokenizer

    root = model_root()
    root.mkdir(parents=True, exist_ok=True)
    out = root / f"{arch}-char"
    with open(root / f"{arch}-char.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        tokenizer = build_char_tokenizer()
        torch.set_num_threads(max(os.cpu_count() or 1, 1))
        device = "cuda" if torch.cuda.is_available() else "cpu"  # a GPU draws a 7B model in seconds
        materialize_random_model(str(out), random_model_config(arch, tokenizer=tokenizer), 0, torch.bfloat16, tokenizer,
                                 device)
    return str(out)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--prebuild", nargs="+", required=True, metavar="ARCH")
    for arch in ap.parse_args().prebuild:
        print(arch, random_model_dir(arch), flush=True)


def shares_gpus() -> bool:
    """Whether other processes may use this test's GPUs meanwhile (SPMD_RL_GPU_SHARED=1:
    scripts/gpu_check.py started the check beside a small one, or it is a small one with other
    checks still to start): the device's free memory is then theirs to move too, and the
    step-to-step leak check on it is off. 0 (a check with its GPUs to itself) or unset: it runs."""
    return os.environ.get("SPMD_RL_GPU_SHARED") == "1"


def expected_saves(totals: tuple[int, ...], save_every: tuple[int, ...]) -> list[int]:
    """The steps that save a checkpoint when process i runs to totals[i] with trainer.save_every =
    save_every[i] (every that many steps; 0: at its end only; -1: never), as the trainer decides."""
    saves, lo = [], 0
    for hi, every in zip(totals, save_every):
        saves += [s for s in range(lo + 1, hi + 1) if (every > 0 and s % every == 0) or (s == hi and every >= 0)]
        lo = hi
    return saves


def check_run(name: str, run_dir: Path, totals: tuple[int, ...], logs: list[str], max_mismatch: float,
              saves: list[int] | None = None, keep_last: int = 2, shared: bool = False) -> dict[int, dict]:
    """What every training run of the GPU tests must show, from its metrics.jsonl: all steps, the
    engine's log-probs at the actor's (bf16 level: a broken weight sync shows nats), no NaN, a
    resume from the first process's last checkpoint, every save of `saves` made (its stall logged;
    the last `keep_last` of them on disk, the last one `latest`), and free memory after sleep steady
    over each process's steps after its first (nothing leaks step to step or across the resume; not
    while other processes share the GPUs: `shared`, or shares_gpus()); with vLLM's generate calls (no partial
    rollouts), each step's tail (rollout/generate_tail_share) in [0, 1].
    Returns step -> metrics (step 0, validation, left out)."""
    tail = logs[-1][-4000:]
    steps = {s: m for s, m in read_metrics(run_dir).items() if s > 0}
    assert sorted(steps) == list(range(1, totals[-1] + 1)), (name, sorted(steps), tail)
    for s, m in steps.items():
        assert m["rollout/logprob_diff_mean"] < max_mismatch, (name, s, m["rollout/logprob_diff_mean"])
        for k, v in m.items():
            assert v == v, (name, s, k)
    if len(totals) > 1:  # the second process resumed from the first one's last checkpoint
        first = totals[0]
        assert f"resumed from {run_dir}/checkpoints/step_{first} at step {first}" in logs[1], logs[1][-4000:]
    if saves is not None:
        for s in saves:
            assert "time/checkpoint" in steps[s], (name, s, "the save asked for at this step did not happen", tail)
        names = [p.name for p in (run_dir / "checkpoints").glob("step_*")]
        assert all(n[5:].isdigit() for n in names), (name, names, "unfinished saves left at the end")
        ckpts = sorted(names, key=lambda n: int(n[5:]))
        assert ckpts == [f"step_{s}" for s in saves[-keep_last:]], (name, ckpts, "asked for", saves, keep_last)
        if saves:
            assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{saves[-1]}"
    free = [steps[s]["memory/free_after_sleep_gb"] for s in sorted(steps)]
    bounds = [0, *totals]
    # Each process's steps after its own first one: a process's first step makes the GPU state it keeps
    # (AdamW's moments in a fresh run; in a resumed one too, lazily made communication and library
    # buffers: docs/performance.md, "Two and four GPUs"). From there on nothing may leak, within a
    # process or across the resume.
    steady = [free[s - 1] for lo, hi in zip(bounds, bounds[1:]) for s in range(lo + 2, hi + 1)]
    if not (shared or shares_gpus()):
        assert all(hi - lo >= 2 for lo, hi in zip(bounds, bounds[1:])) and len(steady) >= 2, (
            f"{name}: too few steps after each process's first to see free memory drift ({totals}: {free})")
        assert max(steady) - min(steady) < 0.5, (
            f"{name}: free memory after sleep drifts (each process's steps after its first): {free}")
    for s, m in steps.items():  # true memory figures: nothing above the card
        for k, v in m.items():
            if k.startswith("memory/") and k.endswith(("_peak_gb", "_device_gb")):
                assert 0 <= v <= m["memory/device_total_gb"] + 0.01, (name, s, k, v)
    if "vLLM engine ready" in logs[0] and "rollout/staleness_mean" not in steps[1]:  # vLLM's generate calls
        tails = [steps[s].get("rollout/generate_tail_share") for s in sorted(steps)]
        assert all(t is not None and 0 <= t <= 1 for t in tails), (name, "rollout/generate_tail_share", tails)
    return steps


def summary(name: str, steps: dict[int, dict]) -> str:
    last = steps[max(steps)]
    return name + " " + json.dumps({k: [round(steps[s][k], 4) for s in sorted(steps) if k in steps[s]]
                                    for k in sorted(last) if k.startswith(("time/", "memory/", "rollout/", "perf/"))})
