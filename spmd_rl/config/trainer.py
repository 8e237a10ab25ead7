"""[trainer]: the loop: steps, validation, checkpoints, logging, parallel layout."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from spmd_rl.config.checks import Rule, cannot_write, need
from spmd_rl.errors import ConfigError  # noqa: F401

if TYPE_CHECKING:
    from spmd_rl.config.run_config import Config

CHOICES: dict[str, tuple[str, ...]] = {
    "device": ("auto", "cuda", "cpu"),
    "memory_check": ("error", "warn", "off"),
}
"""Each key that takes one of a few values: its values (checked by Config.check_choices)."""


@dataclass
class TrainerConfig:
    experiment_name: str = "default"
    """Name of the run; the default run directory is runs/<experiment_name>."""
    run_dir: str = ""
    """Where config, logs, TensorBoard events, checkpoints and generated data go;
    empty = runs/<experiment_name>."""
    total_steps: int = 100
    """Training steps to run (a step = one train_batch_size of prompts)."""
    seed: int = 1
    """Seed of data order, sampling and dropout."""
    device: str = "auto"
    """auto (cuda if available, else cpu), cuda or cpu."""
    fsdp_size: int = 0
    """Ranks per FSDP shard group (verl's fsdp_size). 0 = all ranks: plain FSDP, each parameter
    sharded over the whole world. Otherwise hybrid sharding (HSDP): the ranks form
    world / fsdp_size groups of fsdp_size consecutive ranks; each group holds the model, its
    gradients and optimizer state sharded over its ranks, and the groups are replicas, kept equal
    by an all-reduce of the gradients across groups once per optimizer step. The update is the
    same as plain FSDP's (gradients are averaged over all ranks either way). Must divide the world
    size. On several nodes: the GPUs per node (one node per shard group) when the training states
    fit in one node (about 16 bytes per parameter over fsdp_size GPUs with float32 masters and
    AdamW, plus activations), so parameter gathers and the weight sync stay inside a node and only
    the gradient all-reduce crosses the network; else a multiple of the GPUs per node
    (docs/multinode.md)."""
    ulysses_size: int = 1
    """Sequence parallelism (DeepSpeed-Ulysses; verl's ulysses_sequence_parallel_size) for long
    responses whose activations do not fit one GPU: groups of this many consecutive ranks share
    every packed micro-batch of actor, reference and critic, each rank holding 1/ulysses_size of
    its tokens; attention splits the heads across the group instead (an all-to-all before and
    after it; spmd_rl/batching/sequence_parallel.py). Data parallelism is over world / ulysses_size groups:
    `*.micro_batch_size_per_gpu` counts sequences per group and each mini-batch is cut per group,
    while the token budgets (`*max_token_len_per_gpu`) stay per GPU, so a group's micro-batch holds
    up to ulysses_size times the budget. Needs model.remove_padding; must divide the world size,
    trainer.fsdp_size (a group lies inside a shard group) and the model's attention heads, and its
    KV heads must divide by it or divide it (then each is replicated, as verl does). Rollout,
    weight sync and checkpoints are the same as without it; a checkpoint resumes under another
    ulysses_size. Costs 4 all-to-alls per decoder layer in forward (4 more in backward) over the
    group's activations. When: the longest prompt + response (with gradient checkpointing) does
    not fit one GPU's update micro-batch, or leaves no room for a useful token budget
    (scripts/bench/bench_ulysses.py measures the longest sequence that fits at each size; the preset
    qwen1.5b-long uses 2 for 16k-token responses); keep the group inside a node (NVLink). Where
    the longest sequence fits one GPU, plain data parallelism is faster. 1 = off."""
    val_every: int = 0
    """Validate every this many steps and after the last one (0 = only after the last; -1 = never,
    not even after the last: for benchmarks, whose random weights never stop and so validate at
    full length). Needs validation prompts: data.val_files, or data.synthetic_task's own."""
    val_before_train: bool = False
    """Validate once before the first step."""
    save_every: int = 0
    """Checkpoint every this many steps (0 = only at the end; -1 = never, not even at the end: for
    benchmarks and throwaway runs whose checkpoints would only fill the disk. A stop signal, such
    as a SLURM preemption, still writes one)."""
    keep_last: int = 2
    """Checkpoints kept on disk. Older ones are deleted once a newer one is complete, so a save
    needs room for keep_last + 1 checkpoints at its peak; a save short of space first removes the
    older ones it replaces (never the latest complete one), and is skipped with one warning line
    when even that is not enough (training goes on). The start-up line `checkpoints: ...` gives a
    save's bytes, this peak and the free space (spmd_rl/checkpoint/space.py)."""
    checkpoint_dir: str = ""
    """Where checkpoints go (verl's trainer.default_local_dir), e.g. a filesystem with more room
    than the run directory's; empty = <run_dir>/checkpoints. trainer.resume = "auto" looks here.
    One filesystem every rank sees (shared, on several nodes): rank 0 measures its free space for
    every rank and verifies every rank's files. One run at a time (a .lock inside it, as run_dir's);
    each checkpoint's manifest.json names its run_dir, where the export finds config.toml."""
    resume: str = "auto"
    """"auto": continue from the latest complete checkpoint in run_dir if any; "none": start fresh
    (refuses to run if run_dir already has checkpoints); or a checkpoint directory. A checkpoint
    resumes on any number of ranks: models and optimizers are resharded, the data order continues
    exactly (the per-rank random states start afresh)."""
    log_every: int = 1
    """Console summary every this many steps (TensorBoard gets every step)."""
    log_samples: int = 3
    """Prompts shown with the responses the engine sampled for them, their rewards, ground truths and
    (multi-turn) the whole conversation with roles, at each validation and every
    log_samples_every training steps: to <run_dir>/samples.jsonl, TensorBoard text `samples/val`,
    `samples/train` and the console (short). At a validation: the first log_samples prompts of the
    validation data, the same ones every time so one sees them improve (the first of their
    rollout.val_n responses); at a training step: the step's first log_samples prompts (the first of
    their rollout.n responses). 0 = none (spmd_rl/telemetry/samples.py)."""
    log_samples_every: int = 0
    """Show log_samples prompts of the training batch every this many steps (as log_samples says);
    0 = only at validations. Set it (e.g. 10) to watch a run without validation data."""
    tensorboard: bool = True
    """Write TensorBoard events under <run_dir>/tensorboard."""
    peak_tflops: float = 0.0
    """Per-GPU dense bf16 peak for MFU; 0 = from the GPU name (H100/H200: 989)."""
    async_save: bool = True
    """Write checkpoints in the background: the step waits only while the state is copied to host
    memory (pinned on GPU; it costs host RAM of the size of this rank's model + optimizer shards,
    kept for the run), the files are written while the next steps train; at most one save in
    flight; a checkpoint becomes `latest` only once written and verified. false = the step waits
    for the whole write. The end of the run and a stop signal wait for the save in flight."""
    balance_ranks: bool = True
    """Before the log-prob passes and the updates, move rollout rows between ranks so every rank
    holds nearly the same number of tokens (verl's balance_batch; Karmarkar-Karp on prompt +
    response lengths): otherwise the rank that drew the longest responses sets the pace of every
    collective. Prompt groups stay on one rank and every mini-batch keeps its rows, so the update
    is the same as without it (spmd_rl/batching/rank_balance.py). Each rank keeps its number of rows.
    Metrics batch/rank_tokens_max_over_mean_before / _after. No effect on one rank."""
    export_hf_dir: str = ""
    """After the last step, rank 0 writes the final actor here as a Hugging Face model directory
    (safetensors, config, tokenizer; what `python -m spmd_rl.export` does for any checkpoint);
    empty = no export. Must not exist yet (or be empty)."""
    profile_steps: list[int] = field(default_factory=list)
    """Steps to run under torch.profiler (verl's profile_steps), e.g. [3]: each rank writes
    <run_dir>/profile/step_<N>_rank<R>.json.gz (the trace, every phase a named range) and .txt
    (per phase: wall ms, the ms the GPU was busy during it and the ms of Python's garbage
    collection in it; for a phase whose GPU idled, the host ops it idled in and when in the phase; for a
    phase whose GPU worked, its kernels by device time; then the ops with the most device time). A profiled step runs slower
    (the host more than the GPU) and its times are not the run's;
    pick one after the first (which compiles). Empty = never (spmd_rl/telemetry/step_profiler.py)."""

    memory_check: str = "error"
    """At start-up, before any model loads, each GPU's peak memory is predicted from the model's
    shape and the config (training state by role, activations of the micro-batches, vLLM's
    rollout.gpu_memory_utilization share; spmd_rl/runtime/memory_plan.py) and logged as one line,
    `memory: predicted peak per GPU ... of ... GiB`. "error": a run predicted not to fit the GPU
    stops there, with the numbers and the fixes (rollout.offload_train_states, more GPUs, a lower
    rollout.gpu_memory_utilization, smaller token budgets); "warn": the same message as a warning,
    and the run goes on (the prediction is within about 10% of the measured peaks; a run close to
    the limit may still fit); "off": no prediction and no line (a model whose config.json the
    dense-decoder formula does not describe). An out-of-memory error during a step is reported as
    one line naming the phase, the prediction and the fix, whatever this says."""

    def check_layout(self, world_size: int, gpus_per_node: int | None) -> None:
        """trainer.fsdp_size cuts the `world_size` ranks into whole shard groups."""
        need(self.fsdp_size >= 0, f"trainer.fsdp_size = {self.fsdp_size} must be >= 0 (0 = shard over all ranks)")
        per_node = f"the {gpus_per_node} GPUs per node" if gpus_per_node else "the GPUs per node"
        need(self.fsdp_size == 0 or world_size % self.fsdp_size == 0,
              f"trainer.fsdp_size = {self.fsdp_size} does not divide the world size {world_size} (it is the ranks per "
              f"shard group; the model is replicated across the groups): use a divisor of {world_size}, e.g. "
              f"{per_node} on several nodes, or 0 to shard over all ranks")

    def check_ulysses(self, cfg: Config, world_size: int) -> None:
        """trainer.ulysses_size (sequence parallelism, spmd_rl/batching/sequence_parallel.py): it divides the
        world and the shard group, and the rows are packed (the models' attention heads:
        preflight.models.check_attention_heads)."""
        sp, m = self.ulysses_size, cfg.model
        if sp < 1:
            raise ConfigError(f"trainer.ulysses_size = {sp} must be >= 1 (1 = no sequence parallelism)")
        if sp == 1:
            return
        divisors = [k for k in range(1, world_size + 1) if world_size % k == 0]
        if world_size % sp:
            raise ConfigError(f"trainer.ulysses_size = {sp} does not divide the world size {world_size} (it is the ranks "
                              f"that share each micro-batch): use one of {', '.join(map(str, divisors))}")
        if self.fsdp_size and self.fsdp_size % sp:
            raise ConfigError(f"trainer.ulysses_size = {sp} does not divide trainer.fsdp_size = {self.fsdp_size}: a "
                              "sequence-parallel group must lie inside a shard group; use a divisor of "
                              f"{self.fsdp_size}, or a trainer.fsdp_size that {sp} divides")
        if not m.remove_padding:
            raise ConfigError(f"trainer.ulysses_size = {sp} splits packed rows across ranks: set "
                              "model.remove_padding = true")
        if m.share_prompts:
            raise ConfigError(f"trainer.ulysses_size = {sp} splits packed rows across ranks, which shared prompts "
                              "(model.share_prompts = true) do not: set model.share_prompts = false, or "
                              "trainer.ulysses_size = 1")

    def check(self, run_dir: str, checkpoint_dir: str) -> None:
        """Steps and checkpoints in range; the resume target exists; `run_dir` (Config.run_dir),
        `checkpoint_dir` (Config.checkpoint_dir) and the export directory can be written."""
        need(self.total_steps >= 1, "trainer.total_steps must be >= 1")
        need(self.keep_last >= 1, "trainer.keep_last must be >= 1 (the latest checkpoint is always kept)")
        outside = [s for s in self.profile_steps if not 1 <= s <= self.total_steps]
        need(not outside, f"trainer.profile_steps = {self.profile_steps}: {outside} not between 1 and trainer.total_steps = "
              f"{self.total_steps}; name steps of this run (e.g. [2]), or [] to profile none")
        if self.resume not in ("auto", "none"):
            need(os.path.isdir(self.resume), f"trainer.resume = {self.resume!r} is not a checkpoint directory "
                  '(use "auto", "none" or an existing step_N directory)')
        problem = cannot_write(run_dir)
        need(problem is None, f"trainer.run_dir = {run_dir!r} cannot be used ({problem}): choose another directory")
        if self.checkpoint_dir:
            problem = cannot_write(checkpoint_dir)
            need(problem is None, f"trainer.checkpoint_dir = {checkpoint_dir!r} cannot be used ({problem}): choose "
                  "another directory")
        if self.export_hf_dir:
            problem = cannot_write(self.export_hf_dir)
            need(problem is None, f"trainer.export_hf_dir = {self.export_hf_dir!r} cannot be used ({problem}): choose "
                  "another directory")
            need(not (os.path.exists(self.export_hf_dir) and os.listdir(self.export_hf_dir)),
                  f"trainer.export_hf_dir = {self.export_hf_dir!r} exists and is not empty: choose a new directory "
                  "(the export would otherwise fail after training)")

    def ranges(self, cfg: Config) -> list[Rule]:
        return [
            ("val_every", self.val_every >= -1, ">= -1 (0 = only after the last step, -1 = never)"), ("save_every", self.save_every >= -1, ">= -1 (0 = only at the end, -1 = never)"),
            ("log_every", self.log_every >= 1, ">= 1"), ("log_samples", self.log_samples >= 0, ">= 0 (0 = none)"),
            ("log_samples_every", self.log_samples_every >= 0, ">= 0 (0 = only at validations)"), ("peak_tflops", self.peak_tflops >= 0, ">= 0"),
            ("experiment_name", bool(self.experiment_name.strip()), "a non-empty name"),
            ("seed", self.seed >= 0, ">= 0"),
        ]
