"""Loading the actor, critic, reference and reward models, and wrapping them with FSDP2.

Weights come from a local directory (`from_pretrained`). Random weights (`model.init = "random"`)
are made once by rank 0 with plain eager construction and saved as a regular checkpoint
(`materialize_random_model`); every rank then loads that directory like any pretrained model.

Under FSDP no rank holds a full copy it does not need (`build_sharded`): a rank builds the model
on the meta device from its config, shards it, gives the shards storage (`allocate_meta_model`),
then the shards are filled by a checkpoint load (DCP, on resume) or by rank 0's `from_pretrained`
weights, broadcast. Meta construction can break two things; both
are handled and tested against `from_pretrained` (tests/model/test_sharded_init.py): tied embeddings
stay one Parameter through `fully_shard` and `to_empty`, and non-persistent buffers (rotary
`inv_freq`), which no state dict holds, are computed again by transformers' own init.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    Qwen2Config,
)

from spmd_rl.errors import ConfigError
from spmd_rl.model import fused_kernels, logprob_head, varlen_attention
from spmd_rl.model.files import check_no_missing_weights, loading
from spmd_rl.model.lora import LoraSettings, add_adapter
from spmd_rl.model.routing import checkpoint_contexts

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Shapes of real models (random weights: no hub here), plus tiny ones for CPU. Without `model_type`: Qwen2.
ARCH_PRESETS: dict[str, dict] = {
    "tiny": dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                 max_position_embeddings=512),
    # "tiny" for LoRA: LoRA trains only the decoder's linear layers, and at "tiny"'s initializer range
    # (0.02) the frozen tied embeddings bound every logit to about +-1.3, so no adapter can make an
    # answer more than a few percent likely; at 0.1 an adapter alone learns the default job
    # (docs/lora.md)
    "tiny-lora": dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                      max_position_embeddings=512, initializer_range=0.1),
    # the GPU learning check's model (tests/gpu/test_learning_gpu.py): learns the successor task in a
    # few dozen steps; head_dim 64, as FlashAttention 3 (vLLM on Hopper) takes
    "small": dict(vocab_size=64, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                  max_position_embeddings=512),
    "qwen2-0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                       num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
                       max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6),
    "qwen2-1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                       num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True,
                       max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6),
    "qwen2-7b": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                     num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False,
                     max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6),
    # Other families: the values of each model's public config.json (Qwen/Qwen3-0.6B, Qwen/Qwen3-8B,
    # meta-llama/Llama-3.1-8B, meta-llama/Llama-3.2-1B, google/gemma-3-1b-pt), written from memory (no hub
    # here): sizes, heads, head_dim, rope theta and scaling, norm eps, tying, Gemma 3's window and
    # query_pre_attn_scalar. `model_type` picks the config class (random_model_config).
    "qwen3-0.6b": dict(model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       tie_word_embeddings=True, max_position_embeddings=40960, rope_theta=1000000.0,
                       rms_norm_eps=1e-6),
    "qwen3-8b": dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     tie_word_embeddings=False, max_position_embeddings=40960, rope_theta=1000000.0,
                     rms_norm_eps=1e-6),
    "llama3.1-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                        tie_word_embeddings=False, max_position_embeddings=131072, rope_theta=500000.0,
                        rms_norm_eps=1e-5, rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                             high_freq_factor=4.0,
                                                             original_max_position_embeddings=8192)),
    "llama3.2-1b": dict(model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                        tie_word_embeddings=True, max_position_embeddings=131072, rope_theta=500000.0,
                        rms_norm_eps=1e-5, rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                                                             high_freq_factor=4.0,
                                                             original_max_position_embeddings=8192)),
    "gemma3-1b": dict(model_type="gemma3_text", vocab_size=262144, hidden_size=1152, intermediate_size=6912,
                      num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                      tie_word_embeddings=True, max_position_embeddings=32768, query_pre_attn_scalar=256,
                      sliding_window=512, sliding_window_pattern=6, rope_theta=1000000.0,
                      rope_local_base_freq=10000.0, rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh"),
    # Mixture of experts (docs/moe.md). "qwen3-moe-tiny": the CPU default job's size with 8 experts, top-2,
    # in every layer. "qwen3-30b-a3b": Qwen/Qwen3-30B-A3B's config.json (48 layers, 128 experts, top-8).
    "qwen3-moe-tiny": dict(model_type="qwen3_moe", vocab_size=64, hidden_size=64, intermediate_size=128,
                           moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           tie_word_embeddings=True, max_position_embeddings=512),
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                          moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                          num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          tie_word_embeddings=False, max_position_embeddings=40960, rope_theta=1000000.0,
                          rms_norm_eps=1e-6),
    # GLM-4.7-Flash's family (glm4_moe_lite: multi-head latent attention, a sigmoid router with a score
    # correction bias, a shared expert, a dense first layer) at the CPU default job's size
    "glm4-moe-lite-tiny": dict(model_type="glm4_moe_lite", vocab_size=64, hidden_size=64, intermediate_size=128,
                               moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                               first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=1.8, norm_topk_prob=True,
                               kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                               num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=2,
                               tie_word_embeddings=True, max_position_embeddings=512),
    # GLM-4.7-Flash's config.json values (transformers' Glm4MoeLiteConfig defaults) with its 47 layers cut to 4
    # (the first dense): its latent attention, 64 experts, top-4 and shared expert for tests/gpu/test_moe_gpu.py.
    # first_k_dense_replace: the dense layers before the first mixture, as GLM's config.json says it; vLLM's
    # glm4_moe_lite reads it (transformers' config has no default for it, and says it as mlp_layer_types)
    "glm-4.7-flash-4layers": dict(model_type="glm4_moe_lite", vocab_size=154880, hidden_size=2048,
                                  intermediate_size=10240, moe_intermediate_size=1536, n_routed_experts=64,
                                  num_experts_per_tok=4, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
                                  topk_group=1, routed_scaling_factor=1.8, norm_topk_prob=True, kv_lora_rank=512,
                                  q_lora_rank=768, qk_rope_head_dim=64, qk_nope_head_dim=192, v_head_dim=256,
                                  num_attention_heads=20, num_key_value_heads=20, num_hidden_layers=4,
                                  tie_word_embeddings=False, max_position_embeddings=202752, rms_norm_eps=1e-5),
    # its layers cut to 4: the real experts, router and attention shapes for the GPU tests (tests/gpu/test_moe_gpu.py)
    "qwen3-30b-a3b-4layers": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                                  moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                                  norm_topk_prob=True, num_hidden_layers=4, num_attention_heads=32,
                                  num_key_value_heads=4, head_dim=128, tie_word_embeddings=False,
                                  max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6),
}


def random_model_config(arch: str = "", config_dir: str = "", tokenizer=None):
    """The transformers config for random init: a preset, or the config.json in `config_dir`."""
    if config_dir:
        config = AutoConfig.from_pretrained(config_dir)
    else:
        config = preset_config(arch)
    if tokenizer is not None:  # its size against vocab_size: model_files.check_vocab, at start-up
        config.eos_token_id = tokenizer.eos_token_id
        config.pad_token_id = tokenizer.pad_token_id
        config.bos_token_id = tokenizer.bos_token_id
    return config


def preset_config(arch: str):
    """The transformers config of preset `arch`, of its family's class (Qwen2Config when it names none)."""
    values = dict(ARCH_PRESETS[arch])
    model_type = values.pop("model_type", "qwen2")
    if model_type == "qwen2":
        return Qwen2Config(**values)
    return AutoConfig.for_model(model_type, **values)


