"""A vLLM engine colocated with the FSDP2 actor in the same torchrun process (GPU only).

Every rank builds one `vllm.LLM` with `distributed_executor_backend="external_launcher"`: vLLM
then runs its single worker in this process and joins the process group torchrun started.
Tensor-parallel groups are `tensor_parallel_size` consecutive ranks (vLLM's own layout); each
group is an independent replica. All ranks of a group must submit the same requests in the same
order with the same RNG state, so `generate` gathers the group's prompts over a small gloo
subgroup, generates all of them on every rank of the group and returns each rank its own slice.

The engine starts asleep and follows the trainer's cycle (spmd_rl/rollout/base.py):

    wake_up(["weights"]) -> load_weights(stream) -> wake_up(["kv_cache"]) -> generate -> sleep()

(with LoRA's adapter sync, model.lora_sync = "adapter": vLLM's LoRA layers are built, the engine
sleeps at level 1 so the base it got once stays in host memory, or on the GPU with
rollout.weights_stay_on_gpu (spmd_rl/rollout/vllm/sleep.py), and `load_adapter` replaces the
adapter each step, from memory, before the KV cache wakes), with `torch.cuda.empty_cache()` right
before waking and right after sleeping (PyTorch's cache must
give memory back for vLLM's pool to take it, and the other way round), expandable segments off
while awake and while it is built (spmd_rl/runtime/gpu_memory.py: vLLM's custom all-reduce cannot share
CUDA-graph buffers from expandable segments) and the prefix cache reset after every weight load.
With rollout.stay_awake the engine sleeps once, at start-up, and from its first wake-up on keeps its
memory: `sleep()` does nothing, `wake_up()` finds nothing to wake (no empty_cache), and training runs
beside it in PyTorch's cache, expandable segments off.

Facts this module relies on (vLLM 0.26; checked on H100/H200, see tests/gpu/):
- `load_format="dummy"`: start-up reads no checkpoint; the first `load_weights` gives the weights.
- `sleep(level=2)` drops weights and KV cache; until the next `load_weights` the weights are
  garbage, so `generate` refuses to run (sleep level 1 keeps a CPU copy instead). vLLM's check
  that a sleep freed memory reads the whole device's free memory; spmd_rl/rollout/vllm/sleep.py
  keeps a sleep that another process on the GPU made look like a leak.
- `logprobs_mode="processed_logprobs"`: the returned log-prob of a sampled token is taken after
  temperature (and after top-k/top-p, which renormalise over the kept tokens), i.e. what the actor
  computes from logits / temperature when top_p = 1 and top_k = -1. Greedy requests get
  log_softmax(logits) at temperature 1.
- vLLM pads the embedding / lm_head rows to a multiple of 64 (Qwen2's 151936 / 152064 need none);
  `load_weights` fills the real rows and the logits are cut back to the config's vocab_size, so
  nothing is masked or padded in what we see: tokens past
  the tokenizer's length but inside vocab_size (Qwen2.5: 151665..151935) can be sampled by both
  engine and actor alike, as the config's vocab_size says.
- Only the requests whose prompt asks for log-probs get them (SamplingParams.logprobs_every), in
  flat lists and with the garbage collector paused during the call: their cost and the adapter
  are in spmd_rl/rollout/vllm/outputs.py.
- With `skip_tokenizer_init=True` vLLM does not know the EOS token, so the EOS ids of the model's
  config.json / generation_config.json are added to every request's stop_token_ids.
- vLLM 0.26 runs dense models on its "V2" model runner, which samples with a counter-based Gumbel
  kernel seeded per request; requests without a seed draw one from numpy's global RNG. Every
  request here gets an explicit seed from (rollout.seed + replica, the call's seed, its index), so
  a call is reproducible, all ranks of a TP group agree and replicas differ.
- A sleeping engine still holds buffers outside its sleep pool, and more after the first rollout
  (docs/performance.md, "Memory peaks per preset"; runtime/memory_plan.py counts them as
  ENGINE_ASLEEP_GIB); `close()` gives them back.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import json
import logging
import os
import time
from typing import Any, Iterable

import torch
import torch.distributed as dist

from spmd_rl.config.checks import AUTO
from spmd_rl.model.expert_layout import FUSED_EXPERTS
from spmd_rl.model.loading import DTYPES
from spmd_rl.rollout.base import Completion, SamplingParams
from spmd_rl.rollout.finish_times import GenerateTail
from spmd_rl.rollout.vllm import lora_kernels, lora_matmul
from spmd_rl.rollout.vllm import sleep as vllm_sleep
from spmd_rl.rollout.vllm.model_inspection import in_process_inspection
from spmd_rl.rollout.vllm.outputs import completion, logprob_request, paused_gc, supports_flat_logprobs
from spmd_rl.rollout.vllm.running_cap import RunningCap
from spmd_rl.rollout.vllm.streamed import StreamedRun
from spmd_rl.runtime.gpu_memory import engine_build_allocator, expandable_segments_requested, set_expandable_segments

log = logging.getLogger(__name__)

TAGS = ("weights", "kv_cache")
STREAM_INTERVAL = 16
"""vLLM's `stream_interval` with partial rollouts: a streamed run's request (streamed.py) delivers its new
tokens every this many, not every step (each delivery is a Python object per running request, on the
CPU the decode loop waits for); a stopped request loses at most this many - 1 of its last tokens, which
it samples again when it goes on. Requests of `generate` deliver only at their end either way."""


# --------------------------------------------------------------------------- helpers


def eos_token_ids(model_dir: str) -> list[int]:
    """EOS ids named by the model directory's config.json and generation_config.json."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        path = os.path.join(model_dir, name)
        if os.path.isfile(path):
            with open(path) as f:
                value = json.load(f).get("eos_token_id")
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, list):
                ids.update(int(v) for v in value)
    return sorted(ids)


