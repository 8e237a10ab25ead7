"""Tuned configs for vLLM's LoRA kernels (shrink and expand) at one model's shapes, on this GPU.

vLLM applies an adapter with two Triton kernels per adapted linear layer: shrink (x @ A, down to the rank)
and expand (@ B, added to the layer's output). Without tuned configs it takes one default tile size for
every shape (its log: "Using default LoRA kernel configs"), which at a 7B decode step can cost more than
the base layers' own GEMMs (docs/performance-details.md, "LoRA kernels"). vLLM reads tuned
configs from the folder VLLM_TUNED_CONFIG_FOLDER names: `{GPU}_SHRINK.json` and `{GPU}_EXPAND_TRUE.json`
(vllm/lora/ops/triton_ops/README_TUNING.md), keyed [max_loras][num_slices][m][k][n], the nearest key
taken where there is no exact one. This times each kernel call a model makes, for each batch size, over
a grid of configs, keeps the fastest (vLLM's default kept where nothing beats it) and writes the two
files. Needs a GPU and vLLM.

    python scripts/bench/tune_lora_kernels.py --arch qwen2-7b --rank 32 --out DIR [--tp 2]
    VLLM_TUNED_CONFIG_FOLDER=DIR bash scripts/bench/bench_step.sh ...      (use them)

The engine uses the files in spmd_rl/rollout/vllm/lora_kernel_configs/ by default where they were tuned
for its GPU and shape (spmd_rl/rollout/vllm/lora_kernels.py): add a new GPU's or shape's entries there.

The adapted layers are a decoder layer's q/k/v (one call of 3 slices), o, gate/up (2 slices) and down,
as vLLM's LoRA layers slice them over tensor parallelism: a column-parallel layer (q/k/v, gate/up)
shrinks the whole input and expands to its share of the outputs, a row-parallel one (o, down) shrinks
its share of the input and expands to the whole output.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

# the kernel calls, as the engine checks its shipped files for them
from spmd_rl.rollout.vllm.lora_kernels import MAX_LORAS, KernelCall, file_prefix, kernel_calls, lora_linears  # noqa: E402

BATCHES = (16, 64, 128, 256, 512, 8192)
"""Tokens per kernel call tuned by default: decode batches (CUDA-graph sizes up to vLLM's 512 sequences)
and a prefill chunk (rollout.max_num_batched_tokens)."""

SHRINK_GRID = [dict(block_m=bm, block_n=bn, block_k=bk, split_k=sk, num_warps=w, num_ctas=1, num_stages=s,
                    group_size_m=8, max_nreg=None)
               for bm, bn, bk, sk, w, s in itertools.product((16, 32, 64), (16, 32), (32, 128), (1, 4, 8), (4,), (2,))]
EXPAND_GRID = [dict(block_m=bm, block_n=bn, block_k=bk, num_warps=w, num_ctas=1, num_stages=s, max_nreg=None)
               for bm, bn, bk, w, s in itertools.product((32, 64, 128), (64, 128), (16, 32), (4,), (2,))]


def nested(best: dict[KernelCall, dict], op: str) -> dict:
    """vLLM's file layout for `op`: {max_loras: {num_slices: {m: {k: {n: config}}}}} (string keys)."""
    out: dict = {}
    for call, config in best.items():
        if call.op != op:
            continue
        slices, m, k, n = call.key()
        out.setdefault(str(MAX_LORAS), {}).setdefault(slices, {}).setdefault(m, {}).setdefault(k, {})[n] = {
            key: value for key, value in config.items() if value is not None}
    return out


def file_names(gpu_name: str) -> dict[str, str]:
    """The file of each op vLLM's load_lora_op_config reads (lora_kernels.file_prefix; expand's
    add_inputs is True in the LoRA layers' calls)."""
    gpu = file_prefix(gpu_name)
    return {"shrink": f"{gpu}_SHRINK.json", "expand": f"{gpu}_EXPAND_TRUE.json"}


def time_call(call: KernelCall, config: dict | None) -> float:  # pragma: no cover (GPU)
    """Microseconds of one call with `config` (None: vLLM's default), inf where the kernel refuses it."""
    import torch
    import triton
    from vllm.lora.ops.triton_ops import lora_expand_op, lora_shrink_op
    from vllm.lora.ops.triton_ops.lora_kernel_metadata import LoRAKernelMeta

    dev, dt = torch.device("cuda"), torch.bfloat16
    meta = LoRAKernelMeta.make(max_loras=MAX_LORAS - 1, max_num_tokens=call.m, device=dev)
    meta.prepare_tensors(torch.zeros(call.m, dtype=torch.int32, device=dev))
    args = meta.meta_args(call.m, specialize_active_lora=False)
    if call.op == "shrink":
        module = lora_shrink_op
        x = torch.randn(call.m, call.k, device=dev, dtype=dt)
        a = [torch.randn(1, call.n, call.k, device=dev, dtype=dt) * 0.01 for _ in range(call.num_slices)]
        out = torch.zeros(call.num_slices, call.m, call.n, device=dev, dtype=torch.float32)
        run = lambda: lora_shrink_op._lora_shrink(x, a, out, *args, 1.0)  # noqa: E731
    else:
        module = lora_expand_op
        mid = torch.randn(call.num_slices, call.m, call.k, device=dev, dtype=torch.float32)
        b = [torch.randn(1, n, call.k, device=dev, dtype=dt) * 0.01 for n in call.outs]
        y = torch.zeros(call.m, sum(call.outs), device=dev, dtype=dt)
        run = lambda: lora_expand_op._lora_expand(mid, b, y, *args, 0, True)  # noqa: E731
    default = module.get_lora_op_configs
    if config is not None:
        module.get_lora_op_configs = lambda *a, **k: config
    try:
        return triton.testing.do_bench(run, warmup=10, rep=50) * 1e3
    except Exception:  # a config the kernel cannot take (shared memory, K % split)
        return float("inf")
    finally:
        module.get_lora_op_configs = default


def tune(calls: list[KernelCall]) -> tuple[dict[KernelCall, dict], list[tuple[KernelCall, float, float]]]:  # pragma: no cover
    """The fastest config of each call (vLLM's default where none beats it) and (call, default us, best us)."""
    from vllm.lora.ops.triton_ops.utils import get_lora_op_configs

    best, rows = {}, []
    for call in calls:
        default_config = get_lora_op_configs.__wrapped__(call.op, MAX_LORAS, call.m, call.k if call.op == "shrink"
                                                         else call.n, call.n if call.op == "shrink" else call.k,
                                                         call.num_slices, add_inputs=call.op == "expand" or None)
        default_us = time_call(call, None)
        grid = SHRINK_GRID if call.op == "shrink" else EXPAND_GRID
        timed = [(time_call(call, c), i) for i, c in enumerate(grid)]
        us, i = min(timed)
        best[call] = grid[i] if us < default_us else default_config
        rows.append((call, default_us, min(us, default_us)))
        print(f"{call.op:6s} slices={call.num_slices} m={call.m:5d} k={call.k:6d} n={call.n:6d}: default "
              f"{default_us:8.1f} us, tuned {min(us, default_us):8.1f} us", flush=True)
    return best, rows


def main(argv: list[str] | None = None) -> None:  # pragma: no cover (GPU)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", required=True, help="a spmd_rl.model.loading.ARCH_PRESETS shape, e.g. qwen2-7b")
    ap.add_argument("--rank", type=int, default=32, help="the adapter's rank (vLLM pads to its max_lora_rank)")
    ap.add_argument("--tp", type=int, default=1, help="rollout.tensor_parallel_size")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)), help="tokens per call to tune, comma-separated")
    ap.add_argument("--out", required=True, help="the folder for VLLM_TUNED_CONFIG_FOLDER")
    args = ap.parse_args(argv)
    import torch

    from spmd_rl.model.loading import preset_config
    from spmd_rl.model.lora import vllm_max_lora_rank

    linears = lora_linears(preset_config(args.arch).to_dict(), args.tp)
    best, rows = tune(kernel_calls(linears, vllm_max_lora_rank(args.rank), tuple(map(int, args.batches.split(",")))))
    os.makedirs(args.out, exist_ok=True)
    for op, name in file_names(torch.cuda.get_device_name()).items():
        with open(os.path.join(args.out, name), "w") as f:
            json.dump(nested(best, op), f, indent=1)
    for m in sorted({call.m for call, _, _ in rows}):
        default = sum(d for call, d, _ in rows if call.m == m)
        tuned = sum(t for call, _, t in rows if call.m == m)
        print(f"m={m}: a decoder layer's LoRA kernels {default:.0f} us with vLLM's defaults, {tuned:.0f} us tuned")
    print(f"wrote {', '.join(file_names(torch.cuda.get_device_name()).values())} to {args.out}")


if __name__ == "__main__":
    main()
