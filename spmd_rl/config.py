"""Every setting of a run, in one place.

A run is configured by a TOML file whose tables mirror the dataclasses below
(`[model]`, `[data]`, `[rollout]`, ...) plus dotted overrides on the command
line (`actor.lr=1e-6`). Each key is documented by the string right under it;
`python -m spmd_rl.config --markdown` prints the reference (docs/config.md).

Batch sizes follow verl: *algorithm* sizes are global and counted in prompts
(`data.train_batch_size`, `actor.ppo_mini_batch_size`); *performance* sizes are
per GPU and counted in sequences (`*.micro_batch_size_per_gpu`). The derived
per-rank numbers are printed at start (`Config.describe_layout`).

`load_config` (reading: spmd_rl/config_toml.py) refuses unknown keys and wrong types;
`validate` refuses impossible combinations, running the checks each section keeps beside
its keys (`check...`, `ranges`). Each refusal is one message that names the key and the fix,
before any model is loaded.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import math
import os
import sys
import typing
from dataclasses import dataclass, field
from typing import Any

from spmd_rl import config_toml
from spmd_rl.config_toml import to_dict, to_toml, tomllib  # noqa: F401  (spmd_rl.config.to_toml etc. for callers)
from spmd_rl.errors import ConfigError, UserError  # noqa: F401  (ConfigError: spmd_rl.config.ConfigError for callers)


# --------------------------------------------------------------------------- checks


Rule = tuple[str, bool, str]
"""A range rule of a section's key: (key, whether its value is in range, the range in words)."""


def _need(ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(msg)


def _cannot_write(path: str) -> str | None:
    """Why no directory can be created and written at `path` (None: it can), from the nearest part
    of it that exists. Found here, before the process group exists, not by a makedirs traceback."""
    target = p = os.path.abspath(path)
    while not os.path.exists(p):
        p = os.path.dirname(p)
    if not os.path.isdir(p):
        return "it is a file" if p == target else f"{p!r} is a file"
    if not os.access(p, os.W_OK | os.X_OK):
        return f"{p!r} is not writable"
    return None


def _ordinal(k: int) -> str:
    """2 -> "2nd", 8 -> "8th", 11 -> "11th", 21 -> "21st"."""
    suffix = "th" if 10 <= k % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(k % 10, "th")
    return f"{k}{suffix}"


# --------------------------------------------------------------------------- sections


@dataclass
class ModelConfig:
    path: str = ""
    """Local Hugging Face model directory (config.json, safetensors, tokenizer). With
    `init = "random"` it may hold only config.json (+ tokenizer); weights are then random. Checked
    before anything loads: config.json, its model_type, the weight files' completeness."""
    init: str = "pretrained"
    """"pretrained": load the weights in `path`. "random": random weights from the architecture
    (`path`'s config.json or the preset `arch`), built once by rank 0 and saved to
    `<run_dir>/init_model`, then loaded by every rank exactly like a pretrained model."""
    arch: str = ""
    """With `init = "random"` and no `path`: a preset architecture, one of
    tiny, small, qwen2-0.5b, qwen2-1.5b, qwen2-7b (see spmd_rl/models.py ARCH_PRESETS)."""
    tokenizer: str = ""
    """Tokenizer directory; empty = `path`. "char" = the built-in character tokenizer used by the
    synthetic tasks (digits, letters, punctuation; it carries a chat template). It may not have
    more tokens than the model's vocab_size (fewer is normal: padded vocabularies)."""
    dtype: str = "float32"
    """Dtype of the master (optimizer) weights of actor/critic/reference: float32 or bfloat16."""
    compute_dtype: str = "bfloat16"
    """FSDP2 mixed-precision parameter dtype for forward/backward: bfloat16 or float32. On CPU
    use float32 (bf16 matmuls are slow there)."""
    attn_implementation: str = "sdpa"
    """transformers attention backend for the training-side models: sdpa or eager."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward (saves memory on long responses)."""
    gradient_checkpointing_layers: float = 1.0
    """With `gradient_checkpointing`: the share of the decoder layers that recompute, spread evenly
    over the stack (0.5: every other layer); the others keep their activations for backward. Less
    is faster and takes more memory: the 1.5B update alone at 16384-token micro-batches ran at
    38.2% MFU with every layer checkpointed and 47.1% with none (1xH100, docs/performance.md).
    Applies to actor and critic (the reference model has no backward). 1.0 = every layer."""
    seed: int = 0
    """Seed for random weights (`init = "random"`) and the critic's value head."""
    remove_padding: bool = False
    """Pack each micro-batch's sequences into one row without padding, for actor, reference and
    critic, forward and backward: position ids restart per sequence and attention stays within a
    sequence (PyTorch's variable-length FlashAttention kernel on CUDA, per-sequence SDPA on CPU).
    No compute or memory goes to padding; needed for the token budgets (`*.max_token_len_per_gpu`)."""
    chunked_logprobs: bool = True
    """Compute token log-probs and entropy from the last hidden states in chunks, never holding the
    [tokens, vocab] float32 logits (6 GB for 10k tokens of a 152k vocabulary); backward recomputes
    each chunk. false = the plain full-logits path (more memory; kept for comparison)."""
    fsdp_forward_prefetch: bool = False
    """FSDP2: each decoder layer starts the all-gather of the next one explicitly in forward."""
    fused_kernels: str = "none"
    """Fused kernels in the decoder layers of actor, reference and critic (spmd_rl/fused_kernels.py).
    "liger": liger-kernel's Triton RMSNorm, rotary embedding and SiLU-multiply on this model's
    modules (Qwen2 models; CUDA; install the `gpu` extra). "compile": torch.compile of each decoder
    layer (dynamic shapes: no recompile per packed length; compiling takes a minute or so at start).
    "none": transformers' modules as they are. Without CUDA, Triton or liger-kernel, "liger" runs
    unfused with one warning. Same numbers up to bf16 rounding."""
    fused_logprob_head: str = "none"
    """How the log-prob head (`chunked_logprobs`) computes each chunk's log-sum-exp, target log-prob,
    entropy and, in backward, the logits' gradient: "none" = eager float32 passes over the
    [chunk, vocab] logits; "compile" = torch.compile'd, one or two fused kernels per chunk reading
    the bf16 logits (same formulas and chunks; needs `chunked_logprobs`). No liger-kernel op fits:
    its fused linear losses take no temperature and give no per-token entropy."""

    def check(self) -> None:
        """The model keys together (the files they name: model_files.check_model_inputs)."""
        if self.init == "pretrained":
            _need(bool(self.path), 'model.path is empty: set it to a local model directory, or use model.init = "random" with model.arch')
        else:
            _need(bool(self.path) or bool(self.arch), 'model.init = "random" needs model.arch (a preset) or model.path (a config.json)')
            if not self.path:
                from spmd_rl.models import ARCH_PRESETS

                _need(self.arch in ARCH_PRESETS, f"model.arch = {self.arch!r} is not a preset: use one of {', '.join(ARCH_PRESETS)}")
            _need(bool(self.tokenizer) or bool(self.path),
                  'model.init = "random" with a preset arch needs model.tokenizer (a directory, or "char")')
        _need(self.gradient_checkpointing or self.gradient_checkpointing_layers == 1.0,
              f"model.gradient_checkpointing_layers = {self.gradient_checkpointing_layers} needs "
              "model.gradient_checkpointing = true (without it no layer is checkpointed)")
        _need(self.fused_logprob_head == "none" or self.chunked_logprobs,
              f"model.fused_logprob_head = {self.fused_logprob_head!r} fuses the chunked log-prob head: set "
              "model.chunked_logprobs = true, or model.fused_logprob_head = \"none\"")

    def ranges(self, cfg: Config) -> list[Rule]:
        return [("seed", self.seed >= 0, ">= 0"),
                ("gradient_checkpointing_layers", 0 < self.gradient_checkpointing_layers <= 1, "in (0, 1]")]

    def checkpointed_share(self) -> float:
        """The share of decoder layers the actor and critic checkpoint (0: none)."""
        return self.gradient_checkpointing_layers if self.gradient_checkpointing else 0.0


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)
    """Training Parquet files (schema: docs/data.md)."""
    val_files: list[str] = field(default_factory=list)
    """Held-out Parquet files for validation; empty = no validation."""
    synthetic_task: str = ""
    """If set and `train_files` do not exist yet, rank 0 writes them (and `val_files`) with this
    offline synthetic task before anything else runs: "successor" (learnable by a tiny random model)
    or "arithmetic" (word problems with exact answers), or "hidden" (a random digit only an environment
    reveals: spmd_rl/envs/hidden_digit.py). See scripts/make_synthetic.py."""
    synthetic_size: int = 2048
    """Number of training rows written for `synthetic_task` (validation gets a quarter)."""
    train_batch_size: int = 8
    """Prompts per training step, global over all ranks (each prompt gets `rollout.n` samples)."""
    max_prompt_length: int = 512
    """Prompts longer than this many tokens are dropped when the data is loaded (count logged)."""
    max_response_length: int = 256
    """Most tokens generated per response."""
    shuffle: bool = True
    """Reshuffle the training data every epoch (deterministic in `trainer.seed` and the epoch)."""
    apply_chat_template: bool = True
    """Render chat-message prompts with the tokenizer's chat template (plain-text prompts are
    tokenized as they are)."""
    val_batch_size: int = 64
    """Prompts per validation generation call, global."""

    def check(self) -> None:
        """The data files exist (or data.synthetic_task can write them) and the sizes are positive."""
        _need(bool(self.train_files), "data.train_files is empty: list at least one Parquet file")
        for f in self.train_files + self.val_files:
            _need(not os.path.isdir(f), f"data file {f!r} is a directory: list the Parquet files in it in "
                  "data.train_files / data.val_files")
        if not self.synthetic_task:
            for f in self.train_files + self.val_files:
                _need(os.path.isfile(f), f"data file {f!r} does not exist: fix data.train_files / data.val_files, "
                      "or set data.synthetic_task to generate it")
        elif not all(os.path.isfile(f) for f in self.train_files):  # rank 0 writes the first train and val file
            for f in self.train_files[:1] + self.val_files[:1]:
                problem = _cannot_write(os.path.dirname(f) or ".")
                _need(problem is None, f"data file {f!r} cannot be written for data.synthetic_task ({problem}): "
                      "choose another directory in data.train_files / data.val_files")
        _need(self.train_batch_size > 0, "data.train_batch_size must be > 0")
        _need(self.max_prompt_length > 0 and self.max_response_length > 0,
              "data.max_prompt_length and data.max_response_length must be > 0")

    def check_layout(self, world_size: int) -> None:
        _need(self.train_batch_size % world_size == 0,
              f"data.train_batch_size = {self.train_batch_size} does not divide by the {world_size} ranks: "
              f"make it a multiple of {world_size}")

    def ranges(self, cfg: Config) -> list[Rule]:
        return [("val_batch_size", self.val_batch_size > 0, "> 0"),
                ("synthetic_size", not self.synthetic_task or self.synthetic_size >= self.train_batch_size,
                 ">= data.train_batch_size (one batch at least)")]