def materialize_random_model(out_dir: str, config, seed: int, dtype: torch.dtype, tokenizer=None,
                             device: torch.device | str = "cpu") -> str:
    """Rank 0 writes a random-weight checkpoint to `out_dir` (kept if one with the same config and
    seed is already there); all ranks wait for it. Returns `out_dir`. `device`: where the weights
    are drawn (a GPU draws a 7B model in seconds where the CPU took over a minute; the values
    differ from the CPU's for the same seed: the stamp records it, and a directory drawn on another
    device with the same config and seed is kept, as a run's reference model reads it)."""
    stamp = {"config": config.to_dict(), "seed": seed, "dtype": str(dtype)}
    stamp_file = os.path.join(out_dir, "spmd_rl_init.json")
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        same = False
        if os.path.isfile(stamp_file):
            with open(stamp_file) as f:
                found = json.load(f)
            found.pop("device", None)  # drawn elsewhere with the same seed: kept (a reference model reads it)
            same = found == json.loads(json.dumps(stamp))
        if not same:
            log.info("building random-weight model (seed %d) in %s", seed, out_dir)
            torch.manual_seed(seed)
            with torch.device(device):
                model = AutoModelForCausalLM.from_config(config, dtype=dtype)
            model.save_pretrained(out_dir)
            del model
            if torch.device(device).type == "cuda":
                torch.cuda.empty_cache()
            if tokenizer is not None:
                tokenizer.save_pretrained(out_dir)
            drawn_on = torch.device(device).type
            with open(stamp_file + ".tmp", "w") as f:
                json.dump(stamp if drawn_on == "cpu" else {**stamp, "device": drawn_on}, f)
            os.replace(stamp_file + ".tmp", stamp_file)
    if dist.is_initialized():
        dist.barrier()
    return out_dir


