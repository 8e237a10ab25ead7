"""[rollout]: sampling, the inference engine, and multi-turn tools and environments."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from spmd_rl.config.checks import AUTO, Auto, Rule, need

if TYPE_CHECKING:
    from spmd_rl.config.run_config import Config

CHOICES: dict[str, tuple[str, ...]] = {
    "engine": ("hf", "vllm"),
    "dtype": ("bfloat16", "float16", "float32"),
    "sleep_level": ("0", "1", "2"),
    "calculate_log_probs": ("auto", "on", "off"),
    "stale_policy": ("drop", "wait"),
}
"""Each key that takes one of a few values: its values (checked by Config.check_choices)."""


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
    """Extra token ids that end a response (the tokenizer's EOS always does), e.g. to end a
    multi-turn model's turn at a character. `python -m spmd_rl.model.tokenizer TOKENIZER TEXT...`
    (TOKENIZER: "char" or a tokenizer directory) prints this override for the tokens TEXT...:
    `python -m spmd_rl.model.tokenizer char "?" 7` -> `rollout.stop_token_ids=[48,10]`."""
    val_temperature: float = 0.0
    """Temperature for validation (0 = greedy)."""
    val_n: int = 1
    """Samples per validation prompt."""
    tensor_parallel_size: int = 1
    """vLLM tensor-parallel size: groups of this many consecutive local ranks form one replica.
    Must divide the GPUs per node."""
    gpu_memory_utilization: float = 0.5
    """vLLM: fraction of GPU memory vLLM may use for weights + KV cache while awake."""
    max_num_seqs: int | Auto = 256
    """vLLM: most sequences in one scheduler step. More of a call's sequences at once decode in fewer,
    larger steps, while the KV cache holds them (when it fills, vLLM preempts the newest request and
    prefills it again later). "auto": the engine is built for the most one engine call of this run
    has, up to 512 (the largest decode batch vLLM captures a CUDA graph for by default), and each
    call runs as many at once as the KV cache holds at the responses' expected lengths: the last
    call's mean, at full length before any finished (spmd_rl/rollout/vllm/running_cap.py;
    rollout/engine_max_running, rollout/engine_preempted); 256 without a GPU (docs/training.md,
    "Speed settings chosen at start"). A number: vLLM's own cap for every call."""
    max_num_batched_tokens: int = 8192
    """vLLM: most tokens in one scheduler step."""
    kv_cache_tokens: int | Auto = 0
    """vLLM: the KV cache's size, in tokens on each GPU of a replica. 0: what rollout.gpu_memory_utilization
    leaves after the weights (vLLM's own sizing). A number: that many (vLLM's kv_cache_memory_bytes, at
    one token's bytes of the model). "auto": every sequence of one engine call at its full length
    (Config.engine_sequences_per_call x Config.engine_max_model_len, in whole KV blocks, and vLLM's null
    block), so no request waits for room; at most what gpu_memory_utilization leaves (0 where that is
    less). A smaller cache is mapped faster at each wake-up and unmapped faster at sleep
    (docs/performance.md for numbers), and leaves room for the engine to stay awake beside training
    (rollout.stay_awake); the memory plan counts the engine's weights, this cache and its runtime, and the
    start-up line of the engine says the size it got."""
    max_model_len: int = 0
    """vLLM: context length; 0 = data.max_prompt_length + data.max_response_length."""
    enforce_eager: bool = False
    """vLLM: disable CUDA graphs."""
    vllm_compile: bool = False
    """vLLM: torch.compile (Inductor) the engine's model, with piecewise CUDA graphs for prefill
    (vLLM's default). Off: no Inductor, and CUDA graphs of the whole decode step only
    (compilation_config mode 0, cudagraph_mode FULL_DECODE_ONLY; prefill runs eager). Off, the
    engine starts in well under half the time and decodes as fast, since vLLM's scheduler on the
    CPU bounds a decode step either way (docs/performance.md, "Why the defaults are what they
    are"). No effect with enforce_eager."""
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
    and caches KV blocks on the CPU in every decode step, and larger blocks leave it less to do;
    64 was measured faster a decode step than 16 and 128, with the same rollout/actor log-prob mismatch
    (docs/performance.md, "Why the defaults are what they are").
    Prefix-cache hits then come in whole blocks of this many tokens, and up to block_size - 1
    tokens of KV memory per sequence go unused."""
    enable_chunked_prefill: bool = True
    """vLLM: split long prefills into chunks."""
    disable_custom_all_reduce: bool = False
    """vLLM: use NCCL instead of vLLM's custom all-reduce for TP. The custom one works with sleep
    mode and CUDA graphs: the engine is built with PyTorch's expandable segments off, whose VMM
    buffers it cannot share between ranks (spmd_rl/runtime/gpu_memory.py; configs/qwen7b.toml at TP=2)."""
    seed: int = 0
    """vLLM engine seed (offset by the replica index so replicas sample differently)."""
    dtype: str = "bfloat16"
    """Rollout engine weights dtype (bfloat16, float16 or float32; "hf" on CPU uses float32)."""
    sleep_level: int = 0
    """vLLM sleep level between rollouts; both free the engine's GPU memory for training. 2 drops the
    weights and the KV cache: new weights come every step anyway, so a host copy would only cost
    time. 1 keeps the weights in host memory and copies them back at wake-up. 0 (default) picks: 1
    with LoRA's adapter sync (model.lora_sync = "adapter": the base is sent once and kept), else 2
    (Config.engine_sleep_level)."""
    weights_stay_on_gpu: bool | Auto = False
    """vLLM with LoRA's adapter sync (model.lora_sync = "adapter"): the engine's base weights stay on
    the GPU while it sleeps, only its KV cache is freed, so no step copies them to host memory at
    sleep and back at wake-up (time/sleep, time/wake) and no host memory holds them; the
    update and the log-prob pass then run beside them (the start-up memory line counts them as
    "vLLM weights"). "auto": on where the memory plan predicts training fits beside them, chosen after
    the update's token budget and before the log-prob pass's (docs/training.md, "Speed settings chosen
    at start"); off without the adapter sync, where new weights come every step."""
    stay_awake: bool | Auto = False
    """vLLM: the engine never sleeps after its first wake-up: its weights and KV cache stay on the GPU
    while training runs, so no step maps them back at wake-up or unmaps them at sleep (time/wake,
    time/sleep), and PyTorch keeps what training freed cached for the next step (no empty_cache()
    before each wake-up; the engine's expandable-segments switch stays off, spmd_rl/runtime/gpu_memory.py).
    The update and the log-prob pass then run beside the whole engine (the start-up memory line counts
    it as "vLLM awake"), which a KV cache sized to the step (rollout.kv_cache_tokens) keeps small.
    "auto": on where the memory plan predicts training fits beside it, chosen after the update's token
    budget and before the weights kept on the GPU asleep (docs/training.md, "Speed settings chosen at
    start"). Not with rollout.offload_train_states, which frees training's memory for an engine that wakes."""
    lora_matmul: bool = True
    """vLLM with LoRA's adapter sync (model.lora_sync = "adapter"): its LoRA layers apply the engine's one
    adapter with two cuBLAS matmuls a layer, its slices joined (spmd_rl/rollout/vllm/lora_matmul.py), in place of
    vLLM's Punica Triton kernels, which look each token's adapter up to serve many at once. Where vLLM
    runs its model uncompiled (rollout.vllm_compile = false, the default). False, or with vllm_compile:
    vLLM's kernels, with the tuned configs of spmd_rl/rollout/vllm/lora_kernels.py where they ship for
    the GPU and shape (docs/lora.md, "LoRA kernels"; docs/performance.md for the generation time)."""
    weight_sync_bucket_mb: int = 512
    """Size of the buckets in which FSDP shards are gathered and handed to the engine."""
    offload_train_states: bool = False
    """Move actor/critic/reference (and reward model) parameters and optimizer states to host
    memory while the engine generates, and back before training (GPU only; spmd_rl/train/offload.py).
    The host buffers are pinned at the first offload and kept for the run: host RAM of the size of
    this rank's training state. Costs two copies of that state over PCIe a step (time/offload,
    time/reload; the first offloads are slower, they pin the buffers; docs/performance.md, "Two and
    four GPUs"); worth it when the engine needs the memory (memory/offloaded_gb shows what it
    frees)."""
    compile_cache_dir: str = ""
    """vLLM's compilation cache (VLLM_CACHE_ROOT: torch.compile/Inductor/Triton artifacts), kept
    across restarts so a warm restart skips compilation; empty = <run_dir>/compile_cache. Point it
    at a shared path to reuse it across runs of the same model and settings. A VLLM_CACHE_ROOT
    already in the environment wins."""
    calculate_log_probs: str = "auto"
    """Ask the engine for every response's sampled-token log-probs (verl's
    `rollout.calculate_log_probs`): "on", "off", or "auto" = on exactly when something reads every
    row's (algorithm.rollout_is, rollout_mask, rollout_reject_sequences; "off" is refused with
    them). Asking costs generation time: vLLM's output processing on the CPU handles every asked
    token (docs/performance.md, "Why the defaults are what they are"). The start-up line says which
    applies and why."""
    logprob_sample_every: int = 8
    """While rollout log-probs are off (calculate_log_probs), every k-th prompt of each rank's
    generate call (its first, then every k-th; all n responses of it) asks for them anyway, so the
    mismatch metrics (rollout/logprob_diff_*, rollout/mismatch_kl) are measured on those rows only;
    1 = every prompt, 0 = none (the metrics are then not logged). Validation never asks."""
    partial_rollouts: bool = False
    """Partial rollouts (spmd_rl/rollout/partial.py): a step's generation stops once each rank has its
    prompts' worth of complete groups; the unfinished responses keep their tokens and log-probs and go
    on in the next steps under newer weights. Turn it on when response lengths have a long tail (a
    step waits for its longest response); with algorithm.rollout_is to correct for the older
    policies (docs/training.md, "Long-tailed response lengths"). Needs every response's log-probs; not with
    multi-turn or algorithm.dynamic_sampling."""
    partial_chunk_tokens: int = 0
    """Partial rollouts: engine steps (tokens per running response) between two checks of whether the
    step's groups are complete; the step's run stops at the first check that finds them.
    0 = 64, or a quarter of data.max_response_length where that is fewer. Smaller cuts closer to the
    batch at one more all-reduce per check; with an engine that resumes its requests at every check
    (the HF engine's rounds) also one more prefill of every running response (docs/training.md,
    "Long-tailed response lengths")."""
    partial_pool_batches: int = 3
    """Partial rollouts: the most batches of prompts (a step's prompts per rank) a rank keeps in
    flight. A step starts with two or more; while its run has fewer unfinished responses than one
    batch has (the engine running short, say while the step waits for a group at max_staleness),
    another batch of new prompts joins the run, up to this many. The engine keeps decoding tokens for
    later steps instead of idling; those groups train later, so older. 2 = no refill
    (docs/training.md, "Long-tailed response lengths")."""
    max_staleness: int = 2
    """Partial rollouts: most policy versions (optimizer steps) between a group's first token and
    the update that trains it."""
    stale_policy: str = "wait"
    """Partial rollouts: a group that would train older than max_staleness is finished within the
    step that reaches the bound ("wait": no sample is lost, the step waits for it), or dropped
    ("drop", counted in rollout/stale_dropped). "drop" trains shorter responses than the policy
    writes, as the long ones are the ones that go stale (docs/training.md, "Long-tailed response
    lengths")."""
    length_profile: str = ""
    """For benchmarks of random-weight models, which never stop: each training prompt's n responses run
    to a length drawn from this profile, the stop tokens ignored, so a step shows the long tail of a
    real run: "lognormal:mean=M,sigma=S,cap=C", "uniform:N" or "hist:FILE" (a JSON histogram of a real
    run's lengths; spmd_rl/rollout/length_profile.py), cut at data.max_response_length. Validation
    is left to the model. Empty (the default): the model decides when to stop. Not with multi-turn."""
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
    """Multi-turn rollouts with an environment: "package.module:Class" or "path/to/file.py:Class"
    with `reset(row)` and `step(message) -> StepResult(messages, done, reward=None)`
    (spmd_rl/rollout/multiturn/environment.py; one instance per trajectory, keeping its state across
    turns). Its reward, where it gives one, replaces the reward function's score; a data_source
    without a scorer (reward.custom_function, the built-in ones) needs none: its trajectories'
    reward is the environment's, 0 where it gives none (one cut short by max_turns or the length
    limit). Empty = single-turn (or tools). docs/own-task.md, examples/my_task/env.py."""
    max_turns: int = 5
    """Multi-turn: most model turns per trajectory (1 = the model answers once; tools never run)."""
    chat_template: str = ""
    """The chat template that renders the prompts (data.apply_chat_template) and the messages
    between turns: a Jinja file's path, or the name of one shipped in
    spmd_rl/rollout/multiturn/templates/; empty = the tokenizer's own. Multi-turn needs a template
    that leaves earlier turns unchanged when messages are added; Qwen3's own drops the `<think>`
    blocks of earlier turns and is refused: use "qwen3_keep_thinking" (Qwen3's template keeping
    every turn as the model wrote it; single-turn prompts render as with Qwen3's own)."""
    tool_parser: str = "hermes"
    """Multi-turn: how tool calls are read from a turn, by the model's format: "hermes" (Qwen2.5's and
    Qwen3's `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, several per turn, none inside
    `<think>`), "llama3_json" (Llama 3.x: the turn is `{"name": ..., "parameters": {...}}`, several
    separated by ";", possibly after `<|python_tag|>`), or "package.module:Class" with
    `parse(text) -> list[ToolCall | CallError]`."""
    tool_timeout: float = 10.0
    """Multi-turn: seconds a tool call may take from its start, past which the model is told it timed
    out (a call still waiting for a pool thread after this long never runs, and the model is told
    so); and seconds for all of a turn's environment steps together (and for the resets), past
    which the steps still running end their trajectories."""
    max_tool_response_tokens: int = 256
    """Multi-turn: each tool or environment message is cut to this many tokens (0 = no limit)."""
    tool_pool_size: int = 32
    """Multi-turn: threads that run tool calls and environment steps in parallel, per rank (a call or
    step past its timeout cannot be stopped and holds its thread until it returns)."""

    @property
    def multi_turn(self) -> bool:
        return bool(self.tools or self.environment)

    def check_multi_turn(self) -> None:
        """Tools or an environment, not both, and turns to take them (that they import and have what
        the loop needs: preflight.user_code.check_multi_turn_code)."""
        if not self.multi_turn:
            return
        need(not (self.tools and self.environment), "rollout.tools and rollout.environment cannot be used "
              "together: put the tools' work into the environment's step, or drop one of them")
        need(self.max_turns >= 1, f"rollout.max_turns = {self.max_turns} must be >= 1")

    def check_partial(self, dynamic_sampling: bool) -> None:
        """What partial rollouts cannot carry over yet: episodes mid-way, dynamic sampling's rounds."""
        if not self.partial_rollouts:
            return
        need(not self.multi_turn, "rollout.partial_rollouts does not carry multi-turn episodes over yet: turn off "
             "rollout.partial_rollouts, or rollout.tools / rollout.environment")
        need(not dynamic_sampling, "rollout.partial_rollouts and algorithm.dynamic_sampling cannot be used together "
             "yet: turn one of them off")

    def check_sampling(self) -> None:
        need(self.n >= 1, "rollout.n must be >= 1")
        need(self.temperature > 0, "rollout.temperature must be > 0 for training rollouts")
        need(0 < self.top_p <= 1, "rollout.top_p must be in (0, 1]")
        need(self.top_k == -1 or self.top_k > 0, "rollout.top_k must be -1 (off) or > 0")
        need(self.val_n >= 1, "rollout.val_n must be >= 1")
        need(self.val_n == 1 or self.val_temperature > 0,
              "rollout.val_n > 1 needs rollout.val_temperature > 0 (greedy samples are all the same)")

    def check_engine(self, world_size: int, gpus_per_node: int | None) -> None:
        """The engine's tensor-parallel groups fit the ranks and the nodes; its memory settings."""
        tp = self.tensor_parallel_size
        need(tp >= 1, "rollout.tensor_parallel_size must be >= 1")
        if self.engine == "hf":
            need(tp == 1, 'rollout.tensor_parallel_size > 1 needs rollout.engine = "vllm"')
        need(world_size % tp == 0, f"rollout.tensor_parallel_size = {tp} must divide the world size {world_size}")
        if gpus_per_node is not None:
            need(gpus_per_node % tp == 0,
                  f"rollout.tensor_parallel_size = {tp} does not divide the {gpus_per_node} GPUs per node, so a "
                  f"tensor-parallel group would span two nodes: use a divisor of {gpus_per_node}")
        need(0 < self.gpu_memory_utilization < 1, "rollout.gpu_memory_utilization must be in (0, 1)")
        need(self.weight_sync_bucket_mb > 0, "rollout.weight_sync_bucket_mb must be > 0")
        need(self.stay_awake is not True or self.engine == "vllm",
             'rollout.stay_awake = true keeps the vLLM engine awake between steps; the HF engine never sleeps: '
             'set it to false or "auto", or use rollout.engine = "vllm"')
        need(self.stay_awake is not True or not self.offload_train_states,
             "rollout.stay_awake = true keeps the engine's memory through training, while rollout.offload_train_states "
             'moves training\'s state off the GPU to make room for an engine that wakes: set one of them to false '
             '(or rollout.stay_awake = "auto", which stays asleep beside the offload)')

    def ranges(self, cfg: Config) -> list[Rule]:
        d = cfg.data
        return [
            ("val_temperature", self.val_temperature >= 0, ">= 0 (0 = greedy)"),
            ("val_n", self.val_n >= 1, ">= 1"),
            ("stop_token_ids", all(i >= 0 for i in self.stop_token_ids), "token ids >= 0"),
            ("max_num_seqs", self.max_num_seqs == AUTO or self.max_num_seqs >= 1, '>= 1, or "auto"'),
            ("max_num_batched_tokens", self.max_num_batched_tokens >= 1, ">= 1"),
            ("kv_cache_tokens", self.kv_cache_tokens == AUTO or self.kv_cache_tokens == 0
             or self.kv_cache_tokens >= cfg.engine_max_model_len(),
             '0 (gpu_memory_utilization sizes it), "auto", or >= the engine\'s context length '
             '(rollout.max_model_len, or data.max_prompt_length + data.max_response_length)'),
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
            ("partial_chunk_tokens", self.partial_chunk_tokens >= 0,
             ">= 0 (0 = 64, or a quarter of data.max_response_length where fewer)"),
            ("max_staleness", self.max_staleness >= 1, ">= 1"),
            ("partial_pool_batches", self.partial_pool_batches >= 2, ">= 2 (2 = no refill)"),
        ]

    def check_logprobs(self, readers: list[str]) -> None:
        """calculate_log_probs = "off" with a setting that reads every row's rollout log-probs."""
        need(self.calculate_log_probs != "off" or not readers,
              f"rollout.calculate_log_probs = 'off' but {readers[0] if readers else ''} reads every response's rollout "
              "log-probs: set rollout.calculate_log_probs = 'auto' (or 'on')")