@dataclass
class RolloutConfig:
    engine: str = "hf"
    """"hf": transformers generate on a model copy (CPU and tests). "vllm": a colocated vLLM engine
    (GPU; install the `vllm` extra)."""
    n: int = 4
    """Samples per prompt (the group size of GRPO/RLOO)."""
    temperature: float = 1.0
    """Sampling temperature for training rollouts (> 0). Log-probs everywhere use logits/temperature."""
    top_p: float = 1.0
    """Nucleus sampling threshold (1.0 = off)."""
    top_k: int = -1
    """Top-k sampling (-1 = off)."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Extra token ids that end a response (the tokenizer's EOS always does)."""
    val_temperature: float = 0.0
    """Temperature for validation (0 = greedy)."""
    val_n: int = 1
    """Samples per validation prompt."""
    tensor_parallel_size: int = 1
    """vLLM tensor-parallel size: groups of this many consecutive local ranks form one replica.
    Must divide the GPUs per node."""
    gpu_memory_utilization: float = 0.5
    """vLLM: fraction of GPU memory vLLM may use for weights + KV cache while awake."""
    max_num_seqs: int = 256
    """vLLM: most sequences in one scheduler step."""
    max_num_batched_tokens: int = 8192
    """vLLM: most tokens in one scheduler step."""
    max_model_len: int = 0
    """vLLM: context length; 0 = data.max_prompt_length + data.max_response_length."""
    enforce_eager: bool = False
    """vLLM: disable CUDA graphs."""
    vllm_compile: bool = False
    """vLLM: torch.compile (Inductor) the engine's model, with piecewise CUDA graphs for prefill
    (vLLM's default). Off: no Inductor, and CUDA graphs of the whole decode step only
    (compilation_config mode 0, cudagraph_mode FULL_DECODE_ONLY; prefill runs eager). Measured on
    1xH100 (0.5B, 512 requests x 512 tokens, docs/performance.md): the engine starts in 37 s cold
    against 85 s with Inductor (24 s with its compile cache warm), and decodes as fast (GPU kernels
    3.49 against 3.40 ms a step; the CPU bounds the step either way). No effect with enforce_eager."""
    cudagraph_capture_sizes: list[int] = field(default_factory=list)
    """vLLM: batch sizes to capture CUDA graphs for; empty = vLLM's default (51 sizes up to 512 at
    max_num_seqs >= 256) or, with cudagraph_step_sizes, this run's. Graph memory is not freed by
    sleep, so fewer sizes leave more for training (ROCm users: [1,2,4,8,16,32,64])."""
    cudagraph_step_sizes: bool = False
    """vLLM: with cudagraph_capture_sizes empty, capture only the decode batch sizes this run's
    generate calls can have: 1, 2, 3, 4, 6, 8, 12, ... (from 2 on at most 1.5x the one before; a batch
    runs padded to the next) up to the sequences one engine replica gets per call (training and
    validation), capped at max_num_seqs. Fewer graphs: a shorter start-up and less memory held
    while asleep; a call with more sequences than that runs its largest batches without graphs."""
    enable_prefix_caching: bool = True
    """vLLM: reuse KV blocks of shared prompt prefixes (reset after every weight sync)."""
    block_size: int = 64
    """vLLM: tokens per KV-cache block (0 = vLLM's default, 16). vLLM's scheduler allocates, hashes
    and caches KV blocks on the CPU in every decode step, and larger blocks leave it less to do.
    Measured (0.5B, 512 sequences x 512 tokens, 1xH100, two device calls, docs/performance.md): 64
    against 16 took 10.8 against 16.5 ms a decode step in one call and 15.1 against 16.0 (inside
    the spread between processes) in the other; 128 took 17.0. bench_step's rollout/actor log-prob
    mismatch is unchanged (0.008 at 0.5B, 0.017 at 1.5B).
    Prefix-cache hits then come in whole blocks of this many tokens, and up to block_size - 1
    tokens of KV memory per sequence go unused."""
    enable_chunked_prefill: bool = True
    """vLLM: split long prefills into chunks."""
    disable_custom_all_reduce: bool = False
    """vLLM: use NCCL instead of vLLM's custom all-reduce for TP. The custom one works with sleep
    mode and CUDA graphs: the engine is built with PyTorch's expandable segments off, whose VMM
    buffers it cannot share between ranks (spmd_rl/gpu_memory.py; configs/qwen7b.toml at TP=2)."""
    seed: int = 0
    """vLLM engine seed (offset by the replica index so replicas sample differently)."""
    dtype: str = "bfloat16"
    """Rollout engine weights dtype (bfloat16, float16 or float32; "hf" on CPU uses float32)."""
    sleep_level: int = 2
    """vLLM sleep level between rollouts: 2 drops weights and KV cache (new weights come every
    step anyway, so keeping a CPU copy as level 1 does only costs time)."""
    weight_sync_bucket_mb: int = 512
    """Size of the buckets in which FSDP shards are gathered and handed to the engine."""
    offload_train_states: bool = False
    """Move actor/critic/reference parameters, gradients and optimizer states to CPU while the
    engine generates, and back before training (GPU only). Costs about 3 s + 1 s per step for a
    0.5B actor + critic (PCIe); worth it when the engine needs the memory (memory/offloaded_gb
    shows what it frees)."""
    compile_cache_dir: str = ""
    """vLLM's compilation cache (VLLM_CACHE_ROOT: torch.compile/Inductor/Triton artifacts), kept
    across restarts so a warm restart skips compilation; empty = <run_dir>/compile_cache. Point it
    at a shared path to reuse it across runs of the same model and settings. A VLLM_CACHE_ROOT
    already in the environment wins."""
    calculate_log_probs: str = "auto"
    """Ask the engine for every response's sampled-token log-probs (verl's
    `rollout.calculate_log_probs`): "on", "off", or "auto" = on exactly when something reads every
    row's (algorithm.rollout_is, rollout_mask, rollout_reject_sequences; "off" is refused with
    them). Asking costs generation time (0.5B at batch 512 on an H200: about 2x the generate time
    with vLLM's default log-prob lists; docs/performance.md). The start-up line says which applies
    and why."""
    logprob_sample_every: int = 8
    """While rollout log-probs are off (calculate_log_probs), every k-th prompt of each rank's
    generate call (its first, then every k-th; all n responses of it) asks for them anyway, so the
    mismatch metrics (rollout/logprob_diff_*, rollout/mismatch_kl) are measured on those rows only;
    1 = every prompt, 0 = none (the metrics are then not logged). Validation never asks."""
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    """vLLM: more keyword arguments of `vllm.LLM`, passed after the project's own (verl's
    `actor_rollout_ref.rollout.engine_kwargs.vllm`): a TOML table, e.g. `[rollout.engine_kwargs]`
    `async_scheduling = true`, `compilation_config = {mode = 3}`; on the command line
    `rollout.engine_kwargs={async_scheduling=true}` (replaces the table) or
    `rollout.engine_kwargs.async_scheduling=true` (sets one entry). Needs `engine = "vllm"`. Refused
    at start: names vLLM does not know, what the colocated engine fixes (model, load_format,
    distributed_executor_backend, enable_sleep_mode, logprobs_mode, skip_tokenizer_init, parallel
    layout...) and what a `rollout.*` key sets (dtype, seed, max_num_seqs, ...: set that key)."""

    tools: list[dict[str, Any]] = field(default_factory=list)
    """Multi-turn rollouts with tools: `[[rollout.tools]]` entries, each `function =
    "package.module:function"`, a plain function with type hints and a Google-style docstring (its
    JSON schema, from transformers' get_json_schema, goes to the chat template's `tools=`). A turn
    that calls tools (rollout.tool_parser's format) gets their answers as tool messages and the
    model goes on, until it answers without a call, rollout.max_turns, or the token budget
    (data.max_response_length counts the model's tokens and the tool messages). A tool that
    raises, passes rollout.tool_timeout or returns a non-string answers with an error message
    (counted in multiturn/tool_errors_mean). Not together with rollout.environment."""
    environment: str = ""
    """Multi-turn rollouts with an environment: "package.module:Class" with `reset(row)` and
    `step(message) -> StepResult(messages, done, reward=None)` (spmd_rl/rollout/multiturn/
    environment.py; one instance per trajectory, keeping its state across turns). Its reward, where
    it gives one, replaces the reward function's score. Empty = single-turn (or tools)."""
    max_turns: int = 5
    """Multi-turn: most model turns per trajectory (1 = the model answers once; tools never run)."""
    tool_parser: str = "hermes"
    """Multi-turn: how tool calls are read from a turn: "hermes" (Qwen2.5's
    `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, several per turn, none inside
    `<think>`), or "package.module:Class" with `parse(text) -> list[ToolCall | CallError]`."""
    tool_timeout: float = 10.0
    """Multi-turn: seconds a tool call (or an environment step) may take; past it the model is told
    the call timed out (an environment's trajectory ends)."""
    max_tool_response_tokens: int = 256
    """Multi-turn: each tool or environment message is cut to this many tokens (0 = no limit)."""
    tool_pool_size: int = 32
    """Multi-turn: threads that run tool calls and environment steps in parallel, per rank."""

    @property
    def multi_turn(self) -> bool:
        return bool(self.tools or self.environment)

    def check_multi_turn(self) -> None:
        """Tools and environment import and have what the loop needs (spmd_rl.rollout.multiturn)."""
        if not self.multi_turn:
            return
        _need(not (self.tools and self.environment), "rollout.tools and rollout.environment cannot be used "
              "together: put the tools' work into the environment's step, or drop one of them")
        _need(self.max_turns >= 1, f"rollout.max_turns = {self.max_turns} must be >= 1")
        from spmd_rl.rollout.multiturn import check_config

        check_config(self)

    def check_sampling(self) -> None:
        _need(self.n >= 1, "rollout.n must be >= 1")
        _need(self.temperature > 0, "rollout.temperature must be > 0 for training rollouts")
        _need(0 < self.top_p <= 1, "rollout.top_p must be in (0, 1]")
        _need(self.top_k == -1 or self.top_k > 0, "rollout.top_k must be -1 (off) or > 0")
        _need(self.val_n >= 1, "rollout.val_n must be >= 1")
        _need(self.val_n == 1 or self.val_temperature > 0,
              "rollout.val_n > 1 needs rollout.val_temperature > 0 (greedy samples are all the same)")

    def check_engine(self, world_size: int, gpus_per_node: int | None) -> None:
        """The engine's tensor-parallel groups fit the ranks and the nodes; its memory settings."""
        tp = self.tensor_parallel_size
        _need(tp >= 1, "rollout.tensor_parallel_size must be >= 1")
        if self.engine == "hf":
            _need(tp == 1, 'rollout.tensor_parallel_size > 1 needs rollout.engine = "vllm"')
        _need(world_size % tp == 0, f"rollout.tensor_parallel_size = {tp} must divide the world size {world_size}")
        if gpus_per_node is not None:
            _need(gpus_per_node % tp == 0,
                  f"rollout.tensor_parallel_size = {tp} does not divide the {gpus_per_node} GPUs per node, so a "
                  f"tensor-parallel group would span two nodes: use a divisor of {gpus_per_node}")
        _need(0 < self.gpu_memory_utilization < 1, "rollout.gpu_memory_utilization must be in (0, 1)")
        _need(self.weight_sync_bucket_mb > 0, "rollout.weight_sync_bucket_mb must be > 0")

    def ranges(self, cfg: Config) -> list[Rule]:
        d = cfg.data
        return [
            ("val_temperature", self.val_temperature >= 0, ">= 0 (0 = greedy)"),
            ("val_n", self.val_n >= 1, ">= 1"),
            ("stop_token_ids", all(i >= 0 for i in self.stop_token_ids), "token ids >= 0"),
            ("max_num_seqs", self.max_num_seqs >= 1, ">= 1"),
            ("max_num_batched_tokens", self.max_num_batched_tokens >= 1, ">= 1"),
            ("max_model_len", self.max_model_len == 0 or self.max_model_len >= d.max_prompt_length + d.max_response_length,
             "0 or >= data.max_prompt_length + data.max_response_length"),
            ("cudagraph_capture_sizes", all(s > 0 for s in self.cudagraph_capture_sizes), "sizes > 0"),
            ("block_size", self.block_size >= 0 and self.block_size % 16 == 0,
             "0 (vLLM's default) or a multiple of 16 (the sizes vLLM's FlashAttention backends take)"),
            ("seed", self.seed >= 0, ">= 0"),
            ("max_turns", self.max_turns >= 1, ">= 1"),
            ("tool_timeout", self.tool_timeout > 0, "> 0"),
            ("max_tool_response_tokens", self.max_tool_response_tokens >= 0, ">= 0 (0 = no limit)"),
            ("tool_pool_size", self.tool_pool_size >= 1, ">= 1"),
            ("logprob_sample_every", self.logprob_sample_every >= 0, ">= 0 (0 = no mismatch metrics)"),
        ]

    def check_logprobs(self, readers: list[str]) -> None:
        """calculate_log_probs = "off" with a setting that reads every row's rollout log-probs."""
        _need(self.calculate_log_probs != "off" or not readers,
              f"rollout.calculate_log_probs = 'off' but {readers[0] if readers else ''} reads every response's rollout "
              "log-probs: set rollout.calculate_log_probs = 'auto' (or 'on')")


