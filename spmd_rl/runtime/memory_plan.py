"""Each GPU's memory, predicted from plain numbers before anything is allocated.

A run holds, per GPU, in two phases that take turns (spmd_rl/trainer.py):

- generation: the vLLM engine awake (`rollout.gpu_memory_utilization` x the device's memory: vLLM
  sizes its weights + KV cache + activations to that share; with `rollout.kv_cache_tokens` its weights,
  that KV cache and ENGINE_RUNTIME_GIB) beside what training keeps resident:
  every model's parameter shards and the optimizer states (gradients are freed after each update),
  or nothing with `rollout.offload_train_states` (then the weight sync, before the KV cache wakes,
  still holds both the training state and the engine's weights);
- update: the training state (parameters, gradients, AdamW's two moments) with the larger of the
  activations of one micro-batch and the optimizer step's own bytes (AdamW's foreach sqrt(v), one
  more parameter-sized tensor; the moments too where they are offloaded), vLLM asleep (it keeps only
  its buffers outside the pool and its CUDA graphs, and its weights with rollout.weights_stay_on_gpu),
  or with rollout.stay_awake vLLM awake: its weights, its KV cache and its runtime beside training.
  The no-grad log-prob passes (old log-probs, reference, values) hold the same state without
  gradients, with their own, larger, token budget.

Bytes per parameter, sharded over the FSDP shard group: a trained model in float32 masters holds
4 (parameters) + 4 (gradients) + 8 (AdamW's two moments, in the parameters' dtype) = 16; in
bfloat16 masters 2 + 2 + 4 = 8. The reference model is parameters only, in the compute dtype.
`actor.offload_optimizer` keeps the moments on the CPU except during the optimizer step.

Activations of one update micro-batch of T tokens per GPU (hidden size h, L decoder layers, compute dtype of c
bytes): a layer that keeps its activations for backward holds T x h x ACTIVATION_BYTES_PER_HIDDEN x c / 2 at
the fitted shapes (what differs for others: below); a checkpointed one only its input (T x h x c), plus one
layer's activations while it is recomputed; the log-prob head holds its chunk temporaries
(logprob_head.CHUNK_ELEMENTS logits), the gathered head weight and its float32 gradient (the full [vocab, h]
logits x 3 in float32 without `model.chunked_logprobs`); FSDP holds two gathered layers and their unsharded
gradients. A no-grad pass holds one layer's activations at a time. A layer's dense MLP is counted apart from
the fitted constant (SWIGLU_VALUES_PER_INTERMEDIATE per unit of its intermediate size; the constant holds the
fitted shapes' MLP, FIT_INTERMEDIATE_PER_HIDDEN), so a narrower MLP keeps less. A mixture-of-experts layer has
no dense MLP: it holds what a layer keeps beside it, its router's and routed copies' tensors and any shared
expert's (mixture_layer_activation_bytes), fewer where its experts are frozen (LoRA), as no weight gradient
reads their inputs. Under LoRA (a frozen base) the head and the gathered layers take no float32 gradient, on
one rank the base is not gathered at all (loading.frozen_kept_whole), and a layer keeps LORA_VALUES_PER_HIDDEN
more.

Parameter counts come from the model's shape (config.json or loading.ARCH_PRESETS), arithmetically:
no weights are read. Nothing here imports torch; spmd_rl/preflight/memory.py reads the
config and the device and calls `plan_memory`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GiB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

ACTIVATION_BYTES_PER_HIDDEN = 39.0
"""Bytes a decoder layer keeps for backward per token and per unit of hidden size, at a 2-byte
compute dtype (scaled by compute bytes / 2): Qwen2 shapes (intermediate ~5.5 x hidden) in
transformers' modules or the compiled layer. Fitted to three update peaks of docs/performance.md,
"Memory predicted at start-up" (bench_step's work, no checkpointing: 0.5B at 16384 and 32768
tokens, 1.5B at 16384); tests/runtime/test_memory_plan.py keeps them and the checkpointed 1.5B runs
(every layer, half) within 10%."""
SWIGLU_VALUES_PER_INTERMEDIATE = 3
"""Values a compiled SwiGLU MLP keeps for backward per token and unit of its intermediate size: the gate
and up projections' outputs and their activated product (the compiled layer's saved tensors, counted on
CPU by tests/runtime/test_activation_count.py; the same count per routed copy in a mixture layer)."""
ATTENTION_VALUES_PER_HEAD_UNIT = {False: 2, True: 3}
"""Values a compiled attention keeps for backward per token and unit of its query width (heads x head_dim)
and of its key-value width (kv heads x head_dim), without and with RMSNorms on the queries and keys
(Qwen3's, Gemma 3's: one more each; counted on CPU by tests/runtime/test_activation_count.py)."""
FIT_KV_PER_HIDDEN = 0.155
"""Key-value width / hidden size of the shapes ACTIVATION_BYTES_PER_HIDDEN is fitted to (Qwen2 0.5B: 1/7,
1.5B: 1/6; their query width is the hidden size, without query-key norms): the constant holds their
attention's ATTENTION_VALUES_PER_HEAD_UNIT[False] x (1 + this) values per hidden unit, and a shape whose
attention is wider or normed adds the difference (attention_extra_values)."""
FIT_INTERMEDIATE_PER_HIDDEN = 5.6
"""intermediate_size / hidden_size of the shapes ACTIVATION_BYTES_PER_HIDDEN is fitted to (Qwen2 0.5B:
5.43, 1.5B: 5.83): the dense MLP's part of that constant is SWIGLU_VALUES_PER_INTERMEDIATE x 2 bytes x this."""
LORA_VALUES_PER_HIDDEN = 3.5
"""Values per token and unit of hidden size a decoder layer keeps beyond the fitted constant's when LoRA trains
an adapter on a frozen base (Work.base_trained False). Fitted to the LoRA presets' update peaks of
docs/performance.md, "Memory predicted at start-up" (Qwen2 7B, Qwen3-8B and Llama 3.1 8B shapes, two micro-batch
sizes; tests/runtime/test_memory_plan.py keeps them within 10%), after counting what a frozen base does not hold
(the head's and the gathered layers' float32 gradients, and on one rank the gathered copies). Measured, not
counted: on CPU the compiled LoRA layer keeps fewer values per hidden unit than a fully trained one."""
HEAD_CHUNK_ELEMENTS = 1 << 28
"""logprob_head.CHUNK_ELEMENTS (not imported: that module imports torch)."""
HEAD_CHUNK_TEMPORARIES = {"none": 3 * 4, "compile": 2 * 2}
"""Bytes per chunk logit live at once in the head's backward: the eager head's float32
temporaries (about 3), the compiled head's bf16 logits and gradient (2)."""
CUDA_CONTEXT_GIB = 1.5
"""Per process outside PyTorch's tensors: the CUDA context, cuBLAS workspaces, NCCL buffers and
what the caching allocator holds beyond the tensors. With ENGINE_ASLEEP_GIB and CUDA_GRAPH_GIB it
makes the device's level while the engine sleeps (parameters aside), set from bench_rollout's
(docs/performance.md, "Memory predicted at start-up")."""
ENGINE_ASLEEP_GIB = 2.2
"""A sleeping vLLM engine's buffers outside its sleep pool (docs/performance.md, "Memory peaks per
preset")."""
CUDA_GRAPH_GIB = 0.5
"""vLLM's CUDA graphs, not freed by sleep (docs/performance.md, "Memory peaks per preset")."""
ENGINE_RUNTIME_GIB = 2.0
"""What vLLM's share holds beside its weights and KV cache: its profiling pass's peak activations and
its CUDA graphs (the start-up log's "Available KV cache memory" is the share less these and the weights)."""
SYNC_BUCKETS = 2
"""Weight-sync buckets alive at once (the gathered one and the one handed to the engine)."""