def load_causal_lm(path: str, dtype: torch.dtype, attn_implementation: str = "sdpa", remove_padding: bool = False,
                   chunked_logprobs: bool = True, key: str = "", weights: bool = True, fused_kernels: str = "none",
                   fused_logprob_head: str = "none", lora: LoraSettings | None = None,
                   share_prompts: bool = False) -> torch.nn.Module:
    """A causal LM on CPU in `dtype`, exactly as `from_pretrained` builds it, that can also be
    called for token log-probs (spmd_rl.model.logprob_head; chunked from the hidden states unless
    `chunked_logprobs` is false). `remove_padding`: it takes packed rows (spmd_rl.batching.packing) through
    the variable-length attention backend (which runs padded batches as sdpa does). `key`: the
    config key that named `path`, for the one-line error when its files cannot be loaded.
    `weights` false: the same model on the meta device, nothing read but the config (see
    build_sharded). `fused_kernels`, `fused_logprob_head`, `share_prompts`: see prepare_policy. `lora`:
    a LoRA adapter (spmd_rl.model.lora) on the frozen model, which stays in `dtype`."""
    model = _from_dir(AutoModelForCausalLM, path, dtype, attn_implementation, weights, key)
    if lora is not None:
        add_adapter(model, lora)
    return prepare_policy(model, remove_padding, chunked_logprobs, fused_kernels, fused_logprob_head, share_prompts)


def prepare_policy(model: torch.nn.Module, remove_padding: bool = False, chunked_logprobs: bool = True,
                   fused_kernels: str = "none", fused_logprob_head: str = "none",
                   share_prompts: bool = False) -> torch.nn.Module:
    """Make a causal LM callable for token log-probs (spmd_rl.train.actor.forward_logprobs): the
    log-prob head, and with `remove_padding` the variable-length attention backend.
    `fused_kernels`: the decoder layers' kernels (spmd_rl.model.fused_kernels: "none", "liger",
    "compile"; applied here, before any fully_shard). `fused_logprob_head`: the head's chunk math
    ("none", "compile"; spmd_rl.model.logprob_head). `share_prompts` (with `remove_padding`): each
    prompt once per micro-batch (spmd_rl.batching.shared_prompts)."""
    set_layout(model, remove_padding, share_prompts)
    set_fused_kernels(model, fused_kernels)
    return logprob_head.install(model, chunked=chunked_logprobs, fused=fused_logprob_head)