class _TrainedModel:
    """What the actor and critic sections share: the layout of a PPO update (Config.micro_batching)."""

    def check_batches(self, cfg: Config, role: str, world_size: int) -> None:
        """`role`'s mini-batches divide the step and the ranks, its micro-batches the mini-batch;
        its token budgets hold the longest sequence."""
        d, r, m = cfg.data, cfg.rollout, cfg.model
        mini = self.ppo_mini_batch_size
        _need(mini > 0 and d.train_batch_size % mini == 0,
              f"{role}.ppo_mini_batch_size = {mini} must divide data.train_batch_size = {d.train_batch_size}")
        seqs = mini * r.n
        _need(seqs % world_size == 0,
              f"{role}.ppo_mini_batch_size * rollout.n = {seqs} sequences do not divide by the {world_size} ranks: "
              f"make {role}.ppo_mini_batch_size a multiple of {world_size}")
        sp = max(cfg.trainer.ulysses_size, 1)  # the ranks of a sequence-parallel group share their rows
        per_rank = seqs * sp // world_size
        rows = cfg.micro_batching(role).rows
        inherited = " (actor.micro_batch_size_per_gpu, taken as critic.micro_batch_size_per_gpu = 0)" if (
            role == "critic" and not self.micro_batch_size_per_gpu) else ""
        ranks = "ranks" if sp == 1 else "data-parallel ranks"
        _need(rows > 0 and per_rank % rows == 0,
              f"{role}.micro_batch_size_per_gpu = {rows}{inherited} must divide the "
              f"{per_rank} sequences per rank of a mini-batch ({role}.ppo_mini_batch_size * rollout.n / {ranks})")
        _need(self.ppo_epochs >= 1, f"{role}.ppo_epochs must be >= 1")
        budgets = {"max_token_len_per_gpu": self.max_token_len_per_gpu}
        budgets.update({k: getattr(self, k) for k in ("logprob_max_token_len_per_gpu", "forward_max_token_len_per_gpu")
                        if hasattr(self, k)})
        if role == "critic" and self.max_token_len_per_gpu == -1:  # the actor's, checked as the actor's
            budgets.pop("max_token_len_per_gpu")
        longest = d.max_prompt_length + d.max_response_length
        for key, budget in budgets.items():
            floor = -1 if (role, key) == ("critic", "max_token_len_per_gpu") else 0
            _need(budget >= floor, f"{role}.{key} must be >= 0 (0 = off)" + (", or -1 = the actor's" if floor else ""))
            if budget:
                _need(m.remove_padding, f"{role}.{key} = {budget} builds micro-batches by tokens, which needs packed "
                      "sequences: set model.remove_padding = true (or the budget to 0)")
                if sp == 1:
                    _need(budget >= longest, f"{role}.{key} = {budget} is below the longest possible sequence "
                          f"(data.max_prompt_length + data.max_response_length = {longest}): raise it to at least "
                          f"{longest}")
                else:  # a micro-batch of an SP group holds sp GPUs' budgets
                    _need(budget * sp >= longest, f"{role}.{key} = {budget} x trainer.ulysses_size = {sp} is below "
                          f"the longest possible sequence (data.max_prompt_length + data.max_response_length = "
                          f"{longest}): raise it to at least {-(-longest // sp)}")


