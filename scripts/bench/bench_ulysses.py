"""Sequence parallelism (trainer.ulysses_size) on 2 GPUs: the longest sequence one micro-batch of the
actor update fits, and the update's and log-prob pass's tokens/s, at ulysses_size 1 and 2.

    torchrun --nproc-per-node=2 scripts/bench/bench_ulysses.py --arch qwen2-1.5b --out $OUT

One FSDP2 actor over both GPUs (random weights of the preset shape, fp32 masters, bf16 compute,
packed rows, chunked log-probs, gradient checkpointing: the long-response preset's settings),
switched between the sizes (sequence_parallel.apply); the code timed is the trainer's own
(update.ppo_update with actor.actor_loss_fn, actor.compute_logprobs).

1. Throughput: each rank draws `--seqs` rows (prompt 60-120 tokens, response uniform 32..
   `--max-response`), as one mini-batch. ulysses_size 1: each GPU trains its own rows in
   micro-batches of `--budget` tokens; 2: both GPUs share all rows (sequence_parallel.share_rows),
   micro-batches of 2 x `--budget` tokens (the same tokens per GPU), and again of 2 x budget / 2
   (the same micro-batches as size 1, half the tokens per GPU). Best of `--reps` after a warm-up;
   tokens/s per GPU counts every row once.
2. Fit (`--skip-fit` to leave out): one sequence of L tokens (prompt 60-120, the rest response) per
   micro-batch, L doubling from `--fit-start` until the update runs out of memory or passes
   `--fit-max`, then one try at 1.5x the last that fit. ulysses_size 1: each GPU holds its own
   sequence of L tokens; 2: the two GPUs share one. Every rank holds the same rows, so both run out
   of memory at the same step (a rank alone out of memory would leave the other waiting in a
   collective until the command's time limit). Each try prints as it ends and the JSON
   (--out/bench_ulysses.json) is rewritten, so a run cut short keeps what it measured.

About 6 minutes on 2 H100s for 1.5B with the defaults (the 512k-token tries take the longest:
attention grows with the square of the length).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_train import matmul_peak_tflops, rollout_batch, timed  # noqa: E402

from spmd_rl.batching import sequence_parallel  # noqa: E402
from spmd_rl.config.actor import ActorConfig  # noqa: E402
from spmd_rl.model.loading import (  # noqa: E402
    apply_fsdp,
    count_parameters,
    load_causal_lm,
    materialize_random_model,
    random_model_config,
)
from spmd_rl.runtime import sp_groups
from spmd_rl.runtime.distributed import init_distributed  # noqa: E402
from spmd_rl.train.actor import actor_loss_fn, compute_logprobs  # noqa: E402
from spmd_rl.train.optim import make_optimizer  # noqa: E402
from spmd_rl.train.update import ppo_update  # noqa: E402


def update_fn(model, opt, batch, device, max_tokens: int):
    return lambda: ppo_update(model, opt, batch, actor_loss_fn(model, ActorConfig(), 1.0), mini_batch_size=len(batch),
                              micro_batch_size=1, epochs=1, grad_clip=1.0, loss_agg_mode="token-mean", device=device,
                              max_tokens=max_tokens)


def throughput(model, opt, sp, budget: int, args, env, vocab: int, n_params: int, peak: float) -> dict:
    """Update and log-prob pass of the same rows at this size, micro-batches of `budget` tokens per GPU."""
    mine = rollout_batch(args.seqs, vocab, args.max_response, seed=env.rank)
    batch = sequence_parallel.share_rows(mine, len(mine), 0, sp)
    tokens = int(mine["attention_mask"].sum()) * env.world_size  # every row once, all ranks
    row = {"ulysses_size": sp.size, "budget_per_gpu": budget, "micro_batch_tokens": budget * sp.size,
           "tokens": tokens, "longest": int(mine["attention_mask"].sum(-1).max())}
    phases = (("update", update_fn(model, opt, batch, env.device, budget * sp.size), 6),
              ("logprob", lambda: compute_logprobs(model, batch, 1.0, 1, env.device, 2 * budget * sp.size), 2))
    for phase, fn, flops in phases:
        best, mem, err = None, None, None
        for _ in range(args.reps + 1):  # the first is the warm-up
            secs, _, err, m = timed(fn, model, opt)
            if err:
                break
            if best is None or secs < best:
                best, mem = secs, m
        if err:
            row[phase] = {"error": err}
            continue
        row[phase] = {"s": best, "tok_s_gpu": tokens / best / env.world_size, **(mem or {}),
                      "mfu": flops * n_params * tokens / env.world_size / best / (peak * 1e12)}
    return row


def fit(model, opt, sp, args, env, vocab: int, record) -> dict:
    """The longest single sequence an update micro-batch fits at this size (see the module doc)."""
    fits, fits_at, oom, length = 0, None, None, args.fit_start
    tries = []
    while True:
        b = rollout_batch(1, vocab, length, seed=0, fixed_len=length)  # the same row on every rank
        secs, _, err, mem = timed(update_fn(model, opt, b, env.device, 0), model, opt)
        tries.append({"tokens": length, "s": secs, "error": err, **(mem or {})})
        record(tries[-1])
        if err:
            oom = length
        else:
            fits, fits_at = length, tries[-1]
        if err or length >= args.fit_max:
            break
        length = min(2 * length, args.fit_max)
    if fits and oom and int(1.5 * fits) < oom:
        length = int(1.5 * fits) // 1024 * 1024
        b = rollout_batch(1, vocab, length, seed=0, fixed_len=length)
        secs, _, err, mem = timed(update_fn(model, opt, b, env.device, 0), model, opt)
        tries.append({"tokens": length, "s": secs, "error": err, **(mem or {})})
        record(tries[-1])
        if not err:
            fits, fits_at = length, tries[-1]
    return {"ulysses_size": sp.size, "fits_tokens": fits, "oom_tokens": oom, "capped": oom is None,
            "fits_s": fits_at["s"] if fits_at else None,
            "fits_tok_s_gpu": fits / sp.size / fits_at["s"] if fits_at else None,  # L tokens per SP group
            "fits_peak_gib": fits_at.get("peak_gib") if fits_at else None, "tries": tries}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="qwen2-1.5b")
    ap.add_argument("--sizes", default="1,2", help="ulysses sizes, each dividing the world size")
    ap.add_argument("--seqs", type=int, default=8, help="rows per rank of the throughput mini-batch")
    ap.add_argument("--max-response", type=int, default=16384, help="longest response of the throughput rows")
    ap.add_argument("--budget", type=int, default=18432, help="tokens per GPU of an update micro-batch")
    ap.add_argument("--reps", type=int, default=1, help="timed repetitions after one warm-up; the best counts")
    ap.add_argument("--fit-start", type=int, default=32768)
    ap.add_argument("--fit-max", type=int, default=524288)
    ap.add_argument("--skip-fit", action="store_true")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--model-root", default="/tmp/spmd_rl_models")
    ap.add_argument("--out", default="/tmp/bench_ulysses")
    args = ap.parse_args()
    env = init_distributed("auto")
    sizes = [int(s) for s in args.sizes.split(",")]
    if any(env.world_size % s for s in sizes):
        raise SystemExit(f"--sizes {args.sizes}: each must divide the world size {env.world_size}")
    groups = {s: sp_groups.make_groups(s) for s in sizes}  # collective: every rank, every size
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "bench_ulysses.json")
    peak = matmul_peak_tflops(env.device)
    config = random_model_config(args.arch)
    mdir = materialize_random_model(os.path.join(args.model_root, args.arch), config, seed=0, dtype=torch.bfloat16)
    compute = torch.bfloat16 if env.device.type == "cuda" else torch.float32
    model = apply_fsdp(load_causal_lm(mdir, torch.float32, remove_padding=True), env.mesh, compute,
                       gradient_checkpointing=True)
    opt = make_optimizer(model, 1e-6, 0.0, [0.9, 0.999])
    n_params = count_parameters(model)
    res = {"arch": args.arch, "world": env.world_size, "params": n_params, "peak_tflops_measured": peak,
           "device": torch.cuda.get_device_name() if env.device.type == "cuda" else "cpu", "torch": torch.__version__,
           "args": vars(args), "throughput": [], "fit": []}

    def save() -> None:
        if env.is_main:
            with open(path, "w") as f:
                json.dump(res, f, indent=1)

    def say(obj) -> None:
        if env.is_main:
            print(json.dumps(obj), flush=True)

    t0 = time.perf_counter()
    for size in sizes:
        sp = groups[size]
        sequence_parallel.apply(model, sp)
        if not args.skip_throughput:
            budgets = [args.budget] + ([args.budget // size] if size > 1 else [])
            for budget in budgets:
                row = throughput(model, opt, sp, budget, args, env, config.vocab_size, n_params, peak)
                res["throughput"].append(row)
                say(row)
                save()
        if not args.skip_fit:
            row = fit(model, opt, sp, args, env, config.vocab_size,
                      lambda t, size=size: say({"fit_try": size, "seconds_so_far": time.perf_counter() - t0, **t}))
            res["fit"].append(row)
            say({k: v for k, v in row.items() if k != "tries"})
            save()
    save()
    if env.is_main:
        print_table(res, path)
    dist.destroy_process_group()


def print_table(res: dict, path: str) -> None:
    print(f"\nbench_ulysses: {res['arch']} ({res['params'] / 1e9:.2f}B) on {res['device']} x{res['world']}, torch "
          f"{res['torch']}; MFU: 6 (update) or 2 (log-prob) x parameters x tokens / s against the measured bf16 peak "
          f"{res['peak_tflops_measured']:.0f} TFLOP/s (attention FLOPs not counted)")
    if res["throughput"]:
        print(f"{'ulysses':>7} {'tok/GPU/mb':>10} {'mb tokens':>9} | {'update s':>8} {'tok/s/GPU':>9} {'MFU':>6} "
              f"{'peak GiB':>8} | {'logprob s':>9} {'tok/s/GPU':>9} {'MFU':>6} {'peak GiB':>8}")
        for r in res["throughput"]:
            cells = []
            for phase in ("update", "logprob"):
                p = r[phase]
                cells.append(f"{p['error'][:45]:45}" if "error" in p else
                             f"{p['s']:8.2f} {p['tok_s_gpu']:9.0f} {100 * p['mfu']:5.1f}% {p.get('peak_gib', float('nan')):8.1f}")
            print(f"{r['ulysses_size']:>7} {r['budget_per_gpu']:>10} {r['micro_batch_tokens']:>9} | {cells[0]} | {cells[1]}")
        print(f"(rows of {res['throughput'][0]['tokens']} tokens in all, the longest {res['throughput'][0]['longest']})")
    for r in res["fit"]:
        limit = f"out of memory at {r['oom_tokens']}" if r["oom_tokens"] else "the --fit-max cap, not a limit"
        tok_s = f"{r['fits_tok_s_gpu']:.0f} tok/s/GPU" if r["fits_tok_s_gpu"] else "-"
        print(f"ulysses_size {r['ulysses_size']}: the longest sequence one update micro-batch fits: {r['fits_tokens']} "
              f"tokens ({limit}); its update {r['fits_s'] or float('nan'):.1f} s, {tok_s}, peak "
              f"{r['fits_peak_gib'] or float('nan'):.1f} GiB")
    print(f"(json: {path})")


if __name__ == "__main__":
    main()