def set_fused_kernels(model: torch.nn.Module, mode: str) -> str:
    """Switch the decoder layers' kernels (spmd_rl.model.fused_kernels.apply); returns the mode in effect
    ("none" after a fallback, which logs one warning per process)."""
    return fused_kernels.apply(model, mode)


def load_value_model(path: str, dtype: torch.dtype, attn_implementation: str = "sdpa",
                     remove_padding: bool = False, key: str = "", weights: bool = True,
                     fused_kernels: str = "none", share_prompts: bool = False) -> torch.nn.Module:
    """The critic: the causal LM's backbone with a scalar head per token, initialised to zero so
    every rank starts from the same values (0) whatever the RNG. `key`, `weights`, `fused_kernels`,
    `share_prompts`: as for load_causal_lm."""
    model = _from_dir(AutoModelForTokenClassification, path, dtype, attn_implementation, weights, key,
                      "the critic", new=("score.",), num_labels=1)
    with torch.no_grad():
        head = model.score
        head.weight.zero_()
        if getattr(head, "bias", None) is not None:
            head.bias.zero_()
    head.register_forward_hook(_not_a_view)
    set_layout(model, remove_padding, share_prompts)
    set_fused_kernels(model, fused_kernels)
    return model


def _not_a_view(module: torch.nn.Module, args, out: torch.Tensor) -> torch.Tensor:
    """The value head's output, copied where it is a view (nn.Linear on [batch, tokens, hidden] returns a view
    of its 2-D product): the critic returns it, and FSDP2 warns at a view among its root's outputs, since an
    in-place op on one would drop its backward hook. One float per token."""
    return out.clone() if out._base is not None else out


def load_reward_model(path: str, dtype: torch.dtype, pad_token_id: int, attn_implementation: str = "sdpa",
                      key: str = "", weights: bool = True) -> torch.nn.Module:
    """A Bradley-Terry reward model (a one-label sequence classifier, checked by
    files.check_reward_model_dir) as `from_pretrained` builds it, its head included, with
    `pad_token_id` in its config (transformers reads the score at the last token that is not one),
    dropout off. `key`, `weights`: as for load_causal_lm."""
    model = _from_dir(AutoModelForSequenceClassification, path, dtype, attn_implementation, weights, key,
                      "the reward model", pad_token_id=pad_token_id)
    set_layout(model, False)
    return model


def reward_pad_id(path: str, tokenizer, key: str = "") -> int:
    """The pad id the reward model reads its scores by: its config.json's pad_token_id, else its
    tokenizer's pad token, else its EOS token."""
    with loading(path, key, "its config.json"):
        config = AutoConfig.from_pretrained(path)
    for pad in (getattr(config.get_text_config(), "pad_token_id", None), tokenizer.pad_token_id, tokenizer.eos_token_id):
        if pad is not None:
            return int(pad)
    from spmd_rl.model.files import ModelFilesError

    raise ModelFilesError(f"{key} = {path!r}: neither its config.json nor its tokenizer names a pad or EOS token, "
                          "which the reward model's score is read by: add pad_token_id to its config.json")


def _from_dir(auto_cls, path: str, dtype: torch.dtype, attn_implementation: str, weights: bool, key: str = "",
              what: str = "the model", new: tuple[str, ...] = (), **config_kw):
    """`auto_cls.from_pretrained(path)`, every tensor from the files but the `new` ones, an error
    about the files as one line naming `key` (spmd_rl.model.files); or (`weights` false) the same
    model from the same config on the meta device, in eval() mode as from_pretrained returns it."""
    with loading(path, key, what):
        if not weights:
            config = AutoConfig.from_pretrained(path, **config_kw)
            with torch.device("meta"):
                return auto_cls.from_config(config, dtype=dtype, attn_implementation=attn_implementation).eval()
        model, info = auto_cls.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation,
                                               output_loading_info=True, **config_kw)
    check_no_missing_weights(info, path, key, what, new)
    warn_experts_loop(model)
    return model


