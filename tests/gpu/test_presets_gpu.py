"""Every shipped GPU preset, as shipped, for 3 steps with a checkpoint, then a resume in a new
process (what we test is what users run). scripts/gpu_check.py runs each case on the
smallest machine it fits (for qwen7b the cards' memory decides: Preset.gpus_by_memory);
tests/scripts/test_gpu_check_plan.py fails when a file in configs/ has no entry here (or in CPU_PRESETS),
so no preset ships untested.

What each case changes, and only this: the model is a random-weight Hugging Face directory of the
preset's shape (model.path, the preset's placeholder; tests/gpu/runs.random_model_dir, the character
tokenizer: no hub on the GPU machines); the data are synthetic arithmetic prompts with 128-token
prompts and responses (random weights never stop early: a 1024-token response would only cost
time); validation runs on 128 synthetic prompts after each process's last step; the steps; and,
where the preset's batch does not fit two GPUs or the short responses, the batch sizes or the one
key tied to the response length, each named with its reason below. Engine, training, fused-kernel
and checkpoint settings stay the preset's: CUDA graphs, sleep mode, custom all-reduce at TP=2,
packing and token budgets, torch.compile'd layers and log-prob head, asynchronous checkpoints.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
from runs import REPO, card_gib, check_run, expected_saves, keep_logs, random_model_dir, skip_reason, summary, train

from spmd_rl.config.run_config import load_config

pytestmark = pytest.mark.gpu


@dataclass(frozen=True)
class Preset:
    gpus: int
    """The smallest machine it runs on (GPUs of one host), with 80 GB cards."""
    arch: str
    """Its model's shape (spmd_rl.model.loading.ARCH_PRESETS)."""
    changes: tuple[str, ...] = ()
    """Overrides beyond the model, the data and the steps, each for a stated reason (see PRESETS)."""
    steps: tuple[int, int] = (3, 5)
    """Steps of the first process, then the total after the resume: 2 or more each, so that the
    count of compiled graphs has two values to compare in each process (from the end of its first
    step on it must not grow), and so has free memory after sleep."""
    save_every: tuple[int, int] = (1, 1)
    """trainer.save_every of each process (-1: none; 0: at its end only)."""
    in_memory: bool = False
    """Run dir (and checkpoints) in /dev/shm (SPMD_RL_GPU_MEMORY_DIR: scripts/gpu_check.py gives each
    check its own and removes it however the check ends): a 7B checkpoint (86 GB) takes a minute each
    way on the device's disk, and two do not fit it."""
    max_mismatch: float = 0.05
    """Bound of rollout/logprob_diff_mean (bf16 level at this shape; a broken sync shows nats)."""
    timeout: tuple[float, float] = (420, 300)
    gpus_by_memory: tuple[tuple[float, int], ...] = ()
    """(GiB per card, GPUs) pairs, in order: where every card has at least that much memory, it runs
    on that many GPUs instead of `gpus` (scripts/gpu_check.py's check has the same pairs: a CPU test
    compares them)."""

    config: str = ""
    """configs/<config>.toml, where the case is a variant of a preset (empty: the case's name)."""

    def gpus_on(self, card_gib: float) -> int:
        """The GPUs it runs on where each card has `card_gib` GiB (0: unknown, `gpus`)."""
        return next((n for gib, n in self.gpus_by_memory if card_gib and card_gib >= gib), self.gpus)


def config_path(name: str) -> Path:
    return REPO / "configs" / f"{PRESETS[name].config or name}.toml"


PRESETS: dict[str, Preset] = {  # configs/<name>.toml, or <config>.toml for a variant
    "qwen0.5b-gsm8k": Preset(gpus=1, arch="qwen2-0.5b"),
    "qwen1.5b-gsm8k": Preset(gpus=1, arch="qwen2-1.5b"),
    # multi-turn with the calculator tool: the char tokenizer's template renders the tool messages
    "qwen0.5b-gsm8k-tool": Preset(gpus=1, arch="qwen2-0.5b"),
    # the same at TP=2 on two GPUs: multi-turn rollouts through a tensor-parallel engine (one replica)
    "qwen0.5b-gsm8k-tool-tp2": Preset(gpus=2, arch="qwen2-0.5b", config="qwen0.5b-gsm8k-tool",
                                      changes=("rollout.tensor_parallel_size=2",)),
    # 256 prompts would be 2048 responses on one TP=2 replica (8 GPUs make 4): 16 prompts in 2
    # mini-batches of 8 keep the preset's 2 optimizer steps per step. The random 7B shape's mismatch
    # is 0.052 (bf16 at this shape, with NCCL or custom all-reduce alike: scripts/probes/probe_mismatch.py).
    # On two 80 GB cards it does not fit, with or without the optimizer's moments on the host (its
    # update, 82 GiB predicted: a CUDA OOM in the update on two H100s, 2026-11-26): the start-up
    # memory check refuses it there, naming 4 GPUs or LoRA; so 4 of them, or two cards of 120 GiB or
    # more (141 GB H200s run it as shipped).
    "qwen7b": Preset(gpus=4, gpus_by_memory=((120.0, 2),), arch="qwen2-7b",
                     changes=("data.train_batch_size=16", "actor.ppo_mini_batch_size=8"),
                     save_every=(0, -1), in_memory=True, max_mismatch=0.1, timeout=(540, 360)),
    # LoRA on one 80 GB GPU, as shipped: the 7-8B shapes' bf16 mismatch is ~0.04 (0.041 for qwen2-7b at
    # TP=1, adapter and merged sync alike: docs/performance.md, "LoRA: adapter or merged sync"); the
    # checkpoints hold the adapter and its optimizer only
    "qwen7b-lora": Preset(gpus=1, arch="qwen2-7b", max_mismatch=0.1, timeout=(540, 360)),
    "qwen3-8b-lora": Preset(gpus=1, arch="qwen3-8b", max_mismatch=0.1, timeout=(540, 360)),
    "llama3.1-8b-lora": Preset(gpus=1, arch="llama3.1-8b", max_mismatch=0.1, timeout=(540, 360)),
    # a mixture of experts (Qwen3-30B-A3B's shape: 61 GB of bf16 base) with LoRA on four 80 GB GPUs, the
    # engine at TP=4 with vLLM's fused-MoE kernels (the bundle with its MoE kernels: scripts/gpu_check.sh)
    "qwen3-30b-a3b-lora": Preset(gpus=4, arch="qwen3-30b-a3b", max_mismatch=0.1, timeout=(600, 420)),
    # every parameter trained: 8 GPUs of 141 GB (one node), or 16 of 80 GB, which no single host has (n/a
    # there); 16 prompts in 2 mini-batches of 8 keep the preset's optimizer steps per step, as for qwen7b
    "qwen3-30b-a3b": Preset(gpus=16, gpus_by_memory=((120.0, 8),), arch="qwen3-30b-a3b",
                            changes=("data.train_batch_size=16", "actor.ppo_mini_batch_size=8"),
                            save_every=(0, -1), in_memory=True, max_mismatch=0.1, timeout=(900, 600)),
    # its overlong buffer (4096 tokens) must be shorter than the responses: 32 of the 128
    "qwen1.5b-long": Preset(gpus=2, arch="qwen2-1.5b", changes=("reward.overlong_buffer=32",), save_every=(0, -1)),
}