@dataclass
class ActorConfig(_TrainedModel):
    lr: float = 1e-6
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas."""
    warmup_steps: int = 0
    """Linear warm-up steps of the learning rate."""
    lr_schedule: str = "constant"
    """"constant" or "cosine" (to `min_lr_ratio` * lr at `trainer.total_steps`)."""
    min_lr_ratio: float = 0.0
    """Final learning rate of the cosine schedule, as a fraction of lr."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0 = no clipping)."""
    ppo_mini_batch_size: int = 8
    """Prompts per optimizer step, global (times `rollout.n` sequences). Must divide
    `data.train_batch_size`."""
    micro_batch_size_per_gpu: int = 4
    """Sequences per forward/backward on one GPU (gradient accumulation makes up the rest)."""
    ppo_epochs: int = 1
    """Passes over each step's rollouts."""
    clip_ratio_low: float = 0.2
    """PPO ratio clip below 1 (ratio >= 1 - clip_ratio_low)."""
    clip_ratio_high: float = 0.2
    """PPO ratio clip above 1 (ratio <= 1 + clip_ratio_high; DAPO's clip-higher uses 0.28)."""
    clip_ratio_c: float = 3.0
    """Dual-clip constant for negative advantages (> 1; 0 = no dual clip)."""
    loss_agg_mode: str = "token-mean"
    """token-mean, seq-mean-token-sum or seq-mean-token-mean, over the global mini-batch."""
    entropy_coeff: float = 0.0
    """Entropy bonus weight (the loss subtracts entropy_coeff * entropy)."""
    use_kl_loss: bool = False
    """Add a KL(actor || reference) loss term (GRPO style) instead of / besides a reward penalty."""
    kl_loss_coef: float = 0.001
    """Weight of the KL loss."""
    kl_loss_type: str = "low_var_kl"
    """KL estimator for the loss: k1, k2, k3 / low_var_kl (k3 clamped to [-10, 10]), abs."""
    max_token_len_per_gpu: int = 0
    """Token budget of one actor-update micro-batch on one GPU (verl's dynamic batch size): each
    mini-batch is cut into as few micro-batches as keep every one within this many real tokens,
    sequences balanced across them, the same count on every rank. Needs model.remove_padding.
    0 = micro-batches of `micro_batch_size_per_gpu` sequences. Must be >= data.max_prompt_length
    + data.max_response_length. Take the largest that fits: each micro-batch costs launches and
    idle GPU time, so fewer, larger ones are faster (0.5B on an H100: 16384 -> 32768 took the update
    from 3.52 to 2.62 s, its peak from 23.7 to 37.1 GiB; docs/performance.md). The presets' values
    are measured for 80 GB GPUs."""
    logprob_max_token_len_per_gpu: int = 0
    """Token budget of the no-grad log-prob passes (old log-probs, reference) per micro-batch;
    0 = twice `max_token_len_per_gpu` (no activations are kept for a backward)."""
    force_old_logprob_pass: bool = False
    """Always compute the old policy's log-probs in a separate no-grad pass before the update. By
    default an on-policy step (ppo_epochs = 1, ppo_mini_batch_size = data.train_batch_size, no
    algorithm.use_kl_in_reward, rollout_mask or rollout_reject_sequences) takes them from the
    update's own forward, detached, and skips the pass (TRL's num_iterations = 1): the same update
    up to rounding (spmd_rl/old_logprobs.py). The start-up line says which path a run takes."""
    offload_optimizer: bool = False
    """Keep the optimizer state (AdamW moments: 8 bytes per parameter, sharded) in CPU memory and
    bring it to the GPU only for each optimizer step: the forward/backward passes get that memory,
    each optimizer step pays two host<->device copies."""
    policy_loss: str = "vanilla"
    """Policy loss: "vanilla" (= "ppo": the clipped PPO surrogate with clip_ratio_low/high/c),
    "gspo" (GSPO, Zheng et al. 2025: one geometric-mean ratio per sequence, clipped per sequence
    with gspo_clip_ratio_low/high; the paper aggregates "seq-mean-token-mean"), or "cispo" (CISPO,
    MiniMax-M1 2025: stop-gradient IS weight min(ratio, 1 + cispo_clip_ratio_high) times log-prob)."""
    gspo_clip_ratio_low: float = 3e-4
    """GSPO: sequence ratio clip below 1 (the GSPO paper's 3e-4)."""
    gspo_clip_ratio_high: float = 4e-4
    """GSPO: sequence ratio clip above 1 (the GSPO paper's 4e-4)."""
    cispo_clip_ratio_high: float = 4.0
    """CISPO: the IS weight is capped at 1 + this (no lower cap, as MiniMax-M1)."""

    def check_loss(self) -> None:
        """The policy loss's clip ratios and the optimizer's betas."""
        for side in ("low", "high"):  # 0 freezes the policy on that side: ratio 1 is already clipped
            _need(getattr(self, f"clip_ratio_{side}") > 0, f"actor.clip_ratio_{side} = {getattr(self, f'clip_ratio_{side}')} "
                  f"must be > 0: with 0 the clipped loss has no gradient on that side, so the policy can never move "
                  "there (0.2 is usual)")
        _need(self.clip_ratio_low < 1, f"actor.clip_ratio_low = {self.clip_ratio_low} must be < 1 (the ratio is positive)")
        _need(self.clip_ratio_c == 0 or self.clip_ratio_c > 1, "actor.clip_ratio_c must be > 1 (or 0 to turn dual clip off)")
        _need(len(self.betas) == 2, "actor.betas must be two numbers, e.g. [0.9, 0.999]")
        for key in ("gspo_clip_ratio_low", "gspo_clip_ratio_high", "cispo_clip_ratio_high"):
            _need(getattr(self, key) >= 0, f"actor.{key} = {getattr(self, key)} must be >= 0")

    def ranges(self, cfg: Config) -> list[Rule]:
        return [
            ("lr", self.lr > 0, "> 0"), ("weight_decay", self.weight_decay >= 0, ">= 0"),
            ("betas", all(0 <= b < 1 for b in self.betas), "in [0, 1) each"),
            ("warmup_steps", self.warmup_steps >= 0, ">= 0"),
            ("min_lr_ratio", 0 <= self.min_lr_ratio <= 1, "in [0, 1]"),
            ("grad_clip", self.grad_clip >= 0, ">= 0 (0 = no clipping)"),
            ("entropy_coeff", self.entropy_coeff >= 0, ">= 0"), ("kl_loss_coef", self.kl_loss_coef >= 0, ">= 0"),
        ]


