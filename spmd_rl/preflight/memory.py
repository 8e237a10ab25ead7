"""The run's memory plan from its config, and what to say when it does not fit.

`plan_for(cfg, world_size, device_total)` turns the config into the plain numbers of
spmd_rl/runtime/memory_plan.py (the model's shape from its config.json or loading.ARCH_PRESETS, no
weights read; the roles; each GPU's tokens per micro-batch; the engine's share) and returns the
plan. `check_memory` refuses a plan that does not fit (trainer.memory_check), naming the fixes with
the peak each would give; `out_of_memory_message` is the one line an out-of-memory error of a step
becomes (spmd_rl/trainer.py). The trainer calls them before any model loads (build.check_memory).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from typing import TYPE_CHECKING

from spmd_rl.config.checks import AUTO
from spmd_rl.errors import UserError
from spmd_rl.runtime import memory_plan as mp

if TYPE_CHECKING:
    from spmd_rl.config.run_config import Config

log = logging.getLogger("spmd_rl")

LORA_FIX_RANK = 32
"""The LoRA rank the refusal proposes where the actor trains in full (a common choice; rank 1 already
matches full fine-tuning for GRPO at 8B: docs/lora.md)."""

PLAN_PHASE = {"wake": "generation", "weight_sync": "generation", "offload": "generation", "generate": "generation",
              "sleep": "generation", "reload": "generation", "old_logprob": "log-prob pass",
              "ref_logprob": "log-prob pass", "values": "log-prob pass", "update_actor": "actor update",
              "update_critic": "critic update"}
"""The plan's phase of each step phase the trainer times (PhaseTimer names), without offload (plan_phase)."""

WEIGHT_SYNC_STEP_PHASES = ("weight_sync", "offload", "reload")
"""With rollout.offload_train_states the plan has a "weight sync" phase, which covers these step
phases: the weights stream into the engine, and the state leaves and comes back, while the engine
holds its weights but no KV cache."""


GENERATION_PHASES = ("generation", "weight sync")
"""The plan's phases of the engine's turn (generation_phases); the others are training's."""


def plan_phase(step_phase: str, plan_phases) -> str:
    """The phase among `plan_phases` (names) whose prediction covers the trainer's `step_phase`
    ("" for a step phase no prediction covers)."""
    if step_phase in WEIGHT_SYNC_STEP_PHASES and "weight sync" in plan_phases:
        return "weight sync"
    return PLAN_PHASE.get(step_phase, "")


class MemoryPlanError(UserError):
    """The run is predicted not to fit its GPUs' memory (trainer.memory_check = "error")."""


class OutOfMemory(UserError):
    """A step ran out of GPU memory: one line naming the phase, the prediction and the fixes."""


# --------------------------------------------------------------------------- config -> numbers


def model_shape(cfg: Config, critic: bool = False) -> mp.ModelShape:
    """The policy's (or the critic's) shape: config.json of its directory, or the preset arch."""
    m, c = cfg.model, cfg.critic
    if critic and c.path:
        from spmd_rl.model.files import model_text_config

        return mp.shape_from_config(model_text_config(c.path, "critic.path"))
    if m.init == "random" and not m.path:
        from spmd_rl.model.loading import ARCH_PRESETS

        return mp.shape_from_config({"model_type": "qwen2", **ARCH_PRESETS[m.arch]})
    from spmd_rl.model.files import model_text_config

    return mp.shape_from_config(model_text_config(m.path, "model.path"))


def work_of(cfg: Config, role: str, world_size: int) -> mp.Work:
    """One GPU's micro-batches of `role` ("actor", also the reference's, or "critic") on `world_size` ranks."""
    mb, m, d = cfg.micro_batching(role), cfg.model, cfg.data
    sp = max(cfg.trainer.ulysses_size, 1)  # a group's micro-batch is split over its GPUs
    padded = mb.rows * (d.max_prompt_length + d.max_response_length)
    lora = m.use_lora and role == "actor"  # the base frozen in the compute dtype (roles_of): on one rank kept
    # out of FSDP2 (loading.frozen_kept_whole)
    return mp.Work(update_tokens=(mb.update_tokens or padded) // sp, forward_tokens=(mb.forward_tokens or padded) // sp,
                   compute_bytes=mp.DTYPE_BYTES[m.compute_dtype], checkpointed_share=m.checkpointed_share(),
                   chunked_logprobs=m.chunked_logprobs, head=m.fused_logprob_head,
                   base_trained=not lora, base_gathered=not (lora and world_size == 1))


