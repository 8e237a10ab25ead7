"""Why the end-to-end 1.5B update runs slower than the same update alone (issue 28): the trainer's
`ppo_update` on bench_train's FSDP2 actor, timed in modes that each add one thing the end-to-end
step does and bench_train does not.

    torchrun --standalone --nproc-per-node=1 scripts/probe_update_gap.py --arch qwen2-1.5b --out OUT

The work: --rows rows of exactly --row-len tokens (bench_step's 1.5B rows average 475: 512-token
responses, short prompts), one mini-batch, micro-batches of 16384 tokens, the 1.5B preset's
switches (gradient checkpointing, compiled decoder layers and log-prob head). Modes, interleaved
over --reps rounds after one warm-up, each after an empty allocator cache (as after a vLLM wake):
  bench      old log-probs given with the batch, the allocator's default segments (bench_train)
  own        the on-policy shortcut the trainer takes (old_logprobs.UpdateLogprobs: the update's
             forward gives the old log-probs, copied to the host per micro-batch)
  bench+exp  bench with expandable segments (the trainer's allocator setting outside vLLM)
  own+exp    both
Prints each run and a summary (best, mean, MFU against the bf16 matmul peak measured here); writes
OUT/probe_update_gap_<arch>.json. Measured 2026-11-25 (1xH100): all four 7.2-7.5 s at 39% MFU for
243,200 tokens, against 8.5-9.0 s for the update inside bench_step's step (docs/performance.md).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import torch

SCRIPTS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(SCRIPTS))
sys.path.insert(0, SCRIPTS)

import bench_train  # noqa: E402
from spmd_rl.actor import actor_loss_fn  # noqa: E402
from spmd_rl.config import ActorConfig, AlgorithmConfig  # noqa: E402
from spmd_rl.distributed import init_distributed  # noqa: E402
from spmd_rl.gpu_memory import set_expandable_segments  # noqa: E402
from spmd_rl.models import (apply_fsdp, count_parameters, load_causal_lm, materialize_random_model,  # noqa: E402
                            random_model_config)
from spmd_rl.old_logprobs import UpdateLogprobs  # noqa: E402
from spmd_rl.optim import make_optimizer  # noqa: E402
from spmd_rl.update import ppo_update  # noqa: E402

MODES = ("bench", "own", "bench+exp", "own+exp")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="qwen2-1.5b")
    ap.add_argument("--row-len", type=int, default=475, help="tokens of every row (prompt 60-120 + response)")
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--budget", type=int, default=16384, help="tokens per update micro-batch")
    ap.add_argument("--reps", type=int, default=3, help="rounds over the modes after the warm-up")
    ap.add_argument("--variant", default="packed-compile-headcompile", help="a bench_train variant")
    ap.add_argument("--model-root", default="/tmp/spmd_rl_models")
    ap.add_argument("--out", default="/tmp/probe_update_gap")
    args = ap.parse_args()
    env = init_distributed("auto")
    cuda = env.device.type == "cuda"
    peak = bench_train.matmul_peak_tflops(env.device)
    config = random_model_config(args.arch)
    mdir = materialize_random_model(os.path.join(args.model_root, args.arch), config, seed=0, dtype=torch.bfloat16)
    model = apply_fsdp(load_causal_lm(mdir, torch.float32), env.mesh, torch.bfloat16 if cuda else torch.float32,
                       gradient_checkpointing=True)
    bench_train.set_variant(model, *bench_train.VARIANTS[args.variant])
    opt = make_optimizer(model, 1e-6, 0.0, [0.9, 0.999])
    batch = bench_train.rollout_batch(args.rows, config.vocab_size, 512, seed=env.rank, fixed_len=args.row_len)
    tokens, n_params = int(batch["attention_mask"].sum()), count_parameters(model)

    def run(mode: str) -> float:
        own = UpdateLogprobs(batch, AlgorithmConfig()) if mode.startswith("own") else None
        set_expandable_segments(mode.endswith("+exp"))
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.synchronize()
        t = time.perf_counter()
        ppo_update(model, opt, batch if own is None else own.batch, actor_loss_fn(model, ActorConfig(), 1.0, own),
                   mini_batch_size=len(batch), micro_batch_size=16, epochs=1, grad_clip=1.0,
                   loss_agg_mode="token-mean", device=env.device, max_tokens=args.budget)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t

    def mfu(seconds: float) -> float:
        return 100 * 6 * n_params * tokens / seconds / (peak * 1e12)

    print(f"{args.arch} {args.variant}: {tokens} tokens in {args.rows} rows, bf16 peak {peak:.0f} TFLOP/s", flush=True)
    print(f"warm-up {run('bench'):.2f} s", flush=True)
    times: dict[str, list[float]] = {m: [] for m in MODES}
    for _ in range(args.reps):
        for mode in MODES:
            times[mode].append(run(mode))
            print(f"{mode:10s} {times[mode][-1]:.2f} s  MFU {mfu(times[mode][-1]):.1f}%", flush=True)
    for mode, ts in times.items():
        print(f"SUMMARY {mode:10s} best {min(ts):.2f} s, mean {sum(ts) / len(ts):.2f} s, MFU (best) {mfu(min(ts)):.1f}%")
    if env.is_main:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"probe_update_gap_{args.arch}.json"), "w") as f:
            json.dump({"arch": args.arch, "tokens": tokens, "peak_tflops": peak, "seconds": times}, f, indent=1)


if __name__ == "__main__":
    main()
