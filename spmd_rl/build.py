"""Start-up: what a Trainer composes, built in the same order on every rank (the collectives inside,
a barrier after writing synthetic data and the models' sharded loading, meet in that order).

    choose_speed_settings(cfg, env)                  # "auto" settings: before anything reads them (entry point)
    checkpointer = Checkpointer(...); resume = resume_target(checkpointer, cfg.trainer.resume)
    plan = check_memory(cfg, env)                    # each GPU's predicted peak: logged, refused if over
    with clock("data"):
        data = build_data(cfg, env, reward_fn)       # tokenizer, prompts, sampler (synthetic files first)
    models = build_models(cfg, env, data.tokenizer, resume is not None, clock)   # actor, reference, critic, reward model
    with clock("engine"):
        rollout = build_engine(cfg, env, models.model_dir, models.model_key, data.tokenizer)
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from spmd_rl.batching import sequence_parallel
from spmd_rl.checkpoint.checkpointer import Checkpointer, CheckpointError
from spmd_rl.config.run_config import Config
from spmd_rl.data.prompts import PromptDataset, ShardedSampler
from spmd_rl.data.rewards import RewardFunction
from spmd_rl.model import routing
from spmd_rl.model.files import check_vocab, loading, model_vocab_size
from spmd_rl.model.loading import (
    ARCH_PRESETS,
    DTYPES,
    active_parameters,
    allocate_meta_model,
    build_sharded,
    count_parameters,
    load_causal_lm,
    load_reward_model,
    load_value_model,
    materialize_random_model,
    random_model_config,
    reward_pad_id,
)
from spmd_rl.model.lora import LoraSettings
from spmd_rl.model.reward_model import RewardModel
from spmd_rl.model.tokenizer import load_tokenizer
from spmd_rl.preflight import memory as preflight_memory
from spmd_rl.preflight import speed_settings
from spmd_rl.preflight.synthetic_data import synthetic_recipe
from spmd_rl.runtime.distributed import DistEnv, raise_together
from spmd_rl.runtime.memory_plan import MemoryPlan
from spmd_rl.telemetry.startup import StartupClock
from spmd_rl.train.optim import make_optimizer, make_scheduler

log = logging.getLogger("spmd_rl")


class Data(NamedTuple):
    tokenizer: Any
    train: PromptDataset
    val: PromptDataset | None  # None: no data.val_files
    sampler: ShardedSampler  # this rank's prompts of each step


class Models(NamedTuple):
    model_dir: str  # the policy's directory: model.path, or <run_dir>/init_model for random weights
    model_key: str  # the key that names it in errors: "model.path", or "" for <run_dir>/init_model (ours)
    actor: torch.nn.Module
    actor_opt: torch.optim.Optimizer
    actor_sched: Any
    active_params: tuple[int, int]  # the actor's parameters a token runs through (MFU's N), all and trained
    ref: torch.nn.Module | None  # with actor.use_kl_loss or algorithm.use_kl_in_reward, without LoRA
    critic: torch.nn.Module | None  # with algorithm.adv_estimator = "gae"
    critic_opt: torch.optim.Optimizer | None
    critic_sched: Any
    reward_model: RewardModel | None  # with reward_model.path


class Rollout(NamedTuple):
    engine: Any  # rollout.base's interface: HFEngine or VLLMEngine
    dtype: torch.dtype  # of the weights the engine is given
    replica: int  # which engine replica this rank serves (sampling seeds differ per replica)


def resume_target(checkpointer: Checkpointer, resume: str) -> str | None:
    """The checkpoint to resume (trainer.resume), verified now, loaded once the models exist."""
    if resume == "none" and checkpointer.has_checkpoints():
        raise CheckpointError(
            f"trainer.resume = 'none' but {checkpointer.root} already holds checkpoints; starting "
            "fresh would overwrite them. Use trainer.resume=auto to continue, or a new trainer.run_dir.")
    return checkpointer.find_resume(resume)


def choose_speed_settings(cfg: Config, env: DistEnv) -> str | None:
    """The speed settings set to "auto", chosen by the memory plan for the smallest GPU of the run
    (spmd_rl/preflight/speed_settings.py) and written into `cfg`; their start-up line (None: no key
    is "auto"). Collective; the entry point calls it before the resume check and anything else that
    reads these keys."""
    if not speed_settings.auto_keys(cfg):
        return None
    total = None
    if env.device.type == "cuda":
        smallest = torch.tensor([float(torch.cuda.mem_get_info(env.device)[1])], dtype=torch.float64, device=env.device)
        dist.all_reduce(smallest, op=dist.ReduceOp.MIN)
        total = smallest.item()
    choices = []
    raise_together(lambda: choices.append(speed_settings.resolve(cfg, env.world_size, total)))
    return choices[0].line()


def check_memory(cfg: Config, env: DistEnv) -> MemoryPlan | None:
    """Each GPU's predicted peak memory (spmd_rl/runtime/memory_plan.py), logged as one line on a
    GPU (a CPU run has no GPU memory to predict: no line); a run predicted not to fit stops here on
    every rank, before any model loads (trainer.memory_check). Collective. None:
    trainer.memory_check = "off", or a model shape the formula cannot read."""
    on_gpu = env.device.type == "cuda"
    total = torch.cuda.mem_get_info(env.device)[1] if on_gpu else None
    plans: list[MemoryPlan | None] = []
    raise_together(lambda: plans.append(preflight_memory.check_memory(cfg, env.world_size, total)))
    if plans[0] is not None:
        if on_gpu:
            log.info(plans[0].line())
        # one line per node, where pinned host memory is held (a GPU run's)
        if (env.device.type == "cuda" or cfg.rollout.engine == "vllm") and env.local_rank == 0:
            host = preflight_memory.host_memory_line(cfg, env.world_size, env.local_world_size,
                                                     preflight_memory.available_host_memory())
            if host is not None:
                (log.info if host[1] else log.warning)(host[0])
    return plans[0]


def build_data(cfg: Config, env: DistEnv, reward_fn: RewardFunction) -> Data:
    d, m = cfg.data, cfg.model
    tok_spec = m.tokenizer if m.tokenizer else ""
    tokenizer = load_tokenizer(tok_spec, m.path, cfg.rollout.chat_template)
    check_tokenizer_vocab(cfg, tokenizer)  # before anything is written into the run directory
    if d.synthetic_task:
        # rank 0 alone writes (the files the config check placed under the run directory); the
        # others wait at the barrier
        if env.is_main:
            from spmd_rl.data.synthetic import write_run_data

            written = write_run_data(cfg.run_dir, synthetic_recipe(cfg))
            log.info("%s synthetic %r data: %s", "wrote" if written else "reusing the run's", d.synthetic_task,
                     ", ".join(d.train_files + d.val_files))
        dist.barrier()
    tools = tool_schemas(cfg.rollout.tools)  # multi-turn: the prompts' chat template lists the tools
    train_data = PromptDataset(d.train_files, tokenizer, d.max_prompt_length, d.apply_chat_template, tools)
    if train_data.num_dropped:
        log.warning("dropped %d training prompts longer than data.max_prompt_length = %d",
                    train_data.num_dropped, d.max_prompt_length)
    val_data = (PromptDataset(d.val_files, tokenizer, d.max_prompt_length, d.apply_chat_template, tools)
                if d.val_files else None)
    sources = [r.data_source for r in train_data.records]
    if val_data is not None:
        sources += [r.data_source for r in val_data.records]
    reward_fn.check_data_sources(sources, cfg.rollout.environment)  # an unscorable one fails before models load
    sampler = ShardedSampler(len(train_data), d.train_batch_size, env.rank, env.world_size,
                             cfg.trainer.seed, d.shuffle)
    log.info("data: %d training prompts (%d steps per epoch), %d validation prompts",
             len(train_data), sampler.steps_per_epoch, len(val_data) if val_data else 0)
    return Data(tokenizer, train_data, val_data, sampler)


def tool_schemas(entries: list[dict]) -> list[dict] | None:
    """The JSON schemas of `rollout.tools` (None without tools)."""
    if not entries:
        return None
    from spmd_rl.rollout.multiturn.tools import load_tools

    return [t.schema for t in load_tools(entries)]


def check_tokenizer_vocab(cfg: Config, tokenizer) -> None:
    """The tokenizer's ids fit every model's embedding (else a device-side assert mid-run)."""
    m, c = cfg.model, cfg.critic
    if m.init == "random" and not m.path:
        models = {f"model.arch = {m.arch!r}": ARCH_PRESETS[m.arch]["vocab_size"]}
    else:
        models = {f"model.path = {m.path!r}": model_vocab_size(m.path, "model.path")}
    if cfg.use_critic and c.path:
        models[f"critic.path = {c.path!r}"] = model_vocab_size(c.path, "critic.path")
    source = f"model.tokenizer = {m.tokenizer!r}" if m.tokenizer else f"model.path = {m.path!r}"
    for model, vocab_size in models.items():
        check_vocab(len(tokenizer), source, vocab_size, model)


def policy_model_dir(cfg: Config, tokenizer, device: torch.device | str = "cpu") -> str:
    """model.path, or with random weights the directory rank 0 writes them to (<run_dir>/init_model),
    drawn on `device` (the rank's GPU: seconds, not minutes, for a 7B shape)."""
    m = cfg.model
    if m.init == "pretrained":
        return m.path
    config = random_model_config(m.arch, m.path, tokenizer)
    return materialize_random_model(os.path.join(cfg.run_dir, "init_model"), config, m.seed,
                                    DTYPES[m.dtype], tokenizer, device)


def build_models(cfg: Config, env: DistEnv, tokenizer, resume: bool, clock: StartupClock) -> Models:
    """Actor (+ optimizer, schedule), reference and critic, sharded. `resume`: the checkpoint fills
    the actor's and critic's weights, none are read here. Start-up phases model_build, reference_critic."""
    m, a, c = cfg.model, cfg.actor, cfg.critic
    clock.begin("model_build")
    model_dir = policy_model_dir(cfg, tokenizer, env.device)
    model_key = "model.path" if m.init == "pretrained" else ""  # "": <run_dir>/init_model, ours
    master, compute = DTYPES[m.dtype], DTYPES[m.compute_dtype]

    def sharded(load, from_checkpoint: bool, gradient_checkpointing: float = m.checkpointed_share()):
        model = build_sharded(load, env.mesh, compute, from_checkpoint, gradient_checkpointing, m.fsdp_forward_prefetch)
        if a.router_replay == "engine" or a.router_aux_loss_coef > 0:  # MoE: replay and router logits (no-op if dense)
            routing.install(model)
        return sequence_parallel.apply(model, env.sp)  # trainer.ulysses_size: each rank takes a slice of a row

    def policy_model(dtype, lora=None):
        return functools.partial(load_causal_lm, model_dir, dtype, m.attn_implementation, m.remove_padding,
                                 m.chunked_logprobs, model_key, fused_kernels=m.fused_kernels,
                                 fused_logprob_head=m.fused_logprob_head, lora=lora, share_prompts=m.share_prompts)

    if m.use_lora:  # the base frozen in the compute dtype, the adapter in the master dtype; the checkpoint
        # holds the adapter only, so the base is read from the model directory on a resume too
        lora = LoraSettings.of(m, master)
        actor = sharded(policy_model(compute, lora), False)
    else:
        actor = sharded(policy_model(master), resume)
    n_params = count_parameters(actor)
    actor_opt = make_optimizer(actor, a.lr, a.weight_decay, a.betas)
    actor_sched = make_scheduler(actor_opt, a.warmup_steps, cfg.trainer.total_steps, a.lr_schedule, a.min_lr_ratio)
    clock.begin("reference_critic")
    ref = None
    if cfg.use_reference and not m.use_lora:  # with LoRA: the actor with its adapter disabled (Trainer.reference)
        # frozen, never checkpointed: always from the model directory. Stored in the compute dtype
        # (forward numerics are the same as fp32 masters cast to it for every forward, at half or a
        # quarter of the memory). Frozen by use, not by flag: it is in no optimizer and runs only
        # under torch.no_grad (actor.per_token_outputs). Its parameters keep requires_grad, because
        # torch.compile guards on it: with the flag off, its layers would compile a graph of their
        # own instead of reusing the actor's no-grad one (a graph more per start and per restart).
        ref = sharded(policy_model(compute), False, gradient_checkpointing=False)
    critic = critic_opt = critic_sched = None
    if cfg.use_critic:
        critic_dir, critic_key = (c.path, "critic.path") if c.path else (model_dir, model_key)
        critic = sharded(functools.partial(load_value_model, critic_dir, master, m.attn_implementation,
                                           m.remove_padding, critic_key, fused_kernels=m.fused_kernels,
                                           share_prompts=m.share_prompts), resume)
        critic_opt = make_optimizer(critic, c.lr, c.weight_decay)
        critic_sched = make_scheduler(critic_opt, c.warmup_steps, cfg.trainer.total_steps)
    reward_model = build_reward_model(cfg, env)
    clock.end()
    active = (active_parameters(actor), active_parameters(actor, trained_only=True))
    log.info("models ready: actor %.1fM parameters%s%s%s%s%s, %s", n_params / 1e6,
             f" ({active[0] / 1e6:.1f}M active per token: a mixture of experts, whose MFU counts these)"
             if active[0] != n_params else "", lora_note(cfg, actor),
             ", reference" if ref is not None else "", ", critic" if critic is not None else "",
             f", reward model from {cfg.reward_model.path}" if reward_model is not None else "",
             (f"the base from {model_dir}, the adapter left for the checkpoint" if m.use_lora else
              "weights left for the checkpoint") if resume else f"from {model_dir}")
    if tiny_lora_problem(cfg):
        log.warning(tiny_lora_problem(cfg))
    return Models(model_dir, model_key, actor, actor_opt, actor_sched, active, ref, critic, critic_opt, critic_sched,
                  reward_model)


def build_reward_model(cfg: Config, env: DistEnv) -> RewardModel | None:
    """The reward model of `reward_model.path` with its own tokenizer (None without one): sharded as
    the reference model is, in the compute dtype, frozen (used only under torch.no_grad), never
    checkpointed."""
    rm, m = cfg.reward_model, cfg.model
    if not rm.enabled:
        return None
    from transformers import AutoTokenizer

    tok_dir, tok_key = (rm.tokenizer, "reward_model.tokenizer") if rm.tokenizer else (rm.path, "reward_model.path")
    with loading(tok_dir, tok_key, "the tokenizer", tokenizer=True):
        tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    check_vocab(len(tokenizer), f"{tok_key} = {tok_dir!r}", model_vocab_size(rm.path, "reward_model.path"),
                f"reward_model.path = {rm.path!r}")
    compute = DTYPES[m.compute_dtype]
    load = functools.partial(load_reward_model, rm.path, compute, reward_pad_id(rm.path, tokenizer, "reward_model.path"),
                             m.attn_implementation, "reward_model.path")
    model = build_sharded(load, env.mesh, compute, False)
    return RewardModel(model, tokenizer, env.device, rm.micro_batch_size_per_gpu, rm.max_token_len_per_gpu)


def lora_note(cfg: Config, actor: torch.nn.Module) -> str:
    """With LoRA: what is trained, where the reference comes from, and the learning-rate rule of thumb."""
    m = cfg.model
    if not m.use_lora:
        return ""
    trained = sum(p.numel() for p in actor.parameters() if p.requires_grad)
    reference = "; the reference is the actor with its adapter disabled" if cfg.use_reference else ""
    if m.adapter_sync:
        kept = ("on the GPU, awake between steps, rollout.stay_awake" if cfg.engine_stays_awake()
                else "on the GPU while it sleeps, rollout.weights_stay_on_gpu" if cfg.engine_keeps_weights()
                else f"in host memory while it sleeps, sleep level {cfg.engine_sleep_level()}")
        sync = (f"the engine gets the base once and keeps it ({kept}), then the adapter alone each step, applied "
                "by its LoRA layers "
                '(model.lora_sync = "adapter": small updates survive its bf16 weights)')
    else:
        sync = ('the engine gets W + (alpha/r) B A merged each step, in its dtype (model.lora_sync = "merged": no '
                "LoRA layers in generation, but an update below half a bf16 step of W is rounded away)")
    return (f" (LoRA rank {m.lora_rank}, alpha {m.lora_alpha:g}: {trained / 1e6:.2f}M trained, the base frozen"
            f"{reference}; {sync}; on a pretrained model LoRA usually wants ~10x full fine-tuning's learning "
            f"rate: actor.lr = {cfg.actor.lr:g} is used as set)")


def tiny_lora_problem(cfg: Config) -> str | None:
    """Why LoRA on the "tiny" random model cannot learn, and the setting that does (docs/lora.md)."""
    if not (cfg.model.use_lora and cfg.model.arch == "tiny"):
        return None
    return ('model.arch = "tiny" does not learn with LoRA: its frozen embeddings (the tied head) bound every logit '
            'to about +-1.3, so no adapter makes an answer more than a few percent likely; use '
            'model.arch = "tiny-lora" with actor.lr = 2e-3 (docs/lora.md)')


def build_engine(cfg: Config, env: DistEnv, model_dir: str, model_key: str, tokenizer) -> Rollout:
    """The rollout engine `rollout.engine` names, built without weights (every generate first syncs
    the actor's in)."""
    r = cfg.rollout
    device = env.device
    eos = tokenizer.eos_token_id
    dtype = torch.float32 if (r.engine == "hf" and device.type == "cpu") else DTYPES[r.dtype]
    if r.engine == "vllm":
        from spmd_rl.rollout.vllm.engine import VLLMEngine, use_cache_root

        use_cache_root(r.compile_cache_dir or os.path.join(cfg.run_dir, "compile_cache"))
        engine = VLLMEngine(cfg, model_dir, env.rank, env.world_size, env.local_rank, env.local_world_size)
        return Rollout(engine, dtype, env.rank // r.tensor_parallel_size)  # (built asleep)
    from spmd_rl.rollout.hf_engine import HFEngine

    # no weights read, as vLLM's dummy load: every generate first syncs the actor's weights in; with
    # the adapter sync, PEFT's LoRA layers (the adapter in the engine's dtype) as vLLM's are
    m = cfg.model
    lora = LoraSettings.of(m, dtype) if m.adapter_sync else None
    model = allocate_meta_model(load_causal_lm(model_dir, dtype, m.attn_implementation, key=model_key,
                                               weights=False, lora=lora), device)
    return Rollout(HFEngine(model, tokenizer.pad_token_id, [eos], device,
                            return_routes=cfg.actor.router_replay == "engine"), dtype, env.rank)
