"""Tuned configs for vLLM's LoRA kernels: shipped per GPU and model shape, used by default with the adapter sync.

vLLM applies an adapter with two Triton kernels per adapted layer (shrink, expand). It looks each call's
tile config up in the folder VLLM_TUNED_CONFIG_FOLDER names (`{GPU}_SHRINK.json`, `{GPU}_EXPAND_TRUE.json`,
the GPU's name with spaces and dashes as underscores, keyed [max_loras][num_slices][tokens][k][n], the
nearest key where none is equal), read once per process when a kernel first runs; without the folder it
takes one default config for every shape, which at a 7B decode step can cost more than the base layers
(docs/performance-details.md, "LoRA kernels").

`lora_kernel_configs/` holds the configs `scripts/bench/tune_lora_kernels.py` found for a model shape on a
GPU, one GPU per engine. `choose` points vLLM at them before the engine is built when they were tuned for
this GPU, this hidden size and this rank, and the engine has no tensor parallelism (which splits the
layers into other shapes): a nearest key of another shape is not a tuned config, and could be slower than
vLLM's default. A folder the user set always wins. The start-up line says which configs the engine uses.
"""

from __future__ import annotations

import json
import os

FOLDER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lora_kernel_configs")
ENV = "VLLM_TUNED_CONFIG_FOLDER"
TUNE = ("python scripts/bench/tune_lora_kernels.py --arch ARCH --rank R --out DIR, then run with "
        f"{ENV}=DIR (docs/lora.md, \"LoRA kernels\")")


def file_prefix(device_name: str) -> str:
    """The GPU's part of vLLM's config file names ("NVIDIA H200" -> "NVIDIA_H200")."""
    return device_name.replace(" ", "_").replace("-", "_")


def tuned_for(folder: str, device_name: str, hidden_size: int, rank: int) -> bool:
    """Whether `folder`'s shrink configs for this GPU hold the shape: an entry with k = hidden_size
    (the input of the q/k/v and gate/up layers) and n = rank (vLLM's max_lora_rank)."""
    path = os.path.join(folder, f"{file_prefix(device_name)}_SHRINK.json")
    if not os.path.exists(path):
        return False
    with open(path) as f:
        data = json.load(f)
    return any(str(rank) in by_k.get(str(hidden_size), {})
               for by_slices in data.values() for by_m in by_slices.values() for by_k in by_m.values())


def choose(device_name: str, hidden_size: int, rank: int, tp: int = 1, environ=os.environ) -> str:
    """Point vLLM at the shipped configs (sets `environ[ENV]`) where they were tuned for this GPU and
    shape (`tp`: the engine's tensor-parallel size) and the user named no folder; returns the start-up
    line's words for what the engine uses."""
    if environ.get(ENV):
        return f"LoRA kernels: the configs in {ENV}={environ[ENV]}"
    if tp > 1:
        return (f"LoRA kernels: vLLM's default configs (the shipped ones are for one GPU per engine; to tune "
                f"them for tensor parallelism {tp}: {TUNE.replace('--out DIR', f'--tp {tp} --out DIR')})")
    if tuned_for(FOLDER, device_name, hidden_size, rank):
        environ[ENV] = FOLDER
        return (f"LoRA kernels: configs tuned for {device_name}, hidden size {hidden_size}, rank {rank} "
                "(spmd_rl/rollout/vllm/lora_kernel_configs)")
    return (f"LoRA kernels: vLLM's default configs (none ship for {device_name} at hidden size {hidden_size}, "
            f"rank {rank}; to tune them: {TUNE})")