def roles_of(cfg: Config, shape: mp.ModelShape, critic_shape: mp.ModelShape | None) -> list[mp.Role]:
    """Actor (with LoRA: its frozen base and its adapter), reference, critic and reward model as
    build.build_models makes them."""
    m = cfg.model
    master, compute = mp.DTYPE_BYTES[m.dtype], mp.DTYPE_BYTES[m.compute_dtype]
    if m.use_lora:  # the base frozen in the compute dtype, the adapter alone trained; the reference is
        # the actor with its adapter disabled (no second model)
        targets = tuple(t for t in m.lora_target_modules if t != "all-linear")
        roles = [mp.Role("actor", shape.lora_parameters(m.lora_rank, targets), master, True,
                         not cfg.actor.offload_optimizer),
                 mp.Role("actor's frozen base", shape.parameters(), compute, False)]
    else:
        roles = [mp.Role("actor", shape.parameters(), master, True, not cfg.actor.offload_optimizer)]
    if cfg.use_reference and not m.use_lora:
        roles.append(mp.Role("reference", shape.parameters(), compute, False))
    if critic_shape is not None:
        roles.append(mp.Role("critic", critic_shape.value_model_parameters(), master, True))
    if cfg.reward_model.path:  # frozen in the compute dtype, its one-label head the size of a value head
        from spmd_rl.model.files import model_text_config

        rm = mp.shape_from_config(model_text_config(cfg.reward_model.path, "reward_model.path"))
        roles.append(mp.Role("reward model", rm.value_model_parameters(), compute, False))
    return roles


def engine_of(cfg: Config, shape: mp.ModelShape) -> mp.Engine:
    r = cfg.rollout
    weights = shape.parameters() * mp.DTYPE_BYTES[r.dtype]
    if r.engine == "hf":
        return mp.Engine("hf", weight_bytes=weights)
    return mp.Engine("vllm", r.gpu_memory_utilization, not r.enforce_eager, weights / r.tensor_parallel_size,
                     r.weight_sync_bucket_mb * 2**20, cfg.engine_keeps_weights(), cfg.engine_stays_awake())


def engine_kv_token_bytes(cfg: Config, shape: mp.ModelShape) -> float:
    """One token's KV cache on one GPU of the engine (its tensor parallelism and dtype)."""
    r = cfg.rollout
    return mp.kv_bytes_per_token(shape, r.tensor_parallel_size, mp.DTYPE_BYTES[r.dtype])


def engine_share_kv_tokens(cfg: Config, shape: mp.ModelShape, device_total: float) -> int:
    """Tokens the engine's KV cache holds in rollout.gpu_memory_utilization's share of a device of
    `device_total` bytes (memory_plan.engine_kv_tokens)."""
    return mp.engine_kv_tokens(engine_of(cfg, shape), device_total, engine_kv_token_bytes(cfg, shape))


def engine_kv_cache_bytes(cfg: Config, world_size: int, device_total: float | None,
                          shape: mp.ModelShape | None = None) -> int:
    """The KV cache rollout.kv_cache_tokens gives each GPU of the engine, in bytes (vLLM's
    kv_cache_memory_bytes): Config.engine_kv_cache_tokens at one token's bytes (engine_kv_token_bytes).
    0 leaves the size to vLLM's share: the key's 0, or "auto" above what gpu_memory_utilization leaves on
    a device of `device_total` bytes (engine_share_kv_tokens; None: no cap)."""
    tokens = cfg.engine_kv_cache_tokens(world_size)
    if not tokens:
        return 0
    shape = shape or model_shape(cfg)
    if cfg.rollout.kv_cache_tokens == AUTO and device_total and tokens > engine_share_kv_tokens(cfg, shape, device_total):
        return 0
    return int(tokens * engine_kv_token_bytes(cfg, shape))


