"""Why the end-to-end 1.5B update runs slower than the same update alone: the trainer's
`ppo_update` on bench_train's FSDP2 actor, timed in modes that each add one thing the end-to-end
step does and bench_train does not.

    torchrun --standalone --nproc-per-node=1 scripts/probes/probe_update_gap.py --arch qwen2-1.5b --out OUT

The work: --rows rows of exactly --row-len tokens (bench_step's 1.5B rows average 475: 512-token
responses, short prompts), one mini-batch, micro-batches of 16384 tokens, the 1.5B preset's
switches (gradient checkpointing, compiled decoder layers and log-prob head). Modes, interleaved
over --reps rounds after one warm-up, each after an empty allocator cache (as after a vLLM wake):
  bench      old log-probs given with the batch, the allocator's default segments (bench_train)
  own        the on-policy shortcut the trainer takes (old_logprobs.UpdateLogprobs: the update's
             forward gives the old log-probs, copied to the host per micro-batch)
  bench+exp  bench with expandable segments (the trainer's allocator setting outside vLLM)
  own+exp    both
With --with-engine the process first does what the trainer does before its update: it builds
spmd_rl's colocated vLLM engine (bench_step's settings, before anything is compiled), gives it the
actor's weights, generates bench_step's rollout (64 prompts x 8 samples x 512 tokens) and puts it
to sleep; the modes then run beside the sleeping engine. The same modes with and without it, in one
call, tell whether the engine's presence in the process is what slows the step's update.
Prints each run and a summary (best, mean, MFU against the bf16 matmul peak measured here); writes
OUT/probe_update_gap_<arch>[_engine].json. Measured 2026-11-25 (1xH100): all four 7.2-7.5 s at 39% MFU for
243,200 tokens, against 8.5-9.0 s for the update inside bench_step's step (docs/performance.md,
"Update MFU").
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
sys.path.insert(0, os.path.dirname(os.path.dirname(SCRIPTS)))
sys.path.insert(0, os.path.join(os.path.dirname(SCRIPTS), "bench"))  # bench_train

import bench_train  # noqa: E402

from spmd_rl.config.actor import ActorConfig  # noqa: E402
from spmd_rl.config.algorithm import AlgorithmConfig
from spmd_rl.model.loading import (  # noqa: E402
    apply_fsdp,
    count_parameters,
    load_causal_lm,
    materialize_random_model,
    random_model_config,
)
from spmd_rl.runtime.distributed import init_distributed  # noqa: E402
from spmd_rl.runtime.gpu_memory import set_expandable_segments  # noqa: E402
from spmd_rl.train.actor import actor_loss_fn  # noqa: E402
from spmd_rl.train.old_logprobs import UpdateLogprobs  # noqa: E402
from spmd_rl.train.optim import make_optimizer  # noqa: E402
from spmd_rl.train.update import ppo_update  # noqa: E402

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
    ap.add_argument("--with-engine", action="store_true",
                    help="build, use and put to sleep the colocated vLLM engine first (as the step does)")
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
    engine = sleeping_engine(args, env, model, mdir) if args.with_engine else None
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
        name = f"probe_update_gap_{args.arch}{'_engine' if engine is not None else ''}.json"
        with open(os.path.join(args.out, name), "w") as f:
            json.dump({"arch": args.arch, "tokens": tokens, "peak_tflops": peak, "seconds": times,
                       "with_engine": engine is not None}, f, indent=1)
    if engine is not None:
        engine.close()


def sleeping_engine(args, env, model, model_dir: str):
    """spmd_rl's VLLMEngine with bench_step's settings, after one rollout of bench_step's work with
    the actor's weights (EOS ignored: random weights), asleep as during the step's update."""
    import functools

    import bench_generation

    from spmd_rl.rollout.base import SamplingParams
    from spmd_rl.rollout.vllm import engine as vllm_engine
    from spmd_rl.rollout.weight_sync import iter_weights

    shape = argparse.Namespace(arch=args.arch, max_tokens=512, prompts=64, samples=8)
    cfg = bench_generation.bench_config(shape, bench_generation.GROUPS["colocated"])
    vllm_engine.use_cache_root(os.path.join(args.out, "vllm_cache"))
    vllm_engine.to_vllm_sampling = functools.partial(vllm_engine.to_vllm_sampling, ignore_eos=True)
    engine = vllm_engine.VLLMEngine(cfg, model_dir, env.rank, env.world_size, env.local_rank, env.local_world_size)
    engine.stop_ids = []  # with ignore_eos: every response is 512 tokens, as random weights give
    t = time.perf_counter()
    engine.wake_up(["weights"])
    engine.load_weights(iter_weights(model, torch.bfloat16, cfg.rollout.weight_sync_bucket_mb))
    engine.wake_up(["kv_cache"])
    out = engine.generate(bench_generation.bench_prompts(shape.prompts),
                          SamplingParams(n=shape.samples, max_new_tokens=shape.max_tokens, seed=0,
                                         logprobs_every=cfg.rollout_logprobs_plan()[0]))
    engine.sleep()
    tokens = sum(len(c.token_ids) for cs in out for c in cs)
    print(f"engine built in {engine.init_seconds:.1f} s; rollout of {tokens} tokens, sync and sleep in "
          f"{time.perf_counter() - t:.1f} s", flush=True)
    return engine


if __name__ == "__main__":
    main()
