"""[model]: the policy model, its precision, and how its training side runs (packing, checkpointing,
fused kernels). The preset and the files it names are checked in spmd_rl/preflight/models.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from spmd_rl.config.checks import AUTO, Auto, Rule, need

if TYPE_CHECKING:
    from spmd_rl.config.run_config import Config

CHOICES: dict[str, tuple[str, ...]] = {
    "init": ("pretrained", "random"),
    "dtype": ("float32", "bfloat16"),
    "compute_dtype": ("float32", "bfloat16"),
    "attn_implementation": ("sdpa", "eager"),
    "fused_kernels": ("none", "liger", "compile"),
    "fused_logprob_head": ("none", "compile"),
    "lora_sync": ("adapter", "merged"),
}
"""Each key that takes one of a few values: its values (checked by Config.check_choices)."""


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
    tiny, tiny-lora (tiny for a LoRA adapter on CPU), small, qwen2-0.5b, qwen2-1.5b, qwen2-7b, qwen3-0.6b, qwen3-8b, llama3.1-8b, llama3.2-1b,
    gemma3-1b, qwen3-moe-tiny and glm4-moe-lite-tiny (mixtures of experts on CPU), qwen3-30b-a3b, qwen3-30b-a3b-4layers,
    glm-4.7-flash-4layers (the real models' shapes; see spmd_rl/model/loading.py ARCH_PRESETS)."""
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
    gradient_checkpointing: bool | Auto = False
    """Recompute activations in backward (saves memory on long responses). "auto": off where the
    memory plan predicts the update fits without it, else on (the speed settings chosen at start:
    docs/training.md, "Speed settings chosen at start"); without a GPU, false."""
    gradient_checkpointing_layers: float | Auto = 1.0
    """With `gradient_checkpointing`: the share of the decoder layers that recompute, spread evenly
    over the stack (0.5: every other layer); the others keep their activations for backward. Less
    is faster and takes more memory: lower it as far as the update's peak still fits (the speed and
    peak at 1.0, 0.5 and none: docs/performance.md, "Why the defaults are what they are").
    Applies to actor and critic (the reference model has no backward). 1.0 = every layer. "auto":
    where checkpointing is on, the smallest share of preflight.speed_settings.CHECKPOINT_SHARES the
    memory plan predicts to fit; 1.0 where it is off or without a GPU. With `gradient_checkpointing
    = "auto"` a share set here is the one used where "auto" turns checkpointing on."""
    seed: int = 0
    """Seed for random weights (`init = "random"`) and the critic's value head."""
    remove_padding: bool = False
    """Pack each micro-batch's sequences into one row without padding, for actor, reference and
    critic, forward and backward: position ids restart per sequence and attention stays within a
    sequence (PyTorch's variable-length FlashAttention kernel on CUDA, per-sequence SDPA on CPU).
    No compute or memory goes to padding; needed for the token budgets (`*.max_token_len_per_gpu`)."""
    share_prompts: bool = False
    """Feed each prompt once per packed micro-batch, followed by the responses that begin with it
    (a GRPO group's n), instead of once per response: each response attends to that one copy, with
    the positions, log-probs and values it had whole (spmd_rl/batching/shared_prompts.py). The updates
    and the no-grad passes of actor, reference and critic skip the prompt's n - 1 repeats; the token
    budgets count a shared prompt once. Needs `remove_padding`; not with sequence parallelism
    (trainer.ulysses_size > 1). What it saves: docs/performance.md."""
    chunked_logprobs: bool = True
    """Compute token log-probs and entropy from the last hidden states in chunks, never holding the
    [tokens, vocab] float32 logits (6 GB for 10k tokens of a 152k vocabulary); backward recomputes
    each chunk. false = the plain full-logits path (more memory; kept for comparison)."""
    fsdp_forward_prefetch: bool = False
    """FSDP2: each decoder layer starts the all-gather of the next one explicitly in forward."""
    fused_kernels: str = "none"
    """Fused kernels in the decoder layers of actor, reference and critic (spmd_rl/model/fused_kernels.py).
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
    lora_rank: int = 0
    """LoRA (PEFT's, spmd_rl/model/lora.py): the rank of the adapter trained on the actor instead of
    its weights; 0 = off (full fine-tuning). The base weights stay frozen in `compute_dtype`, the
    adapter in `dtype` (the optimizer holds the adapter only); the reference model is the actor with
    its adapter disabled; checkpoints hold the adapter and its optimizer (the base is read from
    `path` on resume). The critic (algorithm.adv_estimator = "gae") is trained in full. On a pretrained
    model LoRA usually wants about 10x full fine-tuning's `actor.lr` (the start-up line says so; the
    value is never changed); on the CPU default job use `arch = "tiny-lora"` (docs/lora.md). Needs the `lora` extra (pip install -e '.[lora]': peft)."""
    lora_alpha: float = 32.0
    """With `lora_rank` > 0: LoRA's alpha; the adapter's update is scaled by lora_alpha / lora_rank."""
    lora_target_modules: list[str] = field(default_factory=list)
    """With `lora_rank` > 0: the names of the decoder's linear layers that get an adapter (e.g.
    ["q_proj", "v_proj"]); empty or ["all-linear"] = every linear layer of the decoder, attention
    and MLP (of a mixture of experts: the attention; its fused experts and router are not linear
    layers, docs/moe.md). The embeddings and the LM head are never adapted (vLLM cannot apply LoRA
    to them for Qwen), and stay frozen."""
    lora_dropout: float = 0.0
    """With `lora_rank` > 0: dropout on the adapter's input. Only 0 is taken: every dropout is off
    here, as the PPO ratio compares log-probs of two forwards of the same weights."""
    lora_sync: str = "adapter"
    """With `lora_rank` > 0: how the adapter reaches the rollout engine. "adapter": the engine gets
    the base weights once and keeps them (in host memory while it sleeps: rollout.sleep_level 1),
    and each step only the adapter's A and B, applied by vLLM's LoRA layers (`enable_lora`).
    "merged": each step the engine gets W + (alpha / r) * B @ A, computed in float32, as full weights
    in the engine's dtype: generation runs without LoRA layers, but in bf16 an update smaller than
    half a bf16 step of W is rounded away, so after small-learning-rate updates the engine keeps
    sampling the older policy (tests/rollout/test_lora_sync.py). The measurement behind the default:
    docs/performance.md, "LoRA: adapter or merged sync"."""

    def check_source(self) -> None:
        """Where the starting weights come from: model.path, or for random weights a preset or a
        config.json (that the preset exists: preflight.models.check_arch)."""
        if self.init == "pretrained":
            need(bool(self.path), 'model.path is empty: set it to a local model directory, or use model.init = "random" with model.arch')
        else:
            need(bool(self.path) or bool(self.arch), 'model.init = "random" needs model.arch (a preset) or model.path (a config.json)')

    def check(self) -> None:
        """The model keys together (the files they name: preflight.models.check_model_files)."""
        if self.init != "pretrained":
            need(bool(self.tokenizer) or bool(self.path),
                  'model.init = "random" with a preset arch needs model.tokenizer (a directory, or "char")')
        need(self.gradient_checkpointing or self.gradient_checkpointing_layers in (1.0, AUTO),
              f"model.gradient_checkpointing_layers = {self.gradient_checkpointing_layers} needs "
              "model.gradient_checkpointing = true (without it no layer is checkpointed)")
        need(self.fused_logprob_head == "none" or self.chunked_logprobs,
              f"model.fused_logprob_head = {self.fused_logprob_head!r} fuses the chunked log-prob head: set "
              "model.chunked_logprobs = true, or model.fused_logprob_head = \"none\"")
        need(not self.share_prompts or self.remove_padding,
              "model.share_prompts = true feeds prompts once in packed rows: set model.remove_padding = true, or "
              "model.share_prompts = false")

        if self.lora_rank:
            self.check_lora()

    def check_lora(self) -> None:
        """The LoRA keys together (PEFT, vLLM's largest rank and the target names against the model:
        preflight.models.check_lora_support, check_lora_targets)."""
        adapted = {"embed_tokens", "lm_head"} & set(self.lora_target_modules)
        need(not adapted, f"model.lora_target_modules names {', '.join(sorted(adapted))}: the embeddings and the LM "
              "head are not adapted (vLLM cannot apply LoRA to them); list decoder linear layers, or [] for all")

    @property
    def use_lora(self) -> bool:
        return self.lora_rank > 0

    @property
    def adapter_sync(self) -> bool:
        """Whether the engine gets the base once and the adapter each step (lora_sync = "adapter")."""
        return self.use_lora and self.lora_sync == "adapter"

    def ranges(self, cfg: Config) -> list[Rule]:
        return [("seed", self.seed >= 0, ">= 0"),
                ("lora_rank", self.lora_rank >= 0, ">= 1 for LoRA, or 0 for full fine-tuning"),
                ("lora_alpha", self.lora_alpha > 0, "> 0"),
                ("lora_dropout", self.lora_dropout == 0, "0: it is not supported, every dropout is off (the PPO "
                 "ratio compares two forwards of the same weights)"),
                ("gradient_checkpointing_layers",
                 self.gradient_checkpointing_layers == AUTO or 0 < self.gradient_checkpointing_layers <= 1,
                 'in (0, 1], or "auto"')]

    def checkpointed_share(self) -> float:
        """The share of decoder layers the actor and critic checkpoint (0: none)."""
        return self.gradient_checkpointing_layers if self.gradient_checkpointing else 0.0