CPU_PRESETS: dict[str, str] = {  # configs/<name>.toml that run on CPU, and where they are tested
    "tiny-cpu": "tests/e2e/test_e2e.py trains it on 2 CPU ranks in every CI run",
}

DATA = ['model.init="pretrained"', 'model.tokenizer="char"', 'data.synthetic_task="arithmetic"',
        "data.synthetic_size=1024", "data.apply_chat_template=false", "data.max_prompt_length=128",
        "data.max_response_length=128", 'data.val_files=["RUN_DIR/data/val.parquet"]', "data.val_batch_size=128",
        "trainer.val_every=0"]


def preset_overrides(name: str, model_dir: str, save_every: int) -> list[str]:
    p = PRESETS[name]
    return ["--config", str(config_path(name)), f'model.path="{model_dir}"', *DATA, *p.changes,
            f"trainer.save_every={save_every}"]


def check_speed_settings(name: str, logs: list[str], run_dir: Path) -> None:
    """A preset shipping "auto" settings (spmd_rl/preflight/speed_settings.py): each process logs one
    line of what it chose, something fits, the resumed process chose the same on the same GPUs, and
    config.toml notes the values; the run itself (check_run) shows they ran without running out of memory."""
    if '"auto"' not in config_path(name).read_text():
        return
    lines = [next((line.split("speed settings (auto): ", 1)[1] for line in log.splitlines()
                   if "speed settings (auto): " in line), None) for log in logs]
    assert all(lines) and len(set(lines)) == 1, (name, lines)
    assert not lines[0].startswith("nothing fits"), (name, lines[0])
    assert '"auto" chose this' in (run_dir / "config.toml").read_text(), name


def check_running_cap(name: str, steps: dict[int, dict]) -> None:
    """A preset with rollout.max_num_seqs = "auto": every step's engine ran under a cap of its own
    (spmd_rl/rollout/vllm/running_cap.py: vLLM's scheduler reached in this vLLM)."""
    if 'max_num_seqs = "auto"' not in config_path(name).read_text():
        return
    caps = [steps[s].get("rollout/engine_max_running", 0.0) for s in sorted(steps)]
    assert all(c >= 1 for c in caps), (name, caps, "no per-call cap: see the warning of running_cap.py in the log")


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_trains_saves_and_resumes(name, tmp_path):
    p = PRESETS[name]
    gpus = p.gpus_on(card_gib())
    reason = skip_reason(gpus)
    if reason:
        pytest.skip(reason)
    model_dir = random_model_dir(p.arch)
    memory = os.environ.get("SPMD_RL_GPU_MEMORY_DIR") or ("/dev/shm/spmd_rl_presets" if Path("/dev/shm").is_dir() else "")
    run_dir = (Path(memory) if p.in_memory and memory else tmp_path) / name
    shutil.rmtree(run_dir, ignore_errors=True)
    try:
        logs = [train(name, gpus, preset_overrides(name, model_dir, p.save_every[i]), run_dir, total,
                      "none" if i == 0 else "auto", timeout=p.timeout[i])
                for i, total in enumerate(p.steps)]
        check_speed_settings(name, logs, run_dir)
        keep_last = load_config(str(config_path(name)), []).trainer.keep_last
        steps = check_run(name, run_dir, p.steps, logs, p.max_mismatch, saves=expected_saves(p.steps, p.save_every),
                          keep_last=keep_last)
        check_running_cap(name, steps)
        graphs = [steps[s]["perf/compiled_graphs"] for s in range(1, p.steps[-1] + 1)]  # the preset compiles
        for lo, hi in zip((0, *p.steps), p.steps):  # each process: its count after its first step, then no more
            assert hi - lo >= 2 and len(set(graphs[lo:hi])) == 1, (
                name, f"steps {lo + 1}-{hi}", graphs, "graphs compiled after a process's first step: torch.compile "
                "recompiles per micro-batch")
        keep_logs(name, logs, run_dir)
        print(summary(name, steps))
    finally:  # the checkpoints go (GBs); the logs stay for scripts/gpu_check.py to keep if the check fails
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