def plan_for(cfg: Config, world_size: int, device_total: float | None,
             shapes: tuple[mp.ModelShape, mp.ModelShape | None] | None = None) -> mp.MemoryPlan:
    """The memory plan of `cfg` on `world_size` ranks of GPUs of `device_total` bytes (None: no
    GPU). `shapes`: (policy, critic) when already read."""
    shape, critic_shape = shapes or (model_shape(cfg), model_shape(cfg, critic=True) if cfg.use_critic else None)
    models = {"actor": (shape, work_of(cfg, "actor", world_size))}
    if critic_shape is not None:
        models["critic"] = (critic_shape, work_of(cfg, "critic", world_size))
    shard = cfg.trainer.fsdp_size or world_size
    engine = engine_of(cfg, shape)
    if engine.kind == "vllm":  # its KV cache as rollout.kv_cache_tokens sets it (the run's ranks and device)
        engine = dataclasses.replace(engine, kv_bytes=engine_kv_cache_bytes(cfg, world_size, device_total, shape))
    return mp.plan_memory(roles_of(cfg, shape, critic_shape), shard, models, engine, device_total,
                          cfg.rollout.offload_train_states)


# --------------------------------------------------------------------------- fixes


def _changed(cfg: Config, **keys) -> Config:
    """A copy of `cfg` with `section__key=value` changes."""
    out = copy.deepcopy(cfg)
    for dotted, value in keys.items():
        section, key = dotted.split("__")
        setattr(getattr(out, section), key, value)
    return out


def _gib(x: float) -> str:
    return f"{x / mp.GiB:.1f} GiB"


def _peak(plan: mp.MemoryPlan) -> str:
    """"peak X GiB, fits" or "peak X GiB in <phase>: not enough alone"."""
    if plan.fits:
        return f"peak {_gib(plan.peak.total)}, fits"
    return f"peak {_gib(plan.peak.total)} in {plan.peak.name}: not enough alone"


def more_gpus_fix(cfg: Config, world_size: int, device_total: float, shapes) -> str:
    """The fewest GPUs (doubling, up to 8x) whose shards fit."""
    shard = cfg.trainer.fsdp_size or world_size
    for k in (2, 4, 8):
        bigger = _changed(cfg, trainer__fsdp_size=cfg.trainer.fsdp_size * k) if cfg.trainer.fsdp_size else cfg
        plan = plan_for(bigger, world_size * k, device_total, shapes)
        if plan.fits:
            where = (f"trainer.fsdp_size = {shard * k}" if cfg.trainer.fsdp_size else f"{world_size * k} GPUs")
            return f"shard over more GPUs ({where}: {_peak(plan)})"
    return f"shard over more GPUs (even {shard * 8} do not fit)"


def generation_fixes(cfg: Config, plan: mp.MemoryPlan, world_size: int, shapes) -> list[str]:
    r, total = cfg.rollout, plan.device_total
    fixes = []
    if not r.offload_train_states:
        off = plan_for(_changed(cfg, rollout__offload_train_states=True), world_size, total, shapes)
        fixes.append(f"rollout.offload_train_states = true ({_peak(off)})")
    share = mp.largest_fitting_share(plan)
    engine = engine_of(cfg, shapes[0])
    if engine.kind == "vllm" and share * total > engine.weight_bytes + mp.GiB and share < r.gpu_memory_utilization:
        lower = plan_for(_changed(cfg, rollout__gpu_memory_utilization=share), world_size, total, shapes)
        fixes.append(f"rollout.gpu_memory_utilization = {share:.2f} or lower (a smaller KV cache; {_peak(lower)})")
    return fixes


