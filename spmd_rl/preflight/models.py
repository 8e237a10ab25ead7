"""The models the config names, checked against what exists (called by preflight.validate): the
preset architecture, PEFT and vLLM's largest LoRA rank, the model and tokenizer directories on disk
(no weights are read; the reward model's head too), the chat template file, packed attention, the
LoRA target names against the model's decoder, and the attention heads against trainer.ulysses_size."""

from __future__ import annotations

from typing import TYPE_CHECKING

from spmd_rl.config.checks import need
from spmd_rl.errors import ConfigError

if TYPE_CHECKING:
    from spmd_rl.config.run_config import Config


def check_arch(cfg: Config) -> None:
    """With model.init = "random" and no model.path, model.arch is a preset of model.loading."""
    m = cfg.model
    if m.init == "random" and not m.path:
        from spmd_rl.model.loading import ARCH_PRESETS

        need(m.arch in ARCH_PRESETS, f"model.arch = {m.arch!r} is not a preset: use one of {', '.join(ARCH_PRESETS)}")


def check_lora_support(cfg: Config) -> None:
    """With LoRA: PEFT is installed, and vLLM's LoRA layers take the rank (model.lora_sync = "adapter")."""
    m = cfg.model
    if not m.use_lora:
        return
    from spmd_rl.model.lora import VLLM_MAX_LORA_RANK, peft_problem

    problem = peft_problem()
    need(problem is None, f"model.lora_rank = {m.lora_rank} needs PEFT: {problem}; pip install -e '.[lora]' "
          "(peft==0.21.*), or set model.lora_rank = 0")
    need(m.lora_sync != "adapter" or m.lora_rank <= VLLM_MAX_LORA_RANK,
          f"model.lora_rank = {m.lora_rank} is above the largest rank vLLM's LoRA layers take "
          f"({VLLM_MAX_LORA_RANK}) for model.lora_sync = \"adapter\": use a rank <= {VLLM_MAX_LORA_RANK}, "
          "or model.lora_sync = \"merged\"")


def check_model_files(cfg: Config) -> None:
    """Every model directory the config names, as far as small files tell (no weights are read)."""
    from spmd_rl.model.files import check_model_dir, check_tokenizer_dir

    m = cfg.model
    if m.path:
        check_model_dir(m.path, "model.path", weights=m.init == "pretrained")
    if m.tokenizer and m.tokenizer != "char":
        check_tokenizer_dir(m.tokenizer, "model.tokenizer")
    elif not m.tokenizer and m.path:
        check_tokenizer_dir(m.path, "model.path")
    if cfg.use_critic and cfg.critic.path:
        check_model_dir(cfg.critic.path, "critic.path", weights=True)


def check_reward_model_files(cfg: Config) -> None:
    """reward_model.path is a one-label sequence classifier, and its tokenizer has files."""
    rm = cfg.reward_model
    if not rm.enabled:
        return
    from spmd_rl.model.files import check_reward_model_dir, check_tokenizer_dir

    check_reward_model_dir(rm.path, "reward_model.path")
    if rm.tokenizer:
        check_tokenizer_dir(rm.tokenizer, "reward_model.tokenizer", "reward_model.tokenizer")
    else:
        check_tokenizer_dir(rm.path, "reward_model.path", "reward_model.tokenizer")


def check_chat_template(cfg: Config) -> None:
    """The file rollout.chat_template names can be read."""
    if cfg.rollout.chat_template:
        from spmd_rl.model.tokenizer import read_chat_template

        read_chat_template(cfg.rollout.chat_template)


def check_packed_attention(cfg: Config) -> None:
    """With model.remove_padding, every trained model's attention is one packed attention does right
    (spmd_rl.model.varlen_attention.unsupported: sliding windows where the kernel takes none,
    soft-capping)."""
    m = cfg.model
    if not m.remove_padding:
        return
    from transformers import AutoConfig

    from spmd_rl.model.loading import check_packable, preset_config

    models = {}
    if m.path:
        models[f"model.path = {m.path!r}"] = AutoConfig.from_pretrained(m.path)
    elif m.arch:
        models[f"model.arch = {m.arch!r}"] = preset_config(m.arch)
    if cfg.use_critic and cfg.critic.path:
        models[f"critic.path = {cfg.critic.path!r}"] = AutoConfig.from_pretrained(cfg.critic.path)
    for key, config in models.items():
        check_packable(config, key)


def check_attention_heads(cfg: Config, world_size: int) -> None:
    """With trainer.ulysses_size > 1, every trained model's attention heads split over the group."""
    sp, m = cfg.trainer.ulysses_size, cfg.model
    if sp <= 1:
        return
    divisors = [k for k in range(1, world_size + 1) if world_size % k == 0]
    from spmd_rl.model.files import model_attention_heads
    from spmd_rl.runtime.sp_groups import head_problem

    models = {}
    if m.init == "random" and not m.path:
        from spmd_rl.model.loading import ARCH_PRESETS

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