@dataclass
class CriticConfig(_TrainedModel):
    path: str = ""
    """Model directory for the critic's backbone; empty = the actor's model."""
    lr: float = 1e-5
    """AdamW learning rate of the critic."""
    weight_decay: float = 0.0
    """AdamW weight decay of the critic."""
    warmup_steps: int = 0
    """Linear warm-up steps of the critic's learning rate."""
    grad_clip: float = 1.0
    """Clip the critic's global gradient norm (0 = off)."""
    ppo_mini_batch_size: int = 8
    """Prompts per critic optimizer step, global."""
    micro_batch_size_per_gpu: int = 0
    """Sequences per critic forward/backward on one GPU when micro-batches are counted in
    sequences; 0 = `actor.micro_batch_size_per_gpu`."""
    ppo_epochs: int = 1
    """Passes of the critic over each step's rollouts."""
    cliprange_value: float = 0.5
    """Value clipping around the old values (0 = no clipping)."""
    loss_agg_mode: str = "token-mean"
    """Aggregation of the value loss (same modes as the actor)."""
    max_token_len_per_gpu: int = -1
    """Token budget of one critic-update micro-batch on one GPU (see actor.max_token_len_per_gpu);
    -1 = the actor's (`actor.max_token_len_per_gpu`: the critic is the same size of model on the
    same sequences), 0 = micro-batches of `micro_batch_size_per_gpu` sequences."""
    forward_max_token_len_per_gpu: int = 0
    """Token budget of the no-grad value pass per micro-batch; 0 = twice the critic's update budget
    (after taking the actor's)."""

    def ranges(self, cfg: Config) -> list[Rule]:
        if not cfg.use_critic:
            return []
        return [("lr", self.lr > 0, "> 0"), ("weight_decay", self.weight_decay >= 0, ">= 0"),
                ("warmup_steps", self.warmup_steps >= 0, ">= 0"), ("grad_clip", self.grad_clip >= 0, ">= 0"),
                ("cliprange_value", self.cliprange_value >= 0, ">= 0 (0 = no clipping)")]


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"
    """gae (PPO with critic), grpo, rloo or reinforce_plus_plus."""
    gamma: float = 1.0
    """Discount (GAE, REINFORCE++)."""
    lam: float = 1.0
    """GAE lambda."""
    norm_adv_by_std_in_grpo: bool = True
    """GRPO: divide by the group's std; false = Dr. GRPO (mean-centring only)."""
    use_kl_in_reward: bool = False
    """Subtract kl_coef * KL(actor || reference) from the token rewards."""
    kl_penalty: str = "k1"
    """KL estimator of the reward penalty: k1, k2, k3 / low_var_kl, abs."""
    kl_ctrl: str = "fixed"
    """Reward-penalty coefficient controller: fixed or adaptive (Ziegler et al.)."""
    kl_coef: float = 0.001
    """(Initial) KL penalty coefficient."""
    target_kl: float = 0.1
    """Adaptive controller: the KL it steers towards."""
    kl_horizon: int = 10000
    """Adaptive controller: horizon (in samples) of its proportional update."""
    rollout_is: str = ""
    """Rollout-mismatch correction, truncated importance sampling (TIS, Yao et al. 2025): the
    actor's loss is weighted by min(pi_old / pi_engine, rollout_is_threshold) of each "token", of
    each "sequence" (product of token ratios) or "geometric" (their geometric mean); "" = off."""
    rollout_is_threshold: float = 2.0
    """Cap C of the truncated IS weight (TIS uses 2)."""
    rollout_mask: str = ""
    """Rollout-mismatch correction, masked IS (ICE-POP style): drop from the actor's loss (numerator
    and denominator) each "token", "sequence" or "geometric" (sequence by geometric mean) whose ratio
    pi_old / pi_engine lies outside [rollout_mask_low, rollout_mask_high]; "" = off."""
    rollout_mask_low: float = 0.5
    """Lower bound of the kept ratio (IcePop uses 0.5)."""
    rollout_mask_high: float = 2.0
    """Upper bound of the kept ratio (IcePop uses 2)."""
    rollout_reject_sequences: bool = False
    """Drop every sequence holding any token whose ratio is outside [rollout_mask_low,
    rollout_mask_high] (verl's token veto), with or without rollout_mask."""
    dynamic_sampling: bool = False
    """DAPO dynamic sampling (Yu et al. 2025): drop prompt groups whose rewards are all equal (no
    GRPO signal) and generate more batches until data.train_batch_size informative groups are
    collected (the surplus is discarded)."""
    dynamic_sampling_max_rounds: int = 10
    """DAPO: most generation rounds per step (1 = no extra round); when reached, the step is
    filled up with uninformative groups (metric dynamic_sampling/padded_groups) and a warning."""
    overlong_filtering: bool = False
    """DAPO overlong filtering: responses cut at data.max_response_length leave the actor's loss."""

    def check(self, n: int) -> None:
        """The estimator fits `n` = rollout.n samples per prompt; discounts, rollout-correction bounds
        and DAPO dynamic sampling in range."""
        if self.adv_estimator in ("grpo", "rloo"):
            _need(n >= 2, f"algorithm.adv_estimator = {self.adv_estimator!r} compares samples of one prompt: "
                  f"set rollout.n >= 2 (got {n})")
        _need(0 <= self.gamma <= 1 and 0 <= self.lam <= 1, "algorithm.gamma and algorithm.lam must be in [0, 1]")
        _need(self.rollout_is_threshold > 0, "algorithm.rollout_is_threshold must be > 0 (TIS uses 2)")
        _need(0 < self.rollout_mask_low <= 1,
              f"algorithm.rollout_mask_low = {self.rollout_mask_low} must be in (0, 1] (IcePop uses 0.5)")
        _need(self.rollout_mask_high >= 1,
              f"algorithm.rollout_mask_high = {self.rollout_mask_high} must be >= 1 (IcePop uses 2)")
        _need(self.dynamic_sampling_max_rounds >= 1, "algorithm.dynamic_sampling_max_rounds must be >= 1")
        if self.dynamic_sampling:
            _need(self.adv_estimator in ("grpo", "rloo"), "algorithm.dynamic_sampling filters prompt groups: use "
                  f"algorithm.adv_estimator = grpo or rloo (got {self.adv_estimator!r})")

    def ranges(self, cfg: Config) -> list[Rule]:
        return [("kl_coef", self.kl_coef >= 0, ">= 0"), ("target_kl", self.target_kl > 0, "> 0"),
                ("kl_horizon", self.kl_horizon > 0, "> 0")]


