"""Tuned configs for vLLM's LoRA kernels: shipped per GPU and model shape, used with the adapter sync where
the engine runs vLLM's kernels (rollout.lora_matmul off, or vLLM compiling its model; by default the adapter
goes through cuBLAS matmuls instead: lora_matmul.py).

vLLM applies an adapter with two Triton kernels per adapted layer (shrink, expand). It looks each call's
tile config up in the folder VLLM_TUNED_CONFIG_FOLDER names (`{GPU}_SHRINK.json`, `{GPU}_EXPAND_TRUE.json`,
the GPU's name with spaces and dashes as underscores), keyed [max_loras][num_slices][tokens][k][n]: the
number of slices must be a key, each other level takes the nearest key where none is equal. It reads the
files once per process, when a kernel first runs (the engine's profile run), so setting the variable before
the engine is built is enough. Without the folder it takes one default config for every shape, which at a 7B
decode step can cost more than the base layers (docs/performance-details.md, "LoRA kernels").

`lora_kernel_configs/` holds the configs `scripts/bench/tune_lora_kernels.py` found for a model shape on a
GPU, one GPU per engine. `choose` points vLLM at them before the engine is built only where every kernel
call of the model's decoder layer (q/k/v, o, gate/up, down at its hidden, attention and MLP widths and the
engine's LoRA rank) has its own entry for this GPU at every tuned token count: by nearest key vLLM would
take configs tuned at another shape too, which could be slower there than its default. Not with tensor
parallelism (which splits the layers into other shapes), nor for a mixture of experts (with the folder set,
vLLM's MoE LoRA layers look their configs up in it too, in place of their own choice, and none ship). A
folder the user set always wins. The start-up line says which configs the engine uses.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

FOLDER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lora_kernel_configs")
ENV = "VLLM_TUNED_CONFIG_FOLDER"
MAX_LORAS = 2
"""vLLM's `max_loras` key as the engine's kernels see it: its one adapter (engine_kwargs' max_loras=1) plus
the no-adapter slot (lora_ids has max_loras + 1 entries)."""
TUNE = ("python scripts/bench/tune_lora_kernels.py --arch ARCH --rank R --out DIR, then run with "
        f"{ENV}=DIR (docs/lora.md, \"LoRA kernels\")")


def file_prefix(device_name: str) -> str:
    """The GPU's part of vLLM's config file names ("NVIDIA H200" -> "NVIDIA_H200")."""
    return device_name.replace(" ", "_").replace("-", "_")


@dataclass(frozen=True)
class LoraLinear:
    """One adapted linear layer as one rank's LoRA kernels see it."""

    name: str
    in_features: int  # what shrink reads (this rank's share for a row-parallel layer)
    outs: tuple[int, ...]  # each slice's outputs expand writes (this rank's share for a column-parallel layer)


@dataclass(frozen=True)
class KernelCall:
    """A shrink or expand call: the key vLLM's get_lora_op_configs looks its config up by."""

    op: str  # "shrink" or "expand"
    num_slices: int
    m: int  # tokens
    k: int  # shrink: the layer's input; expand: the rank
    n: int  # shrink: the rank; expand: the widest slice's outputs
    outs: tuple[int, ...] = ()  # expand: each slice's outputs (what it writes; not part of the key)

    def key(self) -> tuple[str, str, str, str]:
        return str(self.num_slices), str(self.m), str(self.k), str(self.n)


def lora_linears(config: dict, tp: int) -> list[LoraLinear]:
    """A dense decoder layer's adapted linear layers on one of `tp` tensor-parallel ranks, from its
    config.json (text config): q/k/v (3 slices), o, gate/up (2 slices), down, as vLLM's LoRA layers
    slice them (column-parallel layers split their outputs, row-parallel ones their inputs)."""
    hidden, inter, heads = config["hidden_size"], config["intermediate_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    q, kv = heads * head_dim, (config.get("num_key_value_heads") or heads) * head_dim
    if q % tp or kv % tp or inter % tp:
        raise ValueError(f"heads ({heads} x {head_dim}), kv heads ({kv // head_dim}) or intermediate ({inter}) "
                         f"do not split over {tp} ranks")
    return [LoraLinear("qkv", hidden, (q // tp, kv // tp, kv // tp)), LoraLinear("o", q // tp, (hidden,)),
            LoraLinear("gate_up", hidden, (inter // tp, inter // tp)), LoraLinear("down", inter // tp, (hidden,))]


def kernel_calls(linears: list[LoraLinear], rank: int, batches: tuple[int, ...]) -> list[KernelCall]:
    """Every distinct shrink and expand call the layers make at each batch size (tokens per call)."""
    calls: dict[tuple, KernelCall] = {}
    for m in batches:
        for layer in linears:
            for call in (KernelCall("shrink", len(layer.outs), m, layer.in_features, rank),
                         KernelCall("expand", len(layer.outs), m, rank, max(layer.outs), layer.outs)):
                calls.setdefault((call.op, *call.key()), call)
    return list(calls.values())


def kernel_keys(config: dict, rank: int) -> dict[str, set[tuple[str, str, str]]]:
    """The (num_slices, k, n) keys of a dense decoder layer's shrink and expand calls at one GPU per engine."""
    keys: dict[str, set[tuple[str, str, str]]] = {"shrink": set(), "expand": set()}
    for call in kernel_calls(lora_linears(config, 1), rank, (0,)):
        slices, _, k, n = call.key()
        keys[call.op].add((slices, k, n))
    return keys


def tuned_for(folder: str, device_name: str, config: dict, rank: int) -> bool:
    """Whether `folder`'s files for this GPU hold an entry of the model's own shape (kernel_keys) for every
    kernel call at every token count they hold: vLLM's nearest-key lookup then never lands on another shape."""
    try:
        keys = kernel_keys(config, rank)
    except KeyError:  # not a dense decoder's config.json
        return False
    for op, name in (("shrink", "SHRINK"), ("expand", "EXPAND_TRUE")):
        path = os.path.join(folder, f"{file_prefix(device_name)}_{name}.json")
        if not os.path.exists(path):
            return False
        with open(path) as f:
            by_slices = json.load(f).get(str(MAX_LORAS), {})
        for slices, k, n in keys[op]:
            by_m = by_slices.get(slices)
            if not by_m or any(n not in by_k.get(k, {}) for by_k in by_m.values()):
                return False
    return True


def choose(device_name: str, config: dict, rank: int, tp: int = 1, environ=os.environ) -> str:
    """Point vLLM at the shipped configs (sets `environ[ENV]`) where they were tuned for this GPU and the
    model's shape (`config`: its config.json's text config; `rank`: vLLM's max_lora_rank; `tp`: the engine's
    tensor-parallel size) and the user named no folder; returns the start-up line's words for what the
    engine uses."""
    if environ.get(ENV):
        return f"LoRA kernels: the configs in {ENV}={environ[ENV]}"
    if tp > 1:
        return (f"LoRA kernels: vLLM's default configs (the shipped ones are for one GPU per engine; to tune "
                f"them for tensor parallelism {tp}: {TUNE.replace('--out DIR', f'--tp {tp} --out DIR')})")
    from spmd_rl.runtime.memory_plan import experts_of

    if experts_of(config):
        return ("LoRA kernels: vLLM's default configs (a mixture of experts: the shipped configs are for dense "
                "models, and vLLM picks its MoE LoRA configs itself without a folder)")
    shape = f"hidden size {config.get('hidden_size')}, rank {rank}"
    if tuned_for(FOLDER, device_name, config, rank):
        environ[ENV] = FOLDER
        return f"LoRA kernels: configs tuned for {device_name}, {shape} (spmd_rl/rollout/vllm/lora_kernel_configs)"
    return (f"LoRA kernels: vLLM's default configs (none ship for {device_name} at this model's shape, {shape}; "
            f"to tune them: {TUNE})")