def update_fixes(cfg: Config, plan: mp.MemoryPlan, world_size: int, shapes) -> list[str]:
    m, a, total = cfg.model, cfg.actor, plan.device_total
    fixes = []
    if m.checkpointed_share() < 1.0:
        on = plan_for(_changed(cfg, model__gradient_checkpointing=True, model__gradient_checkpointing_layers=1.0),
                      world_size, total, shapes)
        fixes.append(f"model.gradient_checkpointing = true ({_peak(on)})")
    if a.max_token_len_per_gpu > cfg.data.max_prompt_length + cfg.data.max_response_length:
        half = max(a.max_token_len_per_gpu // 2, cfg.data.max_prompt_length + cfg.data.max_response_length)
        smaller = plan_for(_changed(cfg, actor__max_token_len_per_gpu=half), world_size, total, shapes)
        fixes.append(f"actor.max_token_len_per_gpu = {half} ({_peak(smaller)})")
    if not a.offload_optimizer:
        off = plan_for(_changed(cfg, actor__offload_optimizer=True), world_size, total, shapes)
        fixes.append(f"actor.offload_optimizer = true ({_peak(off)})")
    if cfg.engine_stays_awake():
        asleep = plan_for(_changed(cfg, rollout__stay_awake=False), world_size, total, shapes)
        fixes.append(f"rollout.stay_awake = false ({_peak(asleep)})")
    if cfg.engine_keeps_weights():
        host = plan_for(_changed(cfg, rollout__weights_stay_on_gpu=False, rollout__stay_awake=False), world_size,
                        total, shapes)
        fixes.append(f"rollout.weights_stay_on_gpu = false ({_peak(host)})")
    return fixes


def fixes_for(cfg: Config, plan: mp.MemoryPlan, world_size: int, shapes) -> list[str]:
    """What would bring each phase over the device down, each with the peak it predicts."""
    over = {p.name for p in plan.phases if p.total > plan.device_total}
    fixes = []
    if over & set(GENERATION_PHASES):
        fixes += generation_fixes(cfg, plan, world_size, shapes)
    if over - set(GENERATION_PHASES):
        fixes += update_fixes(cfg, plan, world_size, shapes)
    return fixes + [more_gpus_fix(cfg, world_size, plan.device_total, shapes)] + lora_fix(cfg, plan, world_size, shapes)


def lora_fix(cfg: Config, plan: mp.MemoryPlan, world_size: int, shapes) -> list[str]:
    """LoRA on an actor that trains in full: the base frozen in the compute dtype, no reference copy."""
    if cfg.model.use_lora:
        return []
    lora = plan_for(_changed(cfg, model__lora_rank=LORA_FIX_RANK), world_size, plan.device_total, shapes)
    return [f"LoRA, model.lora_rank = {LORA_FIX_RANK} (only the adapter trained; {_peak(lora)})"]


# --------------------------------------------------------------------------- the check


def refusal(cfg: Config, plan: mp.MemoryPlan, world_size: int, shapes) -> str:
    fixes = fixes_for(cfg, plan, world_size, shapes)
    phases = "; ".join(p.describe() for p in plan.phases)
    return (f"memory: predicted peak per GPU {_gib(plan.peak.total)} in {plan.peak.name} exceeds the GPU's "
            f"{_gib(plan.device_total)} on {world_size} GPU(s) ({phases}). Fixes: {'; '.join(fixes)}. "
            'trainer.memory_check = "warn" runs anyway (the prediction is within about 10% of measured peaks)')


def check_memory(cfg: Config, world_size: int, device_total: float | None) -> mp.MemoryPlan | None:
    """The run's plan, refused (MemoryPlanError) or warned about when its peak exceeds
    `device_total` (trainer.memory_check); None when the model's shape cannot be read from its
    config (logged) or the check is off."""
    mode = cfg.trainer.memory_check
    if mode == "off":
        return None
    try:
        shapes = (model_shape(cfg), model_shape(cfg, critic=True) if cfg.use_critic else None)
    except (KeyError, TypeError, ValueError) as e:
        log.warning("memory: not predicted: the model's config.json does not fit the dense-decoder formula (%s: %s); "
                    'trainer.memory_check = "off" leaves this line out', type(e).__name__, e)
        return None
    plan = plan_for(cfg, world_size, device_total, shapes)
    if not plan.fits:
        message = refusal(cfg, plan, world_size, shapes)
        if mode == "error":
            raise MemoryPlanError(message)
        log.warning(message)
    return plan


def host_memory_parts(cfg: Config, world_size: int) -> dict[str, tuple[float, str]]:
    """What one rank keeps in (pinned) host memory for the whole run, by what holds it: (bytes, the
    switch that frees it). vLLM's weights while it sleeps at level 1 (LoRA's adapter sync, unless they stay
    on the GPU: rollout.weights_stay_on_gpu), the
    training state offloaded while the engine generates (rollout.offload_train_states:
    spmd_rl/train/offload.py's buffers), AdamW's moments kept there (actor.offload_optimizer), and an
    asynchronous checkpoint's staging buffers (trainer.async_save: the trained models' parameters and
    moments)."""
    shape = model_shape(cfg)
    critic = model_shape(cfg, critic=True) if cfg.use_critic else None
    roles, shard = roles_of(cfg, shape, critic), cfg.trainer.fsdp_size or world_size
    parts = {}
    if cfg.rollout.engine == "vllm" and cfg.engine_sleep_level() == 1 and not cfg.engine_keeps_weights():
        parts["vLLM weights asleep (sleep level 1)"] = (
            engine_of(cfg, shape).weight_bytes,
            'model.lora_sync = "merged" (sleep level 2)' if cfg.model.adapter_sync else "rollout.sleep_level = 2")
    if cfg.rollout.offload_train_states:
        parts["offloaded training state"] = (sum(mp.resident_state_bytes(roles, shard).values()),
                                             "rollout.offload_train_states = false")
    if cfg.actor.offload_optimizer:
        parts["actor's AdamW moments (actor.offload_optimizer)"] = (
            sum(r.optimizer_bytes(shard) for r in roles if r.trained and not r.optimizer_on_gpu),
            "actor.offload_optimizer = false")
    if cfg.trainer.async_save and cfg.trainer.save_every != -1:
        parts["checkpoint staging (trainer.async_save)"] = (
            sum(r.param_bytes(shard) + r.optimizer_bytes(shard) for r in roles if r.trained), "trainer.async_save = false")
    return {name: part for name, part in parts.items() if part[0] > 0}


def host_memory_line(cfg: Config, world_size: int, local_ranks: int,
                     available: float | None) -> tuple[str, bool] | None:
    """The node's host memory held for the run (`host_memory_parts` x its ranks): (the line, whether it
    fits `available` bytes with a fifth spare; True when unknown). None when nothing is held there."""
    parts = host_memory_parts(cfg, world_size)
    if not parts:
        return None
    per_rank = sum(b for b, _ in parts.values())
    node = per_rank * local_ranks
    fits = available is None or node <= 0.8 * available
    room = "" if available is None else f" of the {_gib(available)} available"
    held = ", ".join(f"{name} {_gib(b)}" for name, (b, _) in parts.items())
    fixes = "; ".join(fix for _, fix in parts.values())
    return (f"host memory: {_gib(per_rank)} per rank held for the run ({held}), {_gib(node)} for this node's "
            f"{local_ranks} rank(s){room}" + ("" if fits else f"; too close to what the node has: {fixes}"), fits)


def available_host_memory() -> float | None:
    """MemAvailable of /proc/meminfo in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def out_of_memory_message(step_phase: str, plan: mp.MemoryPlan | None, error: BaseException) -> str:
    """One line for an out-of-memory error in the trainer's `step_phase` (a PhaseTimer name)."""
    first = next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)
    first = first[:200] + ("..." if len(first) > 200 else "")
    names = [] if plan is None else [p.name for p in plan.phases]
    name = plan_phase(step_phase, names)
    predicted = ""
    if plan is not None:
        phase = next((p for p in plan.phases if p.name == name), plan.peak)
        of = f" of the GPU's {_gib(plan.device_total)}" if plan.device_total else ""
        predicted = f"; predicted {phase.describe()} GiB{of}"
    offloaded = "weight sync" in names  # the plan's sign of rollout.offload_train_states
    if name == "weight sync":  # the training state beside the engine's weights
        fix = "set actor.offload_optimizer = true, use LoRA (model.lora_rank), or shard over more GPUs"
    elif name == "generation":
        fix = (("" if offloaded else "set rollout.offload_train_states = true, ")
               + "lower rollout.gpu_memory_utilization, or shard over more GPUs")
    elif name == "log-prob pass":
        fix = "lower actor.logprob_max_token_len_per_gpu (critic.forward_max_token_len_per_gpu), or shard over more GPUs"
    else:
        fix = ("lower actor.max_token_len_per_gpu (critic.max_token_len_per_gpu), set model.gradient_checkpointing = "
               "true or actor.offload_optimizer = true, or shard over more GPUs")
    return f"out of GPU memory in the step's {step_phase} phase ({first}){predicted}: {fix}"