# --------------------------------------------------------------------------- the model's shape


@dataclass(frozen=True)
class ModelShape:
    """What the parameter count and the activations depend on: a decoder-only LM, dense or with a
    mixture of experts in `moe_layers` of its layers (the others dense)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tied_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    layer_norm_parameters: int = 0  # per layer; 0: two RMSNorm weights of hidden_size
    num_experts: int = 0  # 0: dense
    experts_per_token: int = 0  # top-k
    moe_intermediate_size: int = 0
    moe_layers: int = 0  # layers whose MLP is the mixture (the rest are dense)
    shared_expert_intermediate_size: int = 0  # a mixture layer's always-on expert (0: none)
    qk_norm: bool = False  # RMSNorms on the queries and keys (QK_NORM_MODEL_TYPES)
    latent: tuple[int, int, int, int, int] = ()
    """Multi-head latent attention (DeepSeek-V3's, GLM-4.7-Flash's): (q_lora_rank (0: a plain query
    projection), kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim, v_head_dim); () for the usual heads."""

    def latent_projections(self) -> dict[str, tuple[int, int]]:
        """Latent attention's linear layers, (in, out) each (transformers' DeepSeek-V3 attention)."""
        q_rank, kv_rank, rope, nope, v = self.latent
        h, heads = self.hidden_size, self.num_heads
        query = ({"q_a_proj": (h, q_rank), "q_b_proj": (q_rank, heads * (nope + rope))} if q_rank
                 else {"q_proj": (h, heads * (nope + rope))})
        return {**query, "kv_a_proj_with_mqa": (h, kv_rank + rope), "kv_b_proj": (kv_rank, heads * (nope + v)),
                "o_proj": (heads * v, h)}

    def attention_parameters(self) -> int:
        if self.latent:  # the projections and the RMSNorms of the two latents
            return sum(i * o for i, o in self.latent_projections().values()) + self.latent[0] + self.latent[1]
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return h * q + 2 * h * kv + q * h + (q + 2 * kv if self.qkv_bias else 0) + (h if self.o_bias else 0)

    def norm_parameters(self) -> int:
        return self.layer_norm_parameters or 2 * self.hidden_size

    def dense_layer_parameters(self) -> int:
        mlp = 3 * self.hidden_size * self.intermediate_size + (2 * self.intermediate_size + self.hidden_size
                                                               if self.mlp_bias else 0)
        return self.attention_parameters() + mlp + self.norm_parameters()

    def expert_parameters(self) -> int:
        """One expert's gate, up and down projections."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    def moe_layer_parameters(self) -> int:
        """A mixture layer's: attention, norms, the router ([experts, hidden]) and every expert."""
        return (self.attention_parameters() + self.norm_parameters() + self.num_experts * self.hidden_size
                + self.num_experts * self.expert_parameters() + 3 * self.hidden_size * self.shared_expert_intermediate_size)

    def layer_parameters(self) -> int:
        """The largest decoder layer's (what FSDP gathers at once)."""
        return self.moe_layer_parameters() if self.moe_layers else self.dense_layer_parameters()

    def backbone_parameters(self) -> int:
        """Embedding, layers and the final norm."""
        dense = self.num_layers - self.moe_layers
        return (self.vocab_size * self.hidden_size + dense * self.dense_layer_parameters()
                + self.moe_layers * self.moe_layer_parameters() + self.hidden_size)

    def parameters(self) -> int:
        """The causal LM's: the backbone and, untied, the LM head."""
        head = 0 if self.tied_embeddings else self.vocab_size * self.hidden_size
        return self.backbone_parameters() + head

    def active_parameters(self) -> int:
        """The parameters a token runs through: all but the experts the router did not pick."""
        idle = self.moe_layers * (self.num_experts - self.experts_per_token) * self.expert_parameters()
        return self.parameters() - idle

    def lora_parameters(self, rank: int, targets: tuple[str, ...]) -> int:
        """A LoRA adapter's on the decoder layers' linear modules named in `targets` (empty: all of
        them; of a mixture, its attention's: spmd_rl/model/lora.py adapted_modules): rank x (in + out)
        each, as PEFT's A and B."""
        h, q, kv, i = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.intermediate_size
        attention = (self.latent_projections() if self.latent
                     else {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h)})
        mlp = {"gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
        s = self.shared_expert_intermediate_size
        shared = {"gate_proj": (h, s), "up_proj": (h, s), "down_proj": (s, h)} if s else {}
        names = targets or (attention if self.moe_layers else (*attention, *mlp))  # a mixture: its attention
        per_layer = lambda table: sum(rank * sum(table[n]) for n in names if n in table)  # noqa: E731
        return (self.num_layers * per_layer(attention) + (self.num_layers - self.moe_layers) * per_layer(mlp)
                + self.moe_layers * per_layer(shared))

    def value_model_parameters(self) -> int:
        """The critic's: the backbone and a scalar head with bias (load_value_model)."""
        return self.backbone_parameters() + self.hidden_size + 1


QKV_BIAS_MODEL_TYPES = ("qwen2",)
"""Model types whose q/k/v projections always carry a bias (transformers' Qwen2Attention)."""
QK_NORM_MODEL_TYPES = ("qwen3", "qwen3_moe", "gemma3_text")
"""Model types with an RMSNorm of head_dim on the queries and one on the keys in every layer."""
FOUR_NORM_MODEL_TYPES = ("gemma3_text",)
"""Model types with four RMSNorms of hidden_size per layer (Gemma 3: before and after attention and MLP)."""
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
"""config.json entries that count a mixture's experts."""
MOE_MODEL_TYPES = ("qwen3_moe", "glm4_moe_lite")
"""Mixture-of-experts families whose layout the formula knows (moe_layer_count); others are refused."""
LATENT_ATTENTION_MODEL_TYPES = ("glm4_moe_lite",)
"""Model types with multi-head latent attention (ModelShape.latent)."""


def experts_of(config: dict) -> int:
    """The routed experts a config.json's (text config's) entries name (EXPERT_KEYS); 0 for a dense model."""
    return next((int(config[k]) for k in EXPERT_KEYS if config.get(k)), 0)


def moe_layer_count(config: dict) -> int:
    """How many layers hold the mixture: qwen3_moe's not in `mlp_only_layers` whose index + 1 is a multiple of
    `decoder_sparse_step` (transformers' Qwen3MoeDecoderLayer); glm4_moe_lite's "sparse" `mlp_layer_types`
    (transformers' default: all but the first)."""
    layers = int(config["num_hidden_layers"])
    if config.get("model_type") == "glm4_moe_lite":
        types = config.get("mlp_layer_types") or ["dense"] + ["sparse"] * (layers - 1)
        return sum(t == "sparse" for t in types)
    step, dense = int(config.get("decoder_sparse_step", 1) or 1), set(config.get("mlp_only_layers") or [])
    return sum(1 for i in range(layers) if i not in dense and (i + 1) % step == 0)


def shape_from_config(config: dict) -> ModelShape:
    """The shape in a config.json (its text config's entries) or a loading.ARCH_PRESETS entry.
    ValueError for a mixture-of-experts family the formula does not know; KeyError where an entry it
    needs is missing."""
    model_type = config.get("model_type", "qwen2")
    experts = experts_of(config)
    if experts and model_type not in MOE_MODEL_TYPES:
        raise ValueError(f"{model_type} with {experts} experts: a mixture-of-experts family the memory formula does "
                         f"not count (it counts {', '.join(MOE_MODEL_TYPES)})")
    h, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or h // heads)
    attention_bias = bool(config.get("attention_bias", False))
    norms = (4 if model_type in FOUR_NORM_MODEL_TYPES else 2) * h + (2 * head_dim if model_type in QK_NORM_MODEL_TYPES else 0)
    moe = dict(num_experts=experts, experts_per_token=int(config["num_experts_per_tok"]),
               moe_intermediate_size=int(config["moe_intermediate_size"]), moe_layers=moe_layer_count(config),
               shared_expert_intermediate_size=int(config["moe_intermediate_size"]) * int(config.get("n_shared_experts") or 0)
               ) if experts else {}
    if model_type in LATENT_ATTENTION_MODEL_TYPES:
        moe["latent"] = (int(config.get("q_lora_rank") or 0), int(config["kv_lora_rank"]), int(config["qk_rope_head_dim"]),
                         int(config["qk_nope_head_dim"]), int(config["v_head_dim"]))
    return ModelShape(
        vocab_size=int(config["vocab_size"]), hidden_size=h, intermediate_size=int(config["intermediate_size"]),
        num_layers=int(config["num_hidden_layers"]), num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads") or heads), head_dim=head_dim,
        tied_embeddings=bool(config.get("tie_word_embeddings", True)),
        qkv_bias=attention_bias or model_type in QKV_BIAS_MODEL_TYPES,
        o_bias=attention_bias, mlp_bias=bool(config.get("mlp_bias", False)), layer_norm_parameters=norms,
        qk_norm=model_type in QK_NORM_MODEL_TYPES, **moe)


# --------------------------------------------------------------------------- training state


@dataclass(frozen=True)
class Role:
    """A model the trainer holds on each GPU: trained (actor, critic: gradients and AdamW) or
    frozen (reference: parameters only)."""

    name: str
    parameters: int
    dtype_bytes: int  # of its stored parameters (the master dtype; the compute dtype for the reference)
    trained: bool
    optimizer_on_gpu: bool = True  # False: actor.offload_optimizer

    def param_bytes(self, shard: int) -> float:
        return self.parameters * self.dtype_bytes / shard

    def grad_bytes(self, shard: int) -> float:
        return self.param_bytes(shard) if self.trained else 0.0

    def optimizer_bytes(self, shard: int) -> float:
        """AdamW's two moments, in the parameters' dtype (0 for a frozen model)."""
        return 2 * self.param_bytes(shard) if self.trained else 0.0

    def resident_optimizer_bytes(self, shard: int) -> float:
        return self.optimizer_bytes(shard) if self.optimizer_on_gpu else 0.0

    def optimizer_step_bytes(self, shard: int) -> float:
        """What the optimizer step adds to the resident state: AdamW's foreach step holds sqrt(v) of
        every parameter of the shard at once (torch.optim.adamw, _multi_tensor_adamw: _foreach_sqrt),
        and offloaded moments come back for it (actor.offload_optimizer)."""
        if not self.trained:
            return 0.0
        return self.param_bytes(shard) + (0.0 if self.optimizer_on_gpu else self.optimizer_bytes(shard))


def training_state_bytes(roles: list[Role], shard: int) -> dict[str, float]:
    """Parameters, gradients and optimizer states of every role, per GPU (all of them at once)."""
    return {"params": sum(r.param_bytes(shard) for r in roles),
            "grads": sum(r.grad_bytes(shard) for r in roles),
            "optimizer": sum(r.optimizer_bytes(shard) for r in roles)}


# --------------------------------------------------------------------------- activations


@dataclass(frozen=True)
class Work:
    """What a micro-batch costs per GPU: its tokens and how the model runs them."""

    update_tokens: int  # tokens of one update micro-batch on this GPU
    forward_tokens: int  # of one no-grad log-prob / value micro-batch
    compute_bytes: int = 2
    checkpointed_share: float = 0.0  # model.checkpointed_share()
    chunked_logprobs: bool = True
    head: str = "none"  # model.fused_logprob_head
    base_trained: bool = True  # False: LoRA, the base frozen (a mixture's experts too), an adapter alone trained
    base_gathered: bool = True  # False: the frozen base kept out of FSDP2 (one rank: loading.frozen_kept_whole)


def layer_activation_bytes(shape: ModelShape, tokens: int, work: Work) -> float:
    """One dense decoder layer's activations for `tokens` tokens: what it keeps beside its MLP
    (layer_values_beside_mlp) and its SwiGLU MLP's values."""
    values = layer_values_beside_mlp(shape, work) + SWIGLU_VALUES_PER_INTERMEDIATE * shape.intermediate_size
    return tokens * values * work.compute_bytes


def layer_values_beside_mlp(shape: ModelShape, work: Work) -> float:
    """Values per token a decoder layer keeps beside its MLP: the fitted constant's less the fitted shapes'
    dense MLP (SWIGLU_VALUES_PER_INTERMEDIATE x FIT_INTERMEDIATE_PER_HIDDEN), what a wider or normed attention
    than theirs keeps beyond it, and under LoRA (a frozen base) LORA_VALUES_PER_HIDDEN more."""
    fitted = ACTIVATION_BYTES_PER_HIDDEN / 2 - SWIGLU_VALUES_PER_INTERMEDIATE * FIT_INTERMEDIATE_PER_HIDDEN
    lora = 0.0 if work.base_trained else LORA_VALUES_PER_HIDDEN
    return shape.hidden_size * (fitted + lora) + attention_extra_values(shape)


def attention_extra_values(shape: ModelShape) -> float:
    """Values per token an attention keeps beyond what ACTIVATION_BYTES_PER_HIDDEN holds for it (the fitted
    Qwen2 shapes': query width = hidden, no query-key norms): more for Qwen3-MoE's query twice its hidden
    size, or normed queries and keys (FIT_KV_PER_HIDDEN). 0 for latent attention (not counted apart)."""
    if shape.latent:
        return 0.0
    q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    fitted = ATTENTION_VALUES_PER_HEAD_UNIT[False] * shape.hidden_size * (1 + FIT_KV_PER_HIDDEN)
    return ATTENTION_VALUES_PER_HEAD_UNIT[shape.qk_norm] * (q + kv) - fitted


def mixture_layer_activation_bytes(shape: ModelShape, tokens: int, work: Work) -> float:
    """One mixture layer's activations for `tokens` tokens: what a layer keeps beside its MLP
    (layer_values_beside_mlp); its shared expert's SwiGLU, if any; and its router's and routed copies'
    tensors (expert_activation_bytes)."""
    own = tokens * layer_values_beside_mlp(shape, work) * work.compute_bytes
    shared = tokens * swiglu_values(work) * shape.shared_expert_intermediate_size * work.compute_bytes
    return own + shared + expert_activation_bytes(shape, tokens, work)


def swiglu_values(work: Work) -> int:
    """Values an expert's SwiGLU keeps per routed copy and unit of its intermediate size: the gate and up
    outputs, and their activated product where the down projection's weight is trained (its gradient
    reads it; a frozen expert's does not)."""
    return SWIGLU_VALUES_PER_INTERMEDIATE if work.base_trained else SWIGLU_VALUES_PER_INTERMEDIATE - 1


def largest_layer_activation_bytes(shape: ModelShape, tokens: int, work: Work) -> float:
    """The activations of the model's largest layer, dense or mixture (one layer recomputed or run at a time)."""
    dense = layer_activation_bytes(shape, tokens, work) if shape.moe_layers < shape.num_layers else 0.0
    return max(dense, mixture_layer_activation_bytes(shape, tokens, work) if shape.moe_layers else 0.0)


def expert_activation_bytes(shape: ModelShape, tokens: int, work: Work) -> float:
    """A mixture layer's router and routed copies for `tokens` tokens: the router's float32 logits and
    probabilities, and per routed copy of a token (top-k of them) its output, its routing weight, its
    expert's SwiGLU values (swiglu_values x moe_intermediate_size) and, where the experts are trained, its
    permuted input (the up projection's weight gradient reads it): 2 x hidden + 1 + 3 x moe_intermediate_size
    values trained, hidden + 1 + 2 x moe_intermediate_size frozen (the compiled layer's saved tensors,
    tests/runtime/test_activation_count.py)."""
    if not shape.moe_layers:
        return 0.0
    routed = tokens * shape.experts_per_token
    copy_values = ((2 if work.base_trained else 1) * shape.hidden_size + 1
                   + swiglu_values(work) * shape.moe_intermediate_size)
    return tokens * shape.num_experts * 4 * 2 + routed * copy_values * work.compute_bytes


def head_bytes(shape: ModelShape, tokens: int, work: Work, backward: bool) -> float:
    """The log-prob head: chunk temporaries and the gathered weight (none kept out of FSDP2) with its
    float32 gradient in backward (none for a frozen base: logprob_head computes what autograd asks), or
    the full float32 logits without chunking."""
    weight = shape.vocab_size * shape.hidden_size * gathered_bytes_per_parameter(work, backward)
    if not work.chunked_logprobs:
        return weight + tokens * shape.vocab_size * 4 * (3 if backward else 2)
    positions = min(tokens, max(1, HEAD_CHUNK_ELEMENTS // shape.vocab_size))
    return weight + positions * shape.vocab_size * HEAD_CHUNK_TEMPORARIES.get(work.head, 12)


def fsdp_buffer_bytes(shape: ModelShape, work: Work, backward: bool) -> float:
    """Two gathered layers in the compute dtype (the running one and the prefetched one; none for a frozen
    base kept out of FSDP2) and, in backward, their float32 gradients before the reduce-scatter (none for a
    frozen base; a LoRA adapter's are not counted: a few MiB)."""
    return 2 * shape.layer_parameters() * gathered_bytes_per_parameter(work, backward)


def gathered_bytes_per_parameter(work: Work, backward: bool) -> int:
    """What FSDP2 holds per parameter of a unit while it runs: its gathered copy in the compute dtype (none for
    a frozen base kept out of FSDP2) and, in backward, its float32 gradient (none for a frozen base)."""
    return (work.compute_bytes if work.base_gathered else 0) + (4 if backward and work.base_trained else 0)


def update_activation_bytes(shape: ModelShape, work: Work) -> float:
    """An update micro-batch's activations (with the head and FSDP's gathered layers)."""
    t = work.update_tokens
    checkpointed = round(work.checkpointed_share * shape.num_layers)
    kept = shape.num_layers - checkpointed
    kept_moe = kept * shape.moe_layers / shape.num_layers  # the mixture layers spread over the depth
    layers = ((kept - kept_moe) * layer_activation_bytes(shape, t, work)
              + kept_moe * mixture_layer_activation_bytes(shape, t, work))
    if checkpointed:  # their inputs, and the one layer recomputed at a time
        layers += checkpointed * t * shape.hidden_size * work.compute_bytes + largest_layer_activation_bytes(shape, t, work)
    return layers + head_bytes(shape, t, work, backward=True) + fsdp_buffer_bytes(shape, work, backward=True)


def forward_activation_bytes(shape: ModelShape, work: Work) -> float:
    """A no-grad pass (log-probs, reference, values): one layer's activations at a time."""
    t = work.forward_tokens
    return (largest_layer_activation_bytes(shape, t, work)
            + head_bytes(shape, t, work, backward=False)
            + fsdp_buffer_bytes(shape, work, backward=False))


# --------------------------------------------------------------------------- the engine


@dataclass(frozen=True)
class Engine:
    """The rollout engine on this GPU."""

    kind: str = "vllm"  # "vllm", or "hf" (a full model copy, never asleep)
    gpu_memory_utilization: float = 0.5
    cuda_graphs: bool = True  # not rollout.enforce_eager
    weight_bytes: float = 0.0  # this GPU's engine weights (its tensor-parallel shard), for the weight sync
    sync_bucket_bytes: float = 512 * 2**20
    weights_stay: bool = False  # rollout.weights_stay_on_gpu: the weights stay on the GPU while it sleeps
    awake: bool = False  # rollout.stay_awake: never asleep after its first wake-up, in training phases too
    kv_bytes: float = 0.0  # rollout.kv_cache_tokens' KV cache on this GPU; 0: vLLM fills its share


def kv_bytes_per_token(shape: ModelShape, tensor_parallel_size: int, dtype_bytes: int) -> float:
    """One token's KV cache on one GPU of a tensor-parallel group: a key and a value per layer of
    its share of the KV heads (at least one: vLLM repeats a head across ranks when there are fewer
    heads than ranks), or the latent and the rope key per layer with latent attention (not split by
    tensor parallelism). Every layer counted at full attention: sliding-window layers hold less."""
    if shape.latent:
        _, kv_rank, rope, _, _ = shape.latent
        return shape.num_layers * (kv_rank + rope) * dtype_bytes
    heads = max(1, shape.num_kv_heads // tensor_parallel_size)
    return shape.num_layers * 2 * heads * shape.head_dim * dtype_bytes


def engine_kv_tokens(engine: Engine, device_total: float, kv_token_bytes: float) -> int:
    """Tokens the engine's KV cache holds: its share of the device less its weights and
    ENGINE_RUNTIME_GIB, over one token's bytes (0 for the HF engine, which has no KV cache to size)."""
    if engine.kind != "vllm":
        return 0
    free = engine.gpu_memory_utilization * device_total - engine.weight_bytes - ENGINE_RUNTIME_GIB * GiB
    return max(0, int(free // kv_token_bytes))


def engine_label(engine: Engine) -> str:
    return "HF engine" if engine.kind == "hf" else "vLLM asleep"


def engine_asleep_bytes(engine: Engine) -> float:
    """What the engine keeps outside its sleep pool while training runs (the HF engine: its model)."""
    if engine.kind == "hf":
        return engine.weight_bytes
    return (ENGINE_ASLEEP_GIB + (CUDA_GRAPH_GIB if engine.cuda_graphs else 0.0)) * GiB


def engine_weights_asleep(engine: Engine) -> dict[str, float]:
    """The engine's weights where they stay on the GPU while it sleeps (rollout.weights_stay_on_gpu),
    a part of every training phase; none otherwise."""
    return {"vLLM weights": engine.weight_bytes} if engine.kind == "vllm" and engine.weights_stay else {}


def engine_awake_bytes(engine: Engine, device_total: float) -> float:
    """What the vLLM engine holds awake: its share of the device where vLLM sizes the KV cache, or its
    weights, its KV cache of `kv_bytes` and ENGINE_RUNTIME_GIB where rollout.kv_cache_tokens sets it."""
    if not engine.kv_bytes:
        return engine.gpu_memory_utilization * device_total
    return engine.weight_bytes + engine.kv_bytes + ENGINE_RUNTIME_GIB * GiB


def engine_in_training(engine: Engine, device_total: float) -> dict[str, float]:
    """What the engine holds while training runs, by part: awake (rollout.stay_awake) all of it and
    its buffers outside the pool; else asleep, with its weights where they stay."""
    if engine.kind == "vllm" and engine.awake:
        return {"vLLM awake": engine_awake_bytes(engine, device_total), "vLLM asleep": engine_asleep_bytes(engine)}
    return {engine_label(engine): engine_asleep_bytes(engine), **engine_weights_asleep(engine)}


# --------------------------------------------------------------------------- the plan


@dataclass
class Phase:
    name: str
    parts: dict[str, float]  # bytes per GPU, by what holds them

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    def describe(self) -> str:
        parts = " + ".join(f"{k} {v / GiB:.1f}" for k, v in self.parts.items() if v >= 0.05 * GiB)
        return f"{self.name}: {parts} = {self.total / GiB:.1f}" if parts else f"{self.name}: {self.total / GiB:.1f}"


@dataclass
class MemoryPlan:
    """Every phase's predicted bytes per GPU; `device_total`: the device's bytes (None: no GPU)."""

    phases: list[Phase]
    device_total: float | None = None

    @property
    def peak(self) -> Phase:
        return max(self.phases, key=lambda p: p.total)

    def phase(self, name: str) -> Phase:
        return next(p for p in self.phases if p.name == name)

    @property
    def fits(self) -> bool:
        return self.device_total is None or self.peak.total <= self.device_total

    def line(self) -> str:
        """The start-up line: the peak, each phase by part, the device."""
        of = f" of {self.device_total / GiB:.1f} GiB" if self.device_total else " (no GPU: not compared)"
        phases = "; ".join(p.describe() for p in self.phases)
        return f"memory: predicted peak per GPU {self.peak.total / GiB:.1f} GiB in {self.peak.name} ({phases}){of}"


def training_phases(roles: list[Role], shard: int, models: dict[str, tuple[ModelShape, Work]],
                    engine: Engine, overhead: float, device_total: float) -> list[Phase]:
    """The update of each trained role and the no-grad passes, vLLM asleep (or awake:
    engine_in_training). A role's update holds its gradients and its activations (or, with its
    optimizer offloaded, its moments during the step); every role keeps its parameters and resident
    moments. With the engine awake they are the run's peak: PyTorch keeps what training freed cached
    for the next step (no empty_cache), and generation runs in it beside the engine. `models`: each
    trained role's shape and micro-batches (the reference runs the actor's)."""
    resident = {"params": sum(r.param_bytes(shard) for r in roles),
                "optimizer": sum(r.resident_optimizer_bytes(shard) for r in roles)}
    fixed = {**engine_in_training(engine, device_total), "overhead": overhead}
    phases = []
    for role in (r for r in roles if r.trained):
        shape, work = models[role.name]
        activations, step = update_activation_bytes(shape, work), role.optimizer_step_bytes(shard)
        largest = {"activations": activations} if activations >= step else {"optimizer step": step}  # one after the other
        phases.append(Phase(f"{role.name} update", {**resident, "grads": role.grad_bytes(shard), **largest, **fixed}))
    forward = max(forward_activation_bytes(shape, work) for shape, work in models.values())
    phases.append(Phase("log-prob pass", {**resident, "activations": forward, **fixed}))
    return phases


def resident_state_bytes(roles: list[Role], shard: int) -> dict[str, float]:
    """Parameters and the optimizer state kept on the GPU between updates, per GPU: what stays there
    while the engine generates, or what rollout.offload_train_states moves to the host."""
    return {"params": sum(r.param_bytes(shard) for r in roles),
            "optimizer": sum(r.resident_optimizer_bytes(shard) for r in roles)}


def generation_phases(roles: list[Role], shard: int, engine: Engine, device_total: float, offload: bool,
                      overhead: float) -> list[Phase]:
    """The weight sync (training state resident, the engine's weights awake) and generation (the
    engine at its memory share; the training state resident unless offloaded)."""
    state = resident_state_bytes(roles, shard)
    if engine.kind == "hf":
        return [Phase("generation", {**state, "HF engine": engine.weight_bytes, "overhead": overhead})]
    awake = engine_awake_bytes(engine, device_total)  # its share, or its KV cache as rollout.kv_cache_tokens sets it
    asleep = engine_asleep_bytes(engine)  # beside its share: measured awake - asleep = the share
    generation = {"vLLM": awake, **({} if offload else state), "vLLM asleep": asleep, "overhead": overhead}
    phases = [Phase("generation", generation)]
    if offload:
        phases.append(Phase("weight sync", {**state, "vLLM weights": engine.weight_bytes,
                                            "buckets": SYNC_BUCKETS * engine.sync_bucket_bytes,
                                            "vLLM asleep": asleep, "overhead": overhead}))
    return phases


def plan_memory(roles: list[Role], shard: int, models: dict[str, tuple[ModelShape, Work]], engine: Engine,
                device_total: float | None, offload_train_states: bool = False) -> MemoryPlan:
    """Each phase's bytes per GPU. `shard`: the ranks each model is sharded over (trainer.fsdp_size
    or the world); `models`: each trained role's shape and micro-batches ("actor", and "critic"
    if there is one); `device_total`: the device's bytes (None: no GPU; vLLM's share is then
    taken of 80 GiB, only for the line)."""
    overhead = CUDA_CONTEXT_GIB * GiB if device_total else 0.0
    total_for_share = device_total if device_total else 80 * GiB
    phases = training_phases(roles, shard, models, engine, overhead, total_for_share)
    phases += generation_phases(roles, shard, engine, total_for_share, offload_train_states, overhead)
    return MemoryPlan(phases, device_total)


def largest_fitting_share(plan: MemoryPlan, step: float = 0.05) -> float:
    """The largest rollout.gpu_memory_utilization (a multiple of `step`) under which generation
    fits the device (0.0 when none does)."""
    if plan.device_total is None:
        return 1.0
    generation = plan.phase("generation")
    rest = generation.total - generation.parts.get("vLLM", 0.0)
    share = (plan.device_total - rest) / plan.device_total
    return max(0.0, math.floor(share / step + 1e-9) * step)