@dataclass
class RewardConfig:
    custom_function: str = ""
    """A user scorer "package.module:function" called as fn(data_source, response_text,
    ground_truth, extra_info) -> float or dict with key "score"; empty = the built-in rule scorers
    chosen by each row's data_source."""
    gsm8k_method: str = "strict"
    """GSM8K answer extraction: "strict" (the "#### N" line) or "flexible" (last number)."""
    format_bonus: float = 0.0
    """Added to the score when the response has the expected answer format (0 = off)."""
    overlong_buffer: int = 0
    """DAPO overlong reward shaping (Yu et al. 2025): responses longer than
    data.max_response_length - overlong_buffer tokens get a penalty growing linearly to
    -overlong_penalty_factor at the limit (0 = off)."""
    overlong_penalty_factor: float = 1.0
    """DAPO: the penalty at data.max_response_length tokens."""
    on_error: str = "fail"
    """What a scorer that raises or returns a non-number does: "fail" stops the run with one line
    naming the data source, row and response; "zero" scores that response 0 and counts it in the
    metric reward/errors."""

    def check(self, max_response_length: int) -> None:
        """DAPO's overlong shaping within `max_response_length` = data.max_response_length."""
        _need(self.overlong_penalty_factor >= 0,
              f"reward.overlong_penalty_factor = {self.overlong_penalty_factor} must be >= 0 (DAPO uses 1.0)")
        _need(0 <= self.overlong_buffer < max_response_length,
              "reward.overlong_buffer must be in [0, data.max_response_length) (0 = off)")

    def ranges(self, cfg: Config) -> list[Rule]:
        return [("format_bonus", self.format_bonus >= 0, ">= 0 (0 = off)")]


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
    after it; spmd_rl/sequence_parallel.py). Data parallelism is over world / ulysses_size groups:
    `*.micro_batch_size_per_gpu` counts sequences per group and each mini-batch is cut per group,
    while the token budgets (`*max_token_len_per_gpu`) stay per GPU, so a group's micro-batch holds
    up to ulysses_size times the budget. Needs model.remove_padding; must divide the world size,
    trainer.fsdp_size (a group lies inside a shard group) and the model's attention heads, and its
    KV heads must divide by it or divide it (then each is replicated, as verl does). Rollout,
    weight sync and checkpoints are the same as without it; a checkpoint resumes under another
    ulysses_size. Costs 4 all-to-alls per decoder layer in forward (4 more in backward) over the
    group's activations. When: the longest prompt + response (with gradient checkpointing) does
    not fit one GPU's update micro-batch, or leaves no room for a useful token budget
    (scripts/bench_ulysses.py measures the longest sequence that fits at each size; the preset
    qwen1.5b-long uses 2 for 16k-token responses); keep the group inside a node (NVLink). Where
    the longest sequence fits one GPU, plain data parallelism is faster. 1 = off."""
    val_every: int = 0
    """Validate every this many steps and after the last one (0 = only after the last, if
    data.val_files is set)."""
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
    save's bytes, this peak and the free space (spmd_rl/checkpoint_space.py)."""
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
    tensorboard: bool = True
    """Write TensorBoard events under <run_dir>/tensorboard."""
    peak_tflops: float = 0.0
    """Per-GPU dense bf16 peak for MFU; 0 = from the GPU name (H100/H200: 989)."""
    async_save: bool = True
    """Write checkpoints in the background: the step waits only while the state is copied to host
    memory (pinned on GPU; it costs host RAM of the size of this rank's model + optimizer shards,
    kept for the run), the files are written while the next steps train; at most one save in
    flight; a checkpoint becomes `latest` only once written and verified. false = the step waits
    for the whole write. The end of the run and a stop signal wait for the save in flight. With
    rollout.offload_train_states the state moves every step, so every save pays the first save's
    allocation and pinning of those buffers."""
    balance_ranks: bool = True
    """Before the log-prob passes and the updates, move rollout rows between ranks so every rank
    holds nearly the same number of tokens (verl's balance_batch; Karmarkar-Karp on prompt +
    response lengths): otherwise the rank that drew the longest responses sets the pace of every
    collective. Prompt groups stay on one rank and every mini-batch keeps its rows, so the update
    is the same as without it (spmd_rl/rank_balance.py). Each rank keeps its number of rows.
    Metrics batch/rank_tokens_max_over_mean_before / _after. No effect on one rank."""
    export_hf_dir: str = ""
    """After the last step, rank 0 writes the final actor here as a Hugging Face model directory
    (safetensors, config, tokenizer; what `python -m spmd_rl.export` does for any checkpoint);
    empty = no export. Must not exist yet (or be empty)."""
    profile_steps: list[int] = field(default_factory=list)
    """Steps to run under torch.profiler (verl's profile_steps), e.g. [3]: each rank writes
    <run_dir>/profile/step_<N>_rank<R>.json.gz (the trace, every phase a named range) and .txt
    (per phase: wall ms, the ms the GPU was busy during it and the ms of Python's garbage
    collection in it; for a phase whose GPU idled, the host ops it idled in; for a phase whose GPU
    worked, its kernels by device time; then the ops with the most device time). A profiled step runs slower
    (the host more than the GPU) and its times are not the run's;
    pick one after the first (which compiles). Empty = never (spmd_rl/step_profiler.py)."""

    def check_layout(self, world_size: int, gpus_per_node: int | None) -> None:
        """trainer.fsdp_size cuts the `world_size` ranks into whole shard groups."""
        _need(self.fsdp_size >= 0, f"trainer.fsdp_size = {self.fsdp_size} must be >= 0 (0 = shard over all ranks)")
        per_node = f"the {gpus_per_node} GPUs per node" if gpus_per_node else "the GPUs per node"
        _need(self.fsdp_size == 0 or world_size % self.fsdp_size == 0,
              f"trainer.fsdp_size = {self.fsdp_size} does not divide the world size {world_size} (it is the ranks per "
              f"shard group; the model is replicated across the groups): use a divisor of {world_size}, e.g. "
              f"{per_node} on several nodes, or 0 to shard over all ranks")

    def check_ulysses(self, cfg: Config, world_size: int) -> None:
        """trainer.ulysses_size (sequence parallelism, spmd_rl/sequence_parallel.py): it divides the
        world and the shard group, the rows are packed, and every model's attention heads split."""
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
        from spmd_rl.model_files import model_attention_heads
        from spmd_rl.sp_groups import head_problem

        models = {}
        if m.init == "random" and not m.path:
            from spmd_rl.models import ARCH_PRESETS

            arch = ARCH_PRESETS[m.arch]
            models[f"model.arch = {m.arch!r}"] = (arch["num_attention_heads"], arch["num_key_value_heads"])
        else:
            models[f"model.path = {m.path!r}"] = model_attention_heads(m.path, "model.path")
        if cfg.use_critic and cfg.critic.path:
            models[f"critic.path = {cfg.critic.path!r}"] = model_attention_heads(cfg.critic.path, "critic.path")
        for model, (heads, kv_heads) in models.items():
            problem = head_problem(heads, kv_heads, sp)
            if problem:
                fits = [k for k in divisors if not head_problem(heads, kv_heads, k)]
                raise ConfigError(f"trainer.ulysses_size = {sp} does not fit the model ({model}): {problem}; use one of "
                                  f"{', '.join(map(str, fits))}")

    def check(self, run_dir: str, checkpoint_dir: str) -> None:
        """Steps and checkpoints in range; the resume target exists; `run_dir` (Config.run_dir),
        `checkpoint_dir` (Config.checkpoint_dir) and the export directory can be written."""
        _need(self.total_steps >= 1, "trainer.total_steps must be >= 1")
        _need(self.keep_last >= 1, "trainer.keep_last must be >= 1 (the latest checkpoint is always kept)")
        outside = [s for s in self.profile_steps if not 1 <= s <= self.total_steps]
        _need(not outside, f"trainer.profile_steps = {self.profile_steps}: {outside} not between 1 and trainer.total_steps = "
              f"{self.total_steps}; name steps of this run (e.g. [2]), or [] to profile none")
        if self.resume not in ("auto", "none"):
            _need(os.path.isdir(self.resume), f"trainer.resume = {self.resume!r} is not a checkpoint directory "
                  '(use "auto", "none" or an existing step_N directory)')
        problem = _cannot_write(run_dir)
        _need(problem is None, f"trainer.run_dir = {run_dir!r} cannot be used ({problem}): choose another directory")
        if self.checkpoint_dir:
            problem = _cannot_write(checkpoint_dir)
            _need(problem is None, f"trainer.checkpoint_dir = {checkpoint_dir!r} cannot be used ({problem}): choose "
                  "another directory")
        if self.export_hf_dir:
            problem = _cannot_write(self.export_hf_dir)
            _need(problem is None, f"trainer.export_hf_dir = {self.export_hf_dir!r} cannot be used ({problem}): choose "
                  "another directory")
            _need(not (os.path.exists(self.export_hf_dir) and os.listdir(self.export_hf_dir)),
                  f"trainer.export_hf_dir = {self.export_hf_dir!r} exists and is not empty: choose a new directory "
                  "(the export would otherwise fail after training)")

    def ranges(self, cfg: Config) -> list[Rule]:
        return [
            ("val_every", self.val_every >= 0, ">= 0"), ("save_every", self.save_every >= -1, ">= -1 (0 = only at the end, -1 = never)"),
            ("log_every", self.log_every >= 1, ">= 1"), ("peak_tflops", self.peak_tflops >= 0, ">= 0"),
            ("experiment_name", bool(self.experiment_name.strip()), "a non-empty name"),
            ("seed", self.seed >= 0, ">= 0"),
        ]