def warn_experts_loop(model: torch.nn.Module) -> None:
    """One warning where a mixture of experts would run its experts as a Python loop over them
    (transformers' "eager" experts) instead of grouped GEMMs ("grouped_mm", its default where the
    model supports it)."""
    config = model.config
    implementation = getattr(config, "_experts_implementation", None)
    if any(getattr(config, k, 0) for k in ("num_experts", "num_local_experts")) and implementation != "grouped_mm":
        log.warning("%s runs its experts as %r, a loop over the experts, not grouped GEMMs: training is slower "
                    "(docs/moe.md)", type(model).__name__, implementation)


def set_layout(model: torch.nn.Module, remove_padding: bool, share_prompts: bool = False) -> None:
    """Padded (sdpa) or packed (variable-length attention) input, with each prompt once per packed
    row where `share_prompts` (spmd_rl.batching.shared_prompts); every dropout zeroed. A model that
    packed attention cannot run right (varlen_attention.unsupported) is refused."""
    if share_prompts and not remove_padding:
        raise ValueError("shared prompts are packed rows: they need remove_padding")
    if remove_padding:  # the varlen backend runs padded batches exactly as sdpa does, too
        check_packable(model.config)
        model.set_attn_implementation(varlen_attention.register())
    elif uses_packing(model):
        model.set_attn_implementation("sdpa")
    model.spmd_remove_padding = remove_padding
    model.spmd_share_prompts = share_prompts
    disable_dropout(model)


def check_packable(config, key: str = "model") -> None:
    """A one-line ConfigError when a model of `config` cannot take packed rows here."""
    problem = varlen_attention.unsupported(config)
    if problem:
        raise ConfigError(f"model.remove_padding = true cannot run {key}: {problem}; set model.remove_padding = false")


def disable_dropout(model: torch.nn.Module) -> None:
    """Zero every dropout: the PPO ratio compares log-probs of the same weights across passes, so
    the forward must be deterministic. The models then train in train() mode (which transformers'
    gradient checkpointing requires) with eval() numerics."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for name in ("attention_dropout", "dropout", "hidden_dropout", "activation_dropout"):
            if isinstance(getattr(module, name, None), float):
                setattr(module, name, 0.0)


def uses_packing(model: torch.nn.Module) -> bool:
    """Whether `model` was loaded to take packed rows (model.remove_padding)."""
    return bool(getattr(model, "spmd_remove_padding", False))


def shares_prompts(model: torch.nn.Module) -> bool:
    """Whether `model` takes each prompt once per micro-batch (model.share_prompts)."""
    return bool(getattr(model, "spmd_share_prompts", False))


decoder_layers = fused_kernels.decoder_layers


def apply_fsdp(model: torch.nn.Module, mesh, compute_dtype: torch.dtype, gradient_checkpointing: float = False,
               forward_prefetch: bool = False) -> torch.nn.Module:
    """fully_shard every decoder layer, then the root (embeddings, norm, head), over `mesh`: 1-D
    (shard over all ranks) or 2-D (hybrid sharding, distributed.fsdp_mesh); on one rank the frozen
    parameters stay out of it (frozen_kept_whole). Parameters move to the mesh's device; grads are
    reduced in float32. `gradient_checkpointing`: the share of decoder
    layers checkpointed (set_gradient_checkpointing; True: all). `forward_prefetch`: each layer also
    starts the all-gather of the next one (FSDP2 already overlaps one layer ahead implicitly;
    explicit prefetch issues it earlier, which helps when a layer's compute is short)."""
    if gradient_checkpointing:
        set_gradient_checkpointing(model, gradient_checkpointing)
    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    ignored = frozen_kept_whole(model, mesh, compute_dtype)
    layers = decoder_layers(model)
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp, ignored_params=ignored)
    fully_shard(model, mesh=mesh, mp_policy=mp, ignored_params=ignored)
    if forward_prefetch:
        for layer, nxt in zip(layers, layers[1:]):
            layer.set_modules_to_forward_prefetch([nxt])
    return model