def step_capture_sizes(cfg, world_size: int) -> list[int]:
    """The CUDA-graph batch sizes of rollout.cudagraph_step_sizes: 1, 2, 3, 4, 6, 8, 12, ... up to
    the most sequences one engine replica gets in a generate call of this run
    (Config.engine_sequences_per_call), at most max_num_seqs."""
    cap = max(1, min(cfg.rollout.max_num_seqs, cfg.engine_sequences_per_call(world_size)))
    sizes, k = {cap}, 1
    while k < cap:
        sizes.update((k, k + k // 2) if k > 1 else (k,))
        k *= 2
    return sorted(s for s in sizes if s <= cap)


def returns_routes(cfg, model_dir: str) -> bool:
    """Whether the engine is asked for each token's routed experts (vLLM's
    `enable_return_routed_experts`): actor.router_replay = "engine" and model_dir's config.json (its
    text config) is a mixture of experts. vLLM returns them per request as [prompt + generated - 1,
    num_hidden_layers, top_k] (the last sampled token is never fed), prefix-cached tokens included
    (its RoutedExpertsManager keeps them by KV block); dense layers' rows are zeros, which the
    trainer's dense layers never read."""
    return cfg.actor.router_replay == "engine" and expert_count(model_dir) > 0


def text_config(model_dir: str) -> dict:
    """model_dir's config.json (its text config, for a multimodal one); {} without one."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        config = json.load(f)
    return config.get("text_config", config)


def expert_count(model_dir: str) -> int:
    """The routed experts of each mixture-of-experts layer of model_dir's config.json (its text
    config); 0 for a dense model or a directory without one."""
    from spmd_rl.runtime.memory_plan import experts_of

    return experts_of(text_config(model_dir))


def kv_cache_words(cfg, world_size: int, kv_bytes: int) -> str:
    """The start-up line's words for rollout.kv_cache_tokens (its engine kwarg `kv_bytes`, 0 if none)."""
    tokens = cfg.engine_kv_cache_tokens(world_size)
    if not kv_bytes:
        return (f'rollout.kv_cache_tokens = "auto" wants {tokens} tokens, more than rollout.gpu_memory_utilization '
                f"leaves: vLLM sizes it from gpu_memory_utilization")
    why = (f'"auto": {cfg.engine_sequences_per_call(world_size)} sequences x {cfg.engine_max_model_len()} tokens'
           if cfg.rollout.kv_cache_tokens == AUTO else "set")
    return f"{tokens} tokens, {kv_bytes / 2**30:.1f} GiB (rollout.kv_cache_tokens {why})"


def engine_kwargs(cfg, model_dir: str, seed: int, *, dummy: bool = True, sleep_mode: bool = True,
                  world_size: int = 1, device_total: float | None = None, **overrides: Any) -> dict[str, Any]:
    """Keyword arguments of `vllm.LLM` for this config: the project's own, then the user's
    `rollout.engine_kwargs` (config validation refused those that would replace one of ours), then
    `overrides`. `dummy=False, sleep_mode=False` gives a plain engine that reads the checkpoint from
    disk with otherwise identical settings (tests, bench). `world_size`: the run's ranks (the
    batch sizes of rollout.cudagraph_step_sizes, rollout.kv_cache_tokens' "auto"); `device_total`: the
    GPU's bytes ("auto"'s cap: preflight.memory.engine_kv_cache_bytes)."""
    r = cfg.rollout
    kw: dict[str, Any] = dict(
        model=model_dir,
        tensor_parallel_size=r.tensor_parallel_size,
        distributed_executor_backend="external_launcher",
        dtype=r.dtype,
        seed=seed,
        skip_tokenizer_init=True,
        load_format="dummy" if dummy else "auto",
        enable_sleep_mode=sleep_mode,
        logprobs_mode="processed_logprobs",
        max_model_len=cfg.engine_max_model_len(),
        gpu_memory_utilization=r.gpu_memory_utilization,
        max_num_seqs=r.max_num_seqs,
        max_num_batched_tokens=r.max_num_batched_tokens,
        enforce_eager=r.enforce_eager,
        enable_prefix_caching=r.enable_prefix_caching,
        enable_chunked_prefill=r.enable_chunked_prefill,
        disable_custom_all_reduce=r.disable_custom_all_reduce,
    )
    from spmd_rl.preflight.memory import engine_kv_cache_bytes

    kv_bytes = engine_kv_cache_bytes(cfg, world_size, device_total)  # 0: vLLM sizes it
    if kv_bytes:  # rollout.kv_cache_tokens: the KV cache's size, in place of gpu_memory_utilization's share
        kw["kv_cache_memory_bytes"] = kv_bytes
    if r.partial_rollouts:  # a streamed run's requests deliver their new tokens every STREAM_INTERVAL tokens
        kw["stream_interval"] = STREAM_INTERVAL
    if returns_routes(cfg, model_dir):  # routing replay: each token's experts come back (Completion.routes)
        kw["enable_return_routed_experts"] = True
    if cfg.model.adapter_sync:  # LoRA layers in the engine: the base kept, the adapter loaded each step
        from transformers import AutoConfig

        from spmd_rl.model.lora import engine_target_modules, vllm_max_lora_rank

        kw.update(enable_lora=True, max_lora_rank=vllm_max_lora_rank(cfg.model.lora_rank), max_loras=1,
                  lora_target_modules=engine_target_modules(cfg.model.lora_target_modules,
                                                            AutoConfig.from_pretrained(model_dir)))  # not the experts
    if r.block_size:
        kw["block_size"] = r.block_size
    if r.cudagraph_capture_sizes:
        kw["cudagraph_capture_sizes"] = list(r.cudagraph_capture_sizes)
    elif r.cudagraph_step_sizes and not r.enforce_eager:
        kw["cudagraph_capture_sizes"] = step_capture_sizes(cfg, world_size)
    if not r.vllm_compile and not r.enforce_eager:  # CUDA graphs of the decode step, no Inductor
        kw["compilation_config"] = {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}
    if cfg.model.adapter_sync:  # every request carries the adapter: vLLM's graphs without one would never run
        kw["compilation_config"] = {**kw.get("compilation_config", {}), "cudagraph_specialize_lora": False}
    user = copy.deepcopy(r.engine_kwargs)  # a copy: vLLM may change the tables it is given
    if isinstance(user.get("compilation_config"), dict) and "compilation_config" in kw:
        user["compilation_config"] = {**kw["compilation_config"], **user["compilation_config"]}  # entries added
    kw.update(user)
    kw.update(overrides)
    return kw


def use_cache_root(path: str) -> str:
    """Make vLLM keep its caches under `path` (VLLM_CACHE_ROOT; set before the engine is built,
    unless the environment already names one). vLLM 0.26 puts its torch.compile artifacts in
    VLLM_CACHE_ROOT/torch_compile_cache/<config hash>/rank_<r>_<dp>/ and points Inductor's and
    Triton's caches inside them, so a restart with the same model and settings loads compiled
    graphs instead of compiling. CUDA graphs are captured again at every start (vLLM keeps none
    on disk). Returns the root in use."""
    root = os.environ.setdefault("VLLM_CACHE_ROOT", os.path.abspath(path))
    os.makedirs(root, exist_ok=True)
    return root


def inner_model(llm) -> torch.nn.Module:
    """The nn.Module inside this process's vLLM worker."""
    runner = vllm_sleep.engine_worker(llm).model_runner
    return runner.get_model() if hasattr(runner, "get_model") else runner.model


def unset_parameters(model: torch.nn.Module, loaded: set[str]) -> list[str]:
    """The engine parameters that `model.load_weights` did not report as loaded (`loaded`: its return).

    vLLM 0.26's fused-MoE layer reports its experts one module level short: `MoERunner.load_weights`
    (at `...mlp.experts`) returns the names of its `routed_experts` child (`w13_weight`), so the loader
    reports `...mlp.experts.w13_weight` for the parameter `...mlp.experts.routed_experts.w13_weight`.
    A parameter also counts as loaded when its name with the module level just above it removed was
    reported: that level, never any other, so an expert weight the stream lacked is still found."""
    def reported(name: str) -> bool:
        parts = name.split(".")
        return name in loaded or (len(parts) > 2 and ".".join(parts[:-2] + parts[-1:]) in loaded)

    return sorted(n for n, _ in model.named_parameters() if not reported(n))


def expert_layers() -> tuple[type, ...]:
    """vLLM's fused-MoE layer classes (MoERunner: a model's `...mlp.experts`), whose own load_weights
    takes the layer's fused expert tensors as transformers names them; () without vLLM."""
    try:
        from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner
    except ImportError:
        return ()
    return (MoERunner,)


def load_fused_experts(model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                       loaded: set[str]) -> Iterable[tuple[str, torch.Tensor]]:
    """The weight stream less the fused expert tensors (`...mlp.experts.gate_up_proj`, `down_proj`) of
    the engine's fused-MoE layers, each loaded on the way by its layer's own loader (the names it
    reports added to `loaded`, one module level short as vLLM's loaders report them: unset_parameters).

    The layer's loader, not the model's: vLLM 0.26's hand-written model loaders (GLM-4.7-Flash's
    `glm4_moe_lite`) read only each expert's checkpoint tensors, and build their expert names for a
    LoRA-wrapped layer as soon as any layer of the model is wrapped (an adapter on the attention), so
    they cannot load experts their LoRA layers left alone. The layer knows its own wrapping, and takes
    the fused tensors whole (one copy a tensor, not one a tensor and expert)."""
    kinds = expert_layers()
    layers = {name: m for name, m in model.named_modules() if isinstance(m, kinds)} if kinds else {}
    for name, tensor in weights:
        match = FUSED_EXPERTS.match(name)
        layer = layers.get(match["experts"]) if match is not None and tensor.dim() == 3 else None
        if layer is None:
            yield name, tensor
        else:
            loaded.update(f"{match['experts']}.{p}" for p in layer.load_weights([(match["proj"], tensor)]))


def derived_weight_layers() -> tuple[type, ...]:
    """vLLM's layer classes whose parameters are computed from other, loaded ones after a load
    (refresh_derived_weights); () without vLLM."""
    try:
        from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    except ImportError:
        return ()
    return (MLAAttention,)


def refresh_derived_weights(model: torch.nn.Module, dtype: torch.dtype) -> set[str]:
    """Recompute, in place, the engine parameters vLLM derives from loaded ones, and return their names.

    vLLM 0.26's multi-head latent attention (GLM-4.7-Flash, DeepSeek) decodes with W_UK_T and W_UV,
    its kv_b_proj weight split and transposed once after loading (`MLAAttention.process_weights_after_loading`,
    vLLM's own post-load step for the layer, which copies into the existing parameters so that captured
    CUDA graphs stay valid). A sync that skipped it would decode with the matrices of the weights before it."""
    layers = derived_weight_layers()
    derived: set[str] = set()
    for name, module in model.named_modules():
        if layers and isinstance(module, layers):
            module.process_weights_after_loading(dtype)
            derived.update(f"{name}.{p}" for p, _ in module.named_parameters(recurse=False))
    return derived


def shutdown_llm(llm) -> None:
    """Free a (non-sleep-mode) engine's GPU memory in-process, keeping torch's default process
    group alive. vLLM's own shutdown ends with `destroy_process_group()`, which would also take
    down the trainer's group; here vLLM's groups are destroyed and the default one is left.
    The caller must drop its own references to `llm` afterwards."""
    from vllm.distributed import parallel_state as ps

    original = ps.destroy_distributed_environment

    def keep_default_group() -> None:
        if ps._WORLD is not None:
            ps._WORLD.destroy()
        ps._WORLD = None
        if hasattr(ps, "_NODE_COUNT"):
            ps._NODE_COUNT = None

    ps.destroy_distributed_environment = keep_default_group
    try:
        llm.llm_engine.engine_core.shutdown()
    finally:
        ps.destroy_distributed_environment = original
    gc.collect()
    torch.cuda.empty_cache()


def to_vllm_sampling(sampling: SamplingParams, stop_token_ids: Iterable[int], asks_logprobs: bool = True,
                     flat_logprobs: bool = False, **extra: Any):
    """vLLM SamplingParams for our SamplingParams: token ids out, the sampled token's log-prob when
    `asks_logprobs` (in flat lists when `flat_logprobs`: spmd_rl/rollout/vllm/outputs.py)."""
    from vllm import SamplingParams as VSP

    greedy = sampling.greedy
    return VSP(
        n=1 if greedy else sampling.n,  # vLLM refuses n > 1 for greedy; copies are made instead
        temperature=0.0 if greedy else sampling.temperature,
        top_p=1.0 if greedy else sampling.top_p,
        top_k=0 if (greedy or sampling.top_k <= 0) else sampling.top_k,
        max_tokens=sampling.max_new_tokens,
        stop_token_ids=[] if sampling.ignore_eos else sorted(set(stop_token_ids) | set(sampling.stop_token_ids)),
        ignore_eos=sampling.ignore_eos,
        detokenize=False,
        **logprob_request(asks_logprobs, flat_logprobs),
        **extra,
    )


def adapter_kwargs(lora_request) -> dict[str, Any]:
    """vllm.LLM.generate's keyword for the adapter every request runs with (none without one: engines
    without LoRA layers are called without it)."""
    return {} if lora_request is None else {"lora_request": lora_request}


def prompt_logprobs(llm, seqs: list[list[int]], lora_request=None) -> list[list[float]]:
    """Teacher-forced log p(seq[t] | seq[:t]) for t >= 1 from a vllm.LLM (prompt_logprobs=0), with
    the adapter of `lora_request` if one is given. Every rank of a TP group must pass the same sequences."""
    from vllm import SamplingParams as VSP

    if not seqs:
        return []
    sp = VSP(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": list(s)} for s in seqs], sp, use_tqdm=False,
                        **adapter_kwargs(lora_request))
    res = []
    for s, o in zip(seqs, outs):
        pl = o.prompt_logprobs
        res.append([float(pl[t][tok].logprob) for t, tok in enumerate(s) if t >= 1])
    return res


def _mix_seed(*parts: int) -> int:
    h = 0x9E3779B97F4A7C15
    for p in parts:
        h = (h ^ (int(p) & 0xFFFFFFFFFFFFFFFF)) * 0x100000001B3 & 0xFFFFFFFFFFFFFFFF
    return h % (2**63 - 1)


# --------------------------------------------------------------------------- engine


class VLLMEngine:
    """The colocated vLLM rollout engine (RolloutEngine protocol of spmd_rl/rollout/base.py).

    `cfg` is the run's spmd_rl Config; `model_dir` a Hugging Face model directory (only its
    config is read at start-up: weights come from `load_weights`). Must be built on every rank,
    collectively, after the default process group exists (torchrun env: RANK, LOCAL_RANK,
    WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Only one such engine may exist per process.
    """

    def __init__(self, cfg, model_dir: str, rank: int, world_size: int, local_rank: int, local_world_size: int):
        r = cfg.rollout
        tp = r.tensor_parallel_size
        if tp < 1 or local_world_size % tp or world_size % tp:
            raise ValueError(
                f"rollout.tensor_parallel_size = {tp} must divide the {local_world_size} GPUs per node "
                f"(and the world size {world_size}): a tensor-parallel group is {tp} consecutive ranks of "
                f"one node. Use a divisor of {local_world_size}.")
        if not dist.is_initialized():
            raise RuntimeError("VLLMEngine needs the default process group: call "
                               "spmd_rl.runtime.distributed.init_distributed() first (under torchrun)")
        if cfg.engine_sleep_level() not in (1, 2):
            raise ValueError(f"rollout.sleep_level must be 0, 1 or 2, got {r.sleep_level}")
        self.cfg = cfg
        self.model_dir = model_dir
        self.rank, self.world_size = rank, world_size
        self.local_rank, self.local_world_size = local_rank, local_world_size
        self.tp = tp
        self.replica = rank // tp
        self.tp_rank = rank % tp
        self.sleep_level = cfg.engine_sleep_level()
        self.lora = None
        if cfg.model.adapter_sync:  # (rank, alpha, targets) of the adapter load_adapter takes
            from spmd_rl.model.lora import LoraSettings

            self.lora = LoraSettings.of(cfg.model, DTYPES[r.dtype])
        self._lora_request = None  # the adapter every request runs with (load_adapter)
        self._adapter_id = 0
        self._wrapped: set[str] | None = None  # transformers names of the modules vLLM's LoRA layers wrap
        self.engine_seed = r.seed + self.replica
        self.stop_ids = eos_token_ids(model_dir)
        self.num_experts = expert_count(model_dir)  # the bound of the routes vLLM returns (outputs.routes)
        if not self.stop_ids:
            log.warning("%s names no eos_token_id: responses end only at stop_token_ids or the length limit",
                        model_dir)
        if r.top_p < 1.0 or r.top_k > 0:
            log.warning("rollout.top_p/top_k truncate the sampling distribution: vLLM's processed log-probs "
                        "are then renormalised over the kept tokens, while the actor's are not")

        # One gloo subgroup per TP group for gathering prompts (CPU objects), created on every rank
        # in the same order, as torch.distributed.new_group requires.
        self._group = None
        if tp > 1:
            for g in range(world_size // tp):
                pg = dist.new_group(list(range(g * tp, (g + 1) * tp)), backend="gloo")
                if g == self.replica:
                    self._group = pg

        # torchrun sets these; vLLM's external launcher reads them.
        os.environ.setdefault("RANK", str(rank))
        os.environ.setdefault("LOCAL_RANK", str(local_rank))
        os.environ.setdefault("WORLD_SIZE", str(world_size))
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

        self._expandable = expandable_segments_requested()
        from vllm import LLM
        from vllm import SamplingParams as VSP

        # How requests that ask for log-probs get them (outputs.py): in flat lists, with the garbage
        # collector paused during generate (docs/performance.md, "Why the defaults are what they
        # are"). scripts/bench/bench_generation.py measures each.
        self.flat_logprobs = supports_flat_logprobs(VSP)
        self.pause_gc = True

        if self.lora is not None and r.lora_matmul and not r.vllm_compile:  # cuBLAS matmuls (lora_matmul.py)
            lora_matmul.install(every_request_has_adapter=True)  # _check_ready: no generation without it
            log.info("LoRA kernels: the adapter through cuBLAS matmuls (rollout.lora_matmul)")
        elif self.lora is not None:  # vLLM's kernels, with their tuned configs where they ship for this GPU and shape
            from spmd_rl.model.lora import vllm_max_lora_rank

            log.info(lora_kernels.choose(torch.cuda.get_device_name(), text_config(model_dir),
                                         vllm_max_lora_rank(cfg.model.lora_rank), tp))

        t0 = time.perf_counter()
        # CUDA graphs captured outside expandable segments (custom all-reduce); the model class
        # inspected here, not in a new Python (model_inspection.py)
        with engine_build_allocator(), in_process_inspection():
            torch.cuda.empty_cache()
            total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory \
                if torch.cuda.is_available() else None
            kwargs = engine_kwargs(cfg, model_dir, self.engine_seed, world_size=world_size, device_total=total)
            self.llm = LLM(**kwargs)
        self.init_seconds = time.perf_counter() - t0
        if r.kv_cache_tokens:
            log.info("KV cache: %s", kv_cache_words(cfg, world_size, kwargs.get("kv_cache_memory_bytes", 0)))
        # rollout.max_num_seqs = "auto": each call's cap from what the KV cache holds (running_cap.py)
        self.running_cap = (RunningCap.of(self.llm, r.max_num_seqs) if "rollout.max_num_seqs" in cfg.auto_chosen
                            else None)
        self.tail = GenerateTail()  # when each generate call's requests finish (rollout/generate_tail_share)
        self._awake = set(TAGS)
        self._weights_valid = False  # dummy weights until the first load_weights
        self._prefix_cache_stale = False
        self._runs = 0  # streamed runs started (their request ids)
        self.weights_stay = cfg.engine_keeps_weights()  # "auto" was chosen at start (speed_settings)
        if self.weights_stay:  # before the first sleep, which would otherwise copy them to host memory
            vllm_sleep.keep_weights_on_gpu(self.llm)
        self.stays_awake = False
        self.sleep()  # asleep until the first weight sync, also where it then stays awake
        self.stays_awake = cfg.engine_stays_awake()
        kept = (", awake from its first wake-up on (rollout.stay_awake)" if self.stays_awake else
                f", its weights ({self.engine_parameter_bytes() / 2**30:.1f} GiB) kept on the GPU while it sleeps"
                if self.weights_stay else "")
        log.info("vLLM engine ready in %.1fs: replica %d, tp %d, sleep level %d%s, stop ids %s",
                 self.init_seconds, self.replica, tp, self.sleep_level, kept, self.stop_ids)

    # ------------------------------------------------------------------ memory
    def _expandable_off(self) -> None:
        if self._expandable:
            set_expandable_segments(False)

    def _expandable_restore(self) -> None:
        if self._expandable:
            set_expandable_segments(True)

    @property
    def is_asleep(self) -> bool:
        return not self._awake

    def sleep(self) -> None:
        """Give back vLLM's GPU memory (weights and KV cache; level 1 keeps a CPU copy of the
        weights; with rollout.weights_stay_on_gpu the weights stay). No-op when already asleep, and
        with rollout.stay_awake after start-up: the engine then keeps its memory, and PyTorch its cache."""
        if not self._awake or self.stays_awake:
            return
        vllm_sleep.sleep(self.llm, self.sleep_level)  # survives vLLM's check on a shared GPU
        self._awake.clear()
        if self.sleep_level >= 2:
            self._weights_valid = False
        torch.cuda.empty_cache()
        self._expandable_restore()

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Take memory back for `tags` ("weights", "kv_cache"; None = both, weights first).
        Without a load_weights in between, a level-2 sleep leaves garbage weights (generate refuses)."""
        tags = list(TAGS) if tags is None else list(tags)
        unknown = set(tags) - set(TAGS)
        if unknown:
            raise ValueError(f"unknown wake_up tags {sorted(unknown)}: use 'weights' and/or 'kv_cache'")
        todo = [t for t in TAGS if t in tags and t not in self._awake]
        if not todo:
            return
        self._expandable_off()
        torch.cuda.empty_cache()
        for tag in todo:  # weights before kv_cache, one tag per call: the documented order
            self.llm.wake_up(tags=[tag])
            self._awake.add(tag)
        if "kv_cache" in todo:
            self._reset_prefix_cache()

    def _reset_prefix_cache(self) -> None:
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM could not reset its prefix cache (requests still running?)")
        self._prefix_cache_stale = False

    # ------------------------------------------------------------------ weights
    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], strict: bool = True) -> None:
        """Copy full tensors named as in the HF model (any iterable; consumed once, lazily) into
        the engine; a mixture's fused experts go to their fused-MoE layer's own loader
        (load_fused_experts), and the parameters vLLM derives from loaded ones are computed again
        (refresh_derived_weights). Needs wake_up(["weights"]) first. The prefix
        cache is reset once the KV cache is awake (blocks computed with old weights must not be
        reused). `strict`: the stream must cover every engine parameter (pass False to load a part)."""
        if "weights" not in self._awake:
            raise RuntimeError("load_weights needs the weights awake: call wake_up(['weights']) first")
        model = inner_model(self.llm)
        experts: set[str] = set()
        weights = load_fused_experts(model, weights, experts)
        if self.lora is not None:  # the base layers of the LoRA-wrapped modules
            from spmd_rl.model.lora import base_layer_name

            wrapped = self._lora_wrapped_modules()
            weights = ((base_layer_name(name, wrapped), t) for name, t in weights)
        loaded = model.load_weights(weights)
        derived = refresh_derived_weights(model, DTYPES[self.cfg.rollout.dtype])
        if strict and isinstance(loaded, set):
            missing = unset_parameters(model, loaded | experts | derived)
            if missing:
                raise RuntimeError(f"load_weights left {len(missing)} engine parameters unset, e.g. {missing[:5]}")
        self._weights_valid = True
        self._prefix_cache_stale = True
        if "kv_cache" in self._awake:
            self._reset_prefix_cache()

    def _lora_wrapped_modules(self) -> set[str]:
        """Transformers names of the modules whose weights sit in a vLLM LoRA layer's `base_layer`:
        each wrapped engine module, and for a packed one (qkv_proj) the modules packed in it
        (q_proj, k_proj, v_proj: the model's packed_modules_mapping)."""
        if self._wrapped is None:
            from vllm.lora.layers import BaseLayerWithLoRA

            model = inner_model(self.llm)
            packed = getattr(model, "packed_modules_mapping", {}) or {}
            self._wrapped = set()
            for name, module in model.named_modules():
                if isinstance(module, BaseLayerWithLoRA):
                    prefix, _, leaf = name.rpartition(".")
                    self._wrapped.update(f"{prefix}.{part}" if prefix else part for part in packed.get(leaf, [leaf]))
        return self._wrapped

    @torch.no_grad()
    def load_adapter(self, tensors: dict[str, torch.Tensor]) -> None:
        """Make the adapter in `tensors` (full tensors under PEFT's saved names, spmd_rl.model.lora.
        peft_tensor_name) the one every later request runs with, from memory: vLLM's LoRA manager gets
        a LoRAModel built from the tensors (cast to vLLM's lora_dtype) under a new id, in place of the
        previous one. Needs wake_up(["weights"]) first (the LoRA layers' slots are in the weights pool)."""
        if self.lora is None:
            raise RuntimeError('load_adapter needs an engine built for the adapter sync (model.lora_rank > 0, '
                               'model.lora_sync = "adapter")')
        if "weights" not in self._awake:
            raise RuntimeError("load_adapter needs the weights awake: call wake_up(['weights']) first")
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper
        from vllm.lora.request import LoRARequest

        from spmd_rl.model.lora import adapter_config

        # vLLM's WorkerLoRAManager: how its own loader builds a LoRAModel
        workers = vllm_sleep.engine_worker(self.llm).model_runner.lora_manager
        # the modules its LoRA layers wrap: engine_kwargs' lora_target_modules, the adapter's own
        helper = PEFTHelper.from_dict(adapter_config(self.lora, list(workers.lora_config.target_modules)))
        helper.validate_legal(workers.lora_config)
        mapper = getattr(workers._adapter_manager.model, "hf_to_vllm_mapper", None)
        self._adapter_id += 1
        adapter = LoRAModel.from_lora_tensors(
            self._adapter_id, tensors, helper, device=str(next(iter(tensors.values())).device),
            dtype=workers.lora_config.lora_dtype, model_vocab_size=workers.vocab_size,
            weights_mapper=mapper.get_unstacked_mapper() if mapper is not None else None)
        workers.remove_all_adapters()
        workers._adapter_manager.add_adapter(adapter)
        workers._adapter_manager.activate_adapter(adapter.id)
        self._lora_request = LoRARequest(f"spmd_rl-{self._adapter_id}", self._adapter_id, "spmd_rl:in-memory")
        self._prefix_cache_stale = True  # blocks computed with the old adapter must not be reused
        if "kv_cache" in self._awake:
            self._reset_prefix_cache()

    # ------------------------------------------------------------------ generation
    def _check_ready(self) -> None:
        if set(TAGS) - self._awake:
            raise RuntimeError(f"engine is asleep ({sorted(set(TAGS) - self._awake)}): call wake_up first")
        if self.lora is not None and self._lora_request is None:
            raise RuntimeError("the engine was built for the adapter sync but holds no adapter: load_adapter first")
        if not self._weights_valid:
            raise RuntimeError("the engine holds no valid weights (dummy start-up weights, or a level-2 sleep "
                               "discarded them): wake_up(['weights']) and load_weights before generating")
        if self._prefix_cache_stale:
            self._reset_prefix_cache()

    def _gather(self, payload):
        """Payloads of every rank of this TP group, in rank order ([payload] when tp == 1)."""
        if self._group is None:
            return [payload]
        out = [None] * self.tp
        dist.all_gather_object(out, payload, group=self._group)
        return out

    def _group_requests(self, prompts: list[list[int]], sampling: SamplingParams, max_new_tokens: list[int] | None,
                        asks_logprobs: list[bool] | None) -> tuple[list[list[int]], list[Any], list[bool], int]:
        """The TP group's requests (collective within the group: every rank passes its own prompts and
        the same sampling settings): every rank's prompts in rank order, their vLLM SamplingParams, whether
        each asks for log-probs, and where this rank's prompts start among them."""
        self._check_ready()
        limits, asks = sampling.per_prompt(len(prompts), max_new_tokens, asks_logprobs)
        parts = self._gather(([list(map(int, p)) for p in prompts], _sampling_key(sampling), limits, asks))
        for i, (_, key, _, _) in enumerate(parts):
            if key[:-1] != parts[0][1][:-1]:
                raise ValueError(f"ranks {self.replica * self.tp} and {self.replica * self.tp + i} of one "
                                 f"tensor-parallel group passed different sampling settings: {parts[0][1]} vs {key}")
        seed = parts[0][1][-1]  # the group's first rank decides the seed
        all_prompts = [p for ps, _, _, _ in parts for p in ps]
        all_limits = [k for _, _, ks, _ in parts for k in ks]
        all_asks = [a for _, _, _, ask in parts for a in ask]
        # An explicit seed per request, from (engine seed, call seed, position in the group's batch):
        # the same on every rank of the group, different across replicas, and not drawn from numpy's
        # global RNG (vLLM's default), which ranks of a group could consume differently. vLLM 0.26's
        # V2 model runner (the default for dense models) turns it into a counter-based Gumbel seed per
        # (request, position): no per-request cost; n > 1 children get seed + index.
        sps = [to_vllm_sampling(dataclasses.replace(sampling, max_new_tokens=limit), self.stop_ids, ask,
                                self.flat_logprobs, seed=_mix_seed(self.engine_seed, seed, j) % 2**62)
               for j, (limit, ask) in enumerate(zip(all_limits, all_asks))]
        return all_prompts, sps, all_asks, sum(len(ps) for ps, _, _, _ in parts[: self.tp_rank])

    def generate(self, prompts: list[list[int]], sampling: SamplingParams, max_new_tokens: list[int] | None = None,
                 asks_logprobs: list[bool] | None = None) -> list[list[Completion]]:
        """`sampling.n` completions per prompt. Collective within the TP group: every rank calls it
        (with its own, possibly empty, prompt list) and the same sampling settings.
        `max_new_tokens`: a limit per prompt instead of sampling.max_new_tokens; `asks_logprobs`:
        per prompt, whether it gets log-probs, instead of sampling.asks_logprobs (each rank's own)."""
        all_prompts, sps, asks, start = self._group_requests(prompts, sampling, max_new_tokens, asks_logprobs)
        results: list[list[Completion]] = []
        if all_prompts:
            self._set_running_cap(all_prompts, sps)
            with paused_gc(self.pause_gc):
                outs = self.llm.generate([{"prompt_token_ids": p} for p in all_prompts], sps,
                                         use_tqdm=self.tail.progress_bar(), **adapter_kwargs(self._lora_request))
                self.tail.done()
                if self.running_cap is not None:
                    self.running_cap.finished([len(c.token_ids) for o in outs for c in o.outputs])
                for o, ask in zip(outs, asks):
                    comps = [completion(c, ask, self.num_experts) for c in sorted(o.outputs, key=lambda c: c.index)]
                    if sampling.greedy and sampling.n > 1:
                        comps = [comps[0].copy() for _ in range(sampling.n)]
                    results.append(comps)
        return results[start : start + len(prompts)]

    def start(self, prompts: list[list[int]], sampling: SamplingParams, max_new_tokens: list[int] | None = None,
              asks_logprobs: list[bool] | None = None) -> StreamedRun:
        """The requests of `generate` (one completion each: sampling.n must be 1), added to the engine
        without running them: the caller advances the run and stops it (spmd_rl/rollout/vllm/streamed.py;
        partial rollouts). Collective within the TP group like generate."""
        token_inputs, sps, asks, mine = self._streamed_requests(prompts, sampling, max_new_tokens, asks_logprobs)
        self._runs += 1
        self._set_running_cap([p["prompt_token_ids"] for p in token_inputs], sps)
        return StreamedRun(self.llm.llm_engine, token_inputs, sps, asks, mine, f"run{self._runs}-", self._lora_request,
                           self.num_experts, self.pause_gc,
                           on_stop=None if self.running_cap is None else self.running_cap.finished,
                           group=self._streamed_requests)

    def _streamed_requests(self, prompts: list[list[int]], sampling: SamplingParams,
                           max_new_tokens: list[int] | None, asks_logprobs: list[bool] | None) -> tuple:
        """The TP group's requests of a streamed run (its start or an add; collective within the group):
        vLLM token inputs, SamplingParams asking for DELTA outputs, whether each asks for log-probs, and
        this rank's among them."""
        if sampling.n != 1:
            raise ValueError(f"a streamed run takes one completion per prompt, got n = {sampling.n}")
        from vllm.inputs import tokens_input
        from vllm.sampling_params import RequestOutputKind

        all_prompts, sps, asks, start = self._group_requests(prompts, sampling, max_new_tokens, asks_logprobs)
        for sp in sps:
            sp.output_kind = RequestOutputKind.DELTA  # each output: the tokens new since the last
        return [tokens_input(p) for p in all_prompts], sps, asks, range(start, start + len(prompts))

    def _set_running_cap(self, all_prompts: list[list[int]], sps: list) -> None:
        """Before a call of the TP group's requests: how many vLLM runs at once ("auto": running_cap.py).
        Every request of a call has the same n, so the means over requests are those over samples."""
        if self.running_cap is not None:
            self.running_cap.before([len(p) for p in all_prompts], [sp.max_tokens for sp in sps])

    def scheduling_metrics(self) -> dict[str, float]:
        """Of the generate calls since the last read: rollout/engine_max_running and rollout/engine_preempted
        (running_cap.py; none where rollout.max_num_seqs was set by hand) and rollout/generate_tail_share
        (spmd_rl/rollout/finish_times.py)."""
        return {**({} if self.running_cap is None else self.running_cap.metrics()), **self.tail.metrics()}

    def prompt_logprobs(self, seqs: list[list[int]]) -> list[list[float]]:
        """Teacher-forced log p(seq[t] | seq[:t]), t >= 1, for this rank's sequences (collective
        within the TP group like generate). For checks of the synced weights."""
        self._check_ready()
        parts = self._gather([list(map(int, s)) for s in seqs])
        all_seqs = [s for ps in parts for s in ps]
        res = prompt_logprobs(self.llm, all_seqs, self._lora_request)
        start = sum(len(ps) for ps in parts[: self.tp_rank])
        return res[start : start + len(seqs)]

    def close(self) -> None:
        """Shut the engine down in-process (its memory and vLLM's process groups; torch's default
        group stays). Call before the process exits: a sleep-mode pool left to interpreter
        finalisation can abort the process (pytorch/pytorch#145168)."""
        if getattr(self, "llm", None) is not None:
            # Map the pool back first: freeing an allocation that sleep unmapped would unmap it twice.
            self.wake_up()
            shutdown_llm(self.llm)
            self.llm = None
            gc.collect()
            torch.cuda.empty_cache()
            self._expandable_restore()

    def engine_parameter_bytes(self) -> int:
        """Bytes of this rank's engine parameters (its TP shard, with vocab padding)."""
        return sum(p.numel() * p.element_size() for p in inner_model(self.llm).parameters())


def _sampling_key(s: SamplingParams) -> tuple:
    return (s.n, s.temperature, s.top_p, s.top_k, s.max_new_tokens, tuple(s.stop_token_ids), s.ignore_eos,
            s.logprobs_every, s.seed)