class MicroBatching(typing.NamedTuple):
    """A role's micro-batches, resolved (Config.micro_batching)."""

    rows: int  # sequences per micro-batch where a token budget is 0
    update_tokens: int  # token budget of an update micro-batch (packed); 0 = `rows` sequences
    forward_tokens: int  # token budget of a no-grad pass (log-probs, values); 0 = `rows` sequences


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy (actor) model; the reference model is a frozen copy of its initial weights."""
    data: DataConfig = field(default_factory=DataConfig)
    """Datasets and sequence lengths."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Generation: sampling and the inference engine."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    """Policy optimisation."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """Value model (used when algorithm.adv_estimator = "gae")."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantage estimation and the KL reward penalty."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Reward scoring."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """The loop: steps, validation, checkpoints, logging."""

    # ---------------------------------------------------------------- derived
    @property
    def run_dir(self) -> str:
        return self.trainer.run_dir or os.path.join("runs", self.trainer.experiment_name)

    @property
    def checkpoint_dir(self) -> str:
        return self.trainer.checkpoint_dir or os.path.join(self.run_dir, "checkpoints")

    @property
    def use_critic(self) -> bool:
        return self.algorithm.adv_estimator == "gae"

    @property
    def use_reference(self) -> bool:
        return self.actor.use_kl_loss or self.algorithm.use_kl_in_reward

    def validate(self, world_size: int = 1, gpus_per_node: int | None = None) -> None:
        """Refuse impossible combinations, naming the key and the fix."""
        validate(self, world_size, gpus_per_node)

    def check_choices(self) -> None:
        """Every key of CHOICES holds one of its choices."""
        for key, choices in CHOICES.items():
            section, name = key.split(".")
            value = str(getattr(getattr(self, section), name))
            _need(value in choices, f"{key} = {value!r} is not one of {', '.join(repr(c) for c in choices)}")

    def check_ranges(self) -> None:
        """Every number a user sets, in its meaningful range (one message naming the key): finite,
        then each section's `ranges`."""
        for section in SECTIONS:
            for name, value in dataclasses.asdict(getattr(self, section)).items():
                for v in value if isinstance(value, list) else [value]:
                    if isinstance(v, float) and not math.isfinite(v):
                        raise ConfigError(f"{section}.{name} = {v} must be a finite number")
        for section in SECTIONS:
            for name, ok, expected in getattr(self, section).ranges(self):
                _need(ok, f"{section}.{name} = {getattr(getattr(self, section), name)!r} must be {expected}")

    def micro_batching(self, role: str) -> MicroBatching:
        """How the "actor" (and reference) or the "critic" cuts its work into micro-batches, with
        the critic's unset keys taken from the actor. The token budgets are a micro-batch's: with
        sequence parallelism (trainer.ulysses_size) the per-GPU budget times the group's GPUs."""
        a, sp = self.actor, max(self.trainer.ulysses_size, 1)  # an SP group's micro-batch: sp GPUs' budgets
        if role == "actor":
            return MicroBatching(a.micro_batch_size_per_gpu, sp * a.max_token_len_per_gpu,
                                 sp * (a.logprob_max_token_len_per_gpu or 2 * a.max_token_len_per_gpu))
        c = self.critic
        tokens = a.max_token_len_per_gpu if c.max_token_len_per_gpu == -1 else c.max_token_len_per_gpu
        return MicroBatching(c.micro_batch_size_per_gpu or a.micro_batch_size_per_gpu, sp * tokens,
                             sp * (c.forward_max_token_len_per_gpu or 2 * tokens))

    def describe_layout(self, world_size: int) -> str:
        """The derived per-rank batch numbers, the micro-batching actually used and where the old
        log-probs come from (old_logprob_pass_reason), for the start-up log."""
        n = self.rollout.n
        per_rank_prompts = self.data.train_batch_size // world_size
        roles = [("actor", self.actor)] + ([("critic", self.critic)] if self.use_critic else [])
        shard = self.trainer.fsdp_size or world_size
        fsdp = "" if shard == world_size else f" (HSDP: {world_size // shard} replicas x shard groups of {shard})"
        sp = max(self.trainer.ulysses_size, 1)
        ulysses = "" if sp == 1 else (f" (sequence parallel: {world_size // sp} data-parallel x SP groups of {sp} "
                                      "ranks sharing each micro-batch)")
        parts = [f"world={world_size}{fsdp}{ulysses} | per step: {self.data.train_batch_size} prompts x n={n} = "
                 f"{self.data.train_batch_size * n} sequences ({per_rank_prompts * n} per rank)"]
        where = "rank" if sp == 1 else "SP group"
        for role, section in roles:
            mini_seqs = section.ppo_mini_batch_size * n * sp // world_size
            mb = self.micro_batching(role)
            if mb.update_tokens:
                cut = (f"packed into micro-batches of <= {mb.update_tokens} tokens "
                       f"(<= {mb.forward_tokens} without gradients)")
            else:
                cut = f"= {mini_seqs // mb.rows} micro-batches of {mb.rows} sequences"
            parts.append(f"{role}: {self.data.train_batch_size // section.ppo_mini_batch_size} optimizer steps "
                         f"x {section.ppo_epochs} epochs, {mini_seqs} sequences per {where} per mini-batch {cut}")
        parts.append(f"rollout log-probs: {self.rollout_logprobs_plan()[1]}")
        reason = self.old_logprob_pass_reason()
        parts.append(f"old log-probs: separate pass ({reason})" if reason else
                     "old log-probs: from the update's forward (on-policy: 1 mini-batch, 1 epoch)")
        return " | ".join(parts)

    def rollout_logprob_readers(self) -> list[str]:
        """The settings that read every response's rollout log-probs (the engine's log-prob of
        each sampled token), as `key = value`; the mismatch metrics make do with a sample."""
        alg = self.algorithm
        return [f"algorithm.{k} = {getattr(alg, k)!r}" for k in ("rollout_is", "rollout_mask", "rollout_reject_sequences")
                if getattr(alg, k)]

    def rollout_logprobs_plan(self) -> tuple[int, str]:
        """(SamplingParams.logprobs_every of the training rollouts: 1 = every prompt asks the engine
        for its responses' log-probs, k = every k-th, 0 = none; the reason in words)."""
        r, readers = self.rollout, self.rollout_logprob_readers()
        if r.calculate_log_probs == "on" or (r.calculate_log_probs == "auto" and readers):
            why = "rollout.calculate_log_probs = 'on'" if r.calculate_log_probs == "on" else f"{readers[0]} reads them"
            return 1, f"every response ({why})"
        why = ("rollout.calculate_log_probs = 'off'" if r.calculate_log_probs == "off" else
               "rollout.calculate_log_probs = 'auto' and no algorithm.rollout_is / rollout_mask / "
               "rollout_reject_sequences reads them")
        k = r.logprob_sample_every
        if k == 0:
            return 0, f"none ({why}; rollout.logprob_sample_every = 0: no mismatch metrics)"
        rows = "every prompt's responses" if k == 1 else f"the responses of every {_ordinal(k)} prompt"
        return k, f"{rows}, for the mismatch metrics only ({why})"

    def old_logprob_pass_reason(self) -> str:
        """Why this run needs a separate no-grad pass for the old log-probs (the config keys in
        words); "" when it does not: they come from the update's own forward, detached
        (spmd_rl/old_logprobs.py says when that gives the same update)."""
        a, alg = self.actor, self.algorithm
        if a.force_old_logprob_pass:
            return "actor.force_old_logprob_pass = true"
        if a.ppo_epochs > 1:
            return f"actor.ppo_epochs = {a.ppo_epochs}: later epochs follow an optimizer step"
        mini_batches = self.data.train_batch_size // a.ppo_mini_batch_size
        if mini_batches > 1:
            return f"{mini_batches} mini-batches per step: later ones follow an optimizer step"
        if alg.use_kl_in_reward:
            return "algorithm.use_kl_in_reward: the reward's KL penalty needs them before the update"
        if alg.rollout_mask or alg.rollout_reject_sequences:
            key = "algorithm.rollout_mask" if alg.rollout_mask else "algorithm.rollout_reject_sequences"
            return f"{key}: masked tokens leave the loss's denominator, counted before the update's forward"
        return ""