def frozen_kept_whole(model: torch.nn.Module, mesh, compute_dtype: torch.dtype) -> set[torch.nn.Parameter]:
    """On a one-rank mesh, the parameters that train nothing (requires_grad off: a LoRA actor's base)
    and are stored in `compute_dtype` already, moved to the mesh's device, for fully_shard to leave
    alone (`ignored_params`); elsewhere none. Sharded over one rank, a parameter is the whole tensor
    already, and FSDP2 copies it into an unsharded buffer of its own at each forward and backward of
    its unit (its one-rank unshard): for a frozen base, the same bytes again at every micro-batch, on
    the compute stream. Kept out of FSDP2 it is the plain tensor the layers read, at the same memory
    (less: no unsharded copy), with no gradient to reduce. A frozen parameter in another dtype stays
    in FSDP2, which casts it to the compute dtype at each unshard; one on the meta device stays there
    (allocate_meta_model gives it storage on the device)."""
    if mesh.size() != 1:  # size(): all of the mesh's ranks, 2-D meshes too
        return set()
    frozen = {p for p in model.parameters() if not p.requires_grad and p.dtype == compute_dtype}
    device = _mesh_device(mesh)
    with torch.no_grad():
        for p in frozen:
            if p.device != device and p.device.type != "meta":
                p.data = p.data.to(device)
    return frozen