def check_lora_targets(cfg: Config) -> None:
    """model.lora_target_modules name linear layers of the model's decoder (the model is built on
    the meta device from its config: nothing is read but config.json)."""
    m = cfg.model
    from spmd_rl.model.lora import peft_targets

    if not m.use_lora or peft_targets(m.lora_target_modules) == "all-linear":
        return
    import torch
    from transformers import AutoModelForCausalLM

    from spmd_rl.model.loading import random_model_config
    from spmd_rl.model.lora import decoder_linear_names, is_mixture

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(random_model_config(m.arch, m.path))
    names = decoder_linear_names(model)
    if is_mixture(model):  # PEFT would adapt the fused experts for an MLP name: the attention's only
        mlp = [t for t in m.lora_target_modules if any(n.startswith("mlp.") and (n == t or n.endswith("." + t))
                                                       for n in names)]
        if mlp:
            raise ConfigError(f"model.lora_target_modules names {', '.join(map(repr, mlp))}: on a mixture of experts "
                              "PEFT maps an MLP name to the fused experts, which LoRA does not adapt here; name the "
                              "attention's layers (or [] for all of them: docs/moe.md)")
    unknown = [t for t in m.lora_target_modules if not any(n == t or n.endswith("." + t) for n in names)]
    if unknown:
        which = f"model.path = {m.path!r}" if m.path else f"model.arch = {m.arch!r}"
        have = sorted({n.rsplit(".", 1)[-1] for n in names})
        experts = sorted({n.split(".experts.", 1)[1] for n, _ in model.named_parameters() if ".experts." in n})
        fused = [t for t in unknown if t in experts or t == "experts"]
        why = (f" ({', '.join(fused)}: the mixture of experts' fused expert weights, which LoRA does not adapt here: "
               "docs/moe.md)") if fused else ""
        raise ConfigError(f"model.lora_target_modules names {', '.join(map(repr, unknown))}, not a linear layer of the "
                          f"decoder of {which}{why}: it has {', '.join(have)} (or [] for all of them)")


LATENT_ATTENTION_FOLDED = "kv_b_proj"
"""The linear layer vLLM's multi-head latent attention (GLM-4.7-Flash, DeepSeek: a config with
kv_lora_rank) folds into matrices computed after loading (spmd_rl/rollout/vllm/engine.py,
refresh_derived_weights): its decode never runs the layer, so an adapter on it would not act there."""


def check_lora_in_latent_attention(cfg: Config) -> None:
    """An adapter synced to vLLM as an adapter (model.lora_sync = "adapter") adapts no layer vLLM's latent
    attention folds (LATENT_ATTENTION_FOLDED): the engine would sample without that part of the adapter,
    unnoticed but for the mismatch. The merged sync serves it (the engine folds W + BA)."""
    m = cfg.model
    if not cfg.vllm_applies_adapter():
        return
    from spmd_rl.model.loading import random_model_config

    config = random_model_config(m.arch, m.path)
    if not getattr(config.get_text_config(), "kv_lora_rank", None):
        return
    import torch
    from transformers import AutoModelForCausalLM

    from spmd_rl.model.lora import adapted_modules, peft_targets

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    adapted = adapted_modules(m.lora_target_modules, model)
    kept = [t for t in adapted if t.rsplit(".", 1)[-1] != LATENT_ATTENTION_FOLDED]
    if len(kept) < len(adapted):
        every = " ([]: every attention layer)" if peft_targets(m.lora_target_modules) == "all-linear" else ""
        raise ConfigError(f"model.lora_target_modules adapts {LATENT_ATTENTION_FOLDED}{every}, which vLLM's latent "
                          "attention folds into matrices computed after loading: its LoRA layers do not adapt them, "
                          "so the engine would sample without that part of the adapter. Adapt the others "
                          f"(model.lora_target_modules = {kept}), or set model.lora_sync = \"merged\" (docs/moe.md)")


def check_router_aux_loss(cfg: Config) -> None:
    """actor.router_aux_loss_coef > 0 needs a mixture of experts with softmax routers: a dense model has no
    router to balance, and a sigmoid router with a correction bias (routing.scores_by_sigmoid: the model is
    built on the meta device) is balanced by the bias."""
    m = cfg.model
    if cfg.actor.router_aux_loss_coef <= 0 or not (m.path or m.arch):
        return
    import torch
    from transformers import AutoModelForCausalLM

    from spmd_rl.model import routing
    from spmd_rl.model.loading import random_model_config

    config = random_model_config(m.arch, m.path)
    which = f"model.path = {m.path!r}" if m.path else f"model.arch = {m.arch!r}"
    if not any(getattr(config, k, 0) for k in ("num_experts", "num_local_experts")):
        raise ConfigError(f"actor.router_aux_loss_coef = {cfg.actor.router_aux_loss_coef} balances a mixture of "
                          f"experts' routers, and {which} is a dense model: set it to 0")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    if any(routing.scores_by_sigmoid(router) for _, router in routing.routers(model)):
        raise ConfigError(f"actor.router_aux_loss_coef = {cfg.actor.router_aux_loss_coef} is the load-balancing loss of "
                          f"softmax routers, and {which} ({config.model_type}) scores its experts by sigmoid and "
                          "balances them with its score correction bias: set it to 0")