SECTIONS = {f.name: f.type for f in dataclasses.fields(Config)}

CHOICES: dict[str, tuple[str, ...]] = {
    "model.init": ("pretrained", "random"),
    "model.dtype": ("float32", "bfloat16"),
    "model.compute_dtype": ("float32", "bfloat16"),
    "model.attn_implementation": ("sdpa", "eager"),
    "model.fused_kernels": ("none", "liger", "compile"),
    "model.fused_logprob_head": ("none", "compile"),
    "data.synthetic_task": ("", "successor", "arithmetic", "hidden"),
    "rollout.engine": ("hf", "vllm"),
    "rollout.dtype": ("bfloat16", "float16", "float32"),
    "rollout.sleep_level": ("1", "2"),
    "rollout.calculate_log_probs": ("auto", "on", "off"),
    "actor.lr_schedule": ("constant", "cosine"),
    "actor.loss_agg_mode": ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"),
    "actor.kl_loss_type": ("k1", "k2", "k3", "low_var_kl", "abs"),
    "actor.policy_loss": ("vanilla", "ppo", "gspo", "cispo"),
    "critic.loss_agg_mode": ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"),
    "algorithm.adv_estimator": ("gae", "grpo", "rloo", "reinforce_plus_plus"),
    "algorithm.kl_penalty": ("k1", "k2", "k3", "low_var_kl", "abs"),
    "algorithm.kl_ctrl": ("fixed", "adaptive"),
    "algorithm.rollout_is": ("", "token", "sequence", "geometric"),
    "algorithm.rollout_mask": ("", "token", "sequence", "geometric"),
    "reward.gsm8k_method": ("strict", "flexible"),
    "reward.on_error": ("fail", "zero"),
    "trainer.device": ("auto", "cuda", "cpu"),
}


# --------------------------------------------------------------------------- loading


def load_config(path: str | None = None, overrides: list[str] | None = None) -> Config:
    """Config from a TOML file (optional) and `section.key=value` overrides."""
    return config_toml.load(Config, path, overrides)


def config_from_dict(raw: dict[str, Any]) -> Config:
    return config_toml.from_dict(Config, raw)


# --------------------------------------------------------------------------- validation


def validate(cfg: Config, world_size: int = 1, gpus_per_node: int | None = None) -> None:
    """Every check, the first that fails raising: the choices; each section's keys; the batch layout
    over `world_size` ranks; sampling, losses and rewards; the engine's layout; the trainer's paths;
    the ranges; last vLLM's keyword arguments."""
    cfg.check_choices()
    cfg.model.check()
    from spmd_rl.model_files import check_model_inputs

    check_model_inputs(cfg)  # the directories' files: config.json, weights, tokenizer (no weights are read)
    cfg.data.check()
    cfg.trainer.check_layout(world_size, gpus_per_node)
    cfg.trainer.check_ulysses(cfg, world_size)
    cfg.data.check_layout(world_size)
    cfg.actor.check_batches(cfg, "actor", world_size)
    if cfg.use_critic:
        cfg.critic.check_batches(cfg, "critic", world_size)
    cfg.rollout.check_sampling()
    cfg.actor.check_loss()
    cfg.algorithm.check(cfg.rollout.n)
    cfg.reward.check(cfg.data.max_response_length)
    cfg.rollout.check_engine(world_size, gpus_per_node)
    cfg.rollout.check_multi_turn()
    cfg.rollout.check_logprobs(cfg.rollout_logprob_readers())
    cfg.trainer.check(cfg.run_dir, cfg.checkpoint_dir)
    cfg.check_ranges()
    from spmd_rl.vllm_kwargs import check_engine_kwargs

    check_engine_kwargs(cfg.rollout)  # last: with engine kwargs set, it imports vLLM to know its argument names


# --------------------------------------------------------------------------- docs


def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings (the string literal under each field) of a dataclass."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = inspect.cleandoc(nxt.value.value)  # type: ignore[union-attr]
    return docs


def markdown_reference() -> str:
    out = ["# Configuration reference", "", "Generated by `python -m spmd_rl.config --markdown` from the dataclasses "
           "in spmd_rl/config.py. Override any key on the command line as `section.key=value`.", ""]
    top = field_docs(Config)
    for f in dataclasses.fields(Config):
        section_cls = f.type if isinstance(f.type, type) else getattr(sys.modules[__name__], f.type)
        out += [f"## [{f.name}]", "", top.get(f.name, ""), "", "| key | default | meaning |", "| --- | --- | --- |"]
        docs = field_docs(section_cls)
        defaults = dataclasses.asdict(section_cls())
        for sf in dataclasses.fields(section_cls):
            choices = CHOICES.get(f"{f.name}.{sf.name}")
            doc = docs.get(sf.name, "").replace("\n", " ").replace("|", "\\|")
            if choices:
                doc += " Choices: " + ", ".join(f"`{c}`" for c in choices if c) + "."
            out.append(f"| `{sf.name}` | `{defaults[sf.name]!r}` | {doc} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    if "--markdown" in sys.argv:
        print(markdown_reference())
    else:
        args = [a for a in sys.argv[1:]]
        path = None
        if args[:1] == ["--config"]:
            path, args = args[1], args[2:]
        print(to_toml(load_config(path, args)))