def reshard(model: torch.nn.Module) -> None:
    """After a no-grad forward FSDP2 keeps the root's parameters (embeddings, lm_head, norm)
    unsharded -- 2.2 GB per rank for a 7B model, held through the rollout. Free them, and those of
    any other unit left unsharded (a no-op for units that already are)."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def set_gradient_checkpointing(model: torch.nn.Module, share: float) -> None:
    """Checkpoint `share` of the decoder layers (True: all, False/0: none), spread evenly over the
    stack (checkpointed_layers); the others keep their activations for backward. Each layer's
    switch is fused_kernels.set_layer_checkpointing: transformers checkpoints the layers that run
    its forward (set up here by its own method, non-reentrant), a compiled layer checkpoints its
    compiled function itself.
    transformers checkpoints a layer only in train() mode, and from_pretrained returns eval()
    models: without train() the switch does nothing (it did nothing here before). Dropout is off
    (disable_dropout), so train() changes no numbers."""
    layers = decoder_layers(model)
    chosen = set(checkpointed_layers(len(layers), float(share))) if share else set()
    _transformers_checkpointing(model, bool(chosen))
    for i, layer in enumerate(layers):
        fused_kernels.set_layer_checkpointing(layer, i in chosen)
    if chosen:
        model.train()


def _transformers_checkpointing(model: torch.nn.Module, on: bool) -> None:
    """transformers' switch for the whole model (every layer's `gradient_checkpointing` and its
    checkpoint function): activation_checkpointing_enable / _disable where transformers has them
    (5.24; gradient_checkpointing_* are their deprecated aliases there, with a FutureWarning),
    else gradient_checkpointing_enable / _disable (5.17)."""
    new_api = hasattr(model, "activation_checkpointing_enable")
    kwargs = {"use_reentrant": False, "context_fn": checkpoint_contexts}  # a recompute routes as its forward
    if not on:
        (model.activation_checkpointing_disable if new_api else model.gradient_checkpointing_disable)()
    elif new_api:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def checkpointed_layers(n_layers: int, share: float) -> list[int]:
    """The indices of round(share * n_layers) of n_layers layers (at least one), evenly spaced."""
    if not 0 < share <= 1:
        raise ValueError(f"the share of checkpointed layers must be in (0, 1], not {share}")
    k = max(1, round(share * n_layers))
    return sorted({int((j + 0.5) * n_layers / k) for j in range(k)})


def build_sharded(load: Callable[..., torch.nn.Module], mesh, compute_dtype: torch.dtype, from_checkpoint: bool,
                  gradient_checkpointing: float = False, forward_prefetch: bool = False) -> torch.nn.Module:
    """The FSDP2 model `load(weights=...)` gives (load_causal_lm / load_value_model with their other
    arguments bound), wrapped as apply_fsdp does, without a full copy of the weights per rank:

    - `from_checkpoint`: built on the meta device and sharded; no weights are read, the shards are
      left for the checkpoint load (DCP) to fill.
    - else rank 0 alone loads the full weights (`from_pretrained`, on CPU) and broadcasts them into
      every rank's shards. One process needs no broadcast: it wraps its from_pretrained model.

    Only rank 0 holds a full copy, and only on a fresh start: a 7B model in float32 is 28 GB of
    host memory and disk reads once per job, not once per rank."""
    if not from_checkpoint and mesh.size() == 1:  # size(): all of the mesh's ranks, 2-D meshes too
        return apply_fsdp(load(weights=True), mesh, compute_dtype, gradient_checkpointing, forward_prefetch)
    model = apply_fsdp(load(weights=False), mesh, compute_dtype, gradient_checkpointing, forward_prefetch)
    allocate_meta_model(model, _mesh_device(mesh))
    if not from_checkpoint:
        full = load(weights=True).state_dict() if dist.get_rank() == 0 else {}
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    return model


def allocate_meta_model(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """Storage on `device` for a model built on the meta device (sharded or not). Parameters and
    persistent buffers stay uninitialised: a load must fill them.

    `to_empty` gives each module a new Parameter of its own when the model is not sharded (FSDP's
    DTensors are swapped in place and keep their identity): tied embeddings are tied again, or
    a load into one would leave the other garbage. Non-persistent buffers (rotary `inv_freq`) are
    in no state dict, so they are computed here by transformers' own init, the way its
    from_pretrained computes them after a meta-device build: every state-dict tensor is marked
    initialised (transformers' init functions skip those), then `initialize_weights` runs."""
    model.to_empty(device=device)
    model.tie_weights()
    for module in model.modules():
        module._is_hf_initialized = False  # a module marked done would be skipped whole
    for tensor in model.state_dict(keep_vars=True).values():
        tensor._is_hf_initialized = True
    model.initialize_weights()
    return model


def _mesh_device(mesh) -> torch.device:
    """This rank's device of `mesh` (its current CUDA device on a GPU mesh)."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type, torch.get_device_module(mesh.device_type).current_device())


def count_parameters(model: torch.nn.Module, trained_only: bool = False) -> int:
    """Unique parameters (tied ones once), full (unsharded) sizes; `trained_only`: those that require grad."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trained_only)


def active_parameters(model: torch.nn.Module, trained_only: bool = False) -> int:
    """count_parameters, with a mixture of experts' expert weights (fused, under `.experts.`) counted at the
    share a token runs through (top-k of the experts): the N of 6N for a mixture. A dense model's count."""
    config = getattr(model, "config", None)
    experts = next((getattr(config, k, 0) for k in ("num_experts", "num_local_experts") if getattr(config, k, 0)), 0)
    share = getattr(config, "num_experts_per_tok", 0) / experts if experts else 1.0
    return round(sum(p.numel() * (share if ".experts." in name else 1.0) for name, p in model.named_parameters()
                     if p.requires_grad or not trained_only))


def update_flops_per_token(n_params: int, n_trained: int) -> float:
    """Training FLOPs per token of a decoder with `n_params` parameters of which `n_trained` are trained:
    2 per parameter forward, 2 backward for the input's gradient (every layer passes it on), and 2 more
    per trained parameter for its weight's gradient: 6N in full fine-tuning, 4N + 2 x the adapter with
    LoRA (the frozen base gets no weight gradient). Activation recomputation is not counted."""
    return 4 * n_params + 2 * n_trained
