"""Generation seconds of the colocated vLLM engine at tensor parallel >= 2: vLLM's custom all-reduce
(CUDA IPC buffers, vLLM's default and the presets') against NCCL (rollout.disable_custom_all_reduce).

    torchrun --standalone --nproc-per-node=2 scripts/bench/bench_allreduce.py --config configs/qwen7b.toml \
        --arch qwen2-7b --seqs 128,512 --tokens 256 --out OUT           (custom all-reduce)
    ... the same with --nccl                                             (NCCL)

The engine is built exactly as the trainer builds it (spmd_rl.rollout.vllm.engine.VLLMEngine from
the preset's [rollout] settings: sleep mode, CUDA graphs, the allocator set-up around the build),
woken, and fed random prompts of --prompt-tokens tokens; dummy random weights never stop early, so
every sequence decodes --tokens tokens (ignore_eos). One setting per process: vLLM allows one
sleep-mode engine per process, so run the script once per setting. Prints one RESULT line per batch
size (rank 0) and writes OUT/bench_allreduce_<custom|nccl>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from spmd_rl.build import choose_speed_settings  # noqa: E402
from spmd_rl.config.run_config import load_config  # noqa: E402
from spmd_rl.model.loading import random_model_config  # noqa: E402
from spmd_rl.runtime.distributed import init_distributed  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True, help="a preset with a [rollout] section (its engine settings)")
    ap.add_argument("--arch", default="qwen2-7b", help="model shape (spmd_rl.model.loading.ARCH_PRESETS)")
    ap.add_argument("--seqs", default="128,512", help="comma-separated batch sizes (sequences per TP group)")
    ap.add_argument("--tokens", type=int, default=256, help="new tokens per sequence")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--nccl", action="store_true", help="rollout.disable_custom_all_reduce = true")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    env = init_distributed("cuda")
    mode = "nccl" if args.nccl else "custom"
    model_dir = os.path.join(args.out, f"config_{args.arch}")
    cfg = load_config(args.config, [f"rollout.disable_custom_all_reduce={'true' if args.nccl else 'false'}",
                                    f"data.max_prompt_length={args.prompt_tokens}",
                                    f"data.max_response_length={args.tokens}"])
    choose_speed_settings(cfg, env)  # "auto" (rollout.max_num_seqs) as the trainer chooses it
    if env.rank == 0:
        random_model_config(args.arch).save_pretrained(model_dir)  # config.json only: the engine loads dummy weights
    dist.barrier()
    os.environ.setdefault("VLLM_CACHE_ROOT", os.path.join(args.out, "vllm_cache"))
    from vllm import SamplingParams

    from spmd_rl.rollout.vllm.engine import VLLMEngine

    t0 = time.perf_counter()
    engine = VLLMEngine(cfg, model_dir, env.rank, env.world_size, env.local_rank, env.local_world_size)
    init_s = time.perf_counter() - t0
    engine.wake_up()
    vocab = random_model_config(args.arch).vocab_size
    rng = random.Random(engine.replica)  # the same prompts on every rank of a TP group
    results = []
    for n in [int(s) for s in args.seqs.split(",")]:
        prompts = [{"prompt_token_ids": [rng.randrange(100, vocab - 100) for _ in range(args.prompt_tokens)]}
                   for _ in range(n)]
        sp = SamplingParams(max_tokens=args.tokens, ignore_eos=True, temperature=1.0, seed=0, detokenize=False)
        times = []
        for rep in range(args.reps + 1):  # the first is a warm-up
            torch.cuda.synchronize()
            dist.barrier()
            t = time.perf_counter()
            outs = engine.llm.generate(prompts, sp, use_tqdm=False)
            torch.cuda.synchronize()
            if rep:
                times.append(time.perf_counter() - t)
        assert all(len(o.outputs[0].token_ids) == args.tokens for o in outs)
        secs = statistics.median(times)
        row = {"mode": mode, "arch": args.arch, "tp": engine.tp, "seqs": n, "tokens": args.tokens,
               "prompt_tokens": args.prompt_tokens, "generate_s": secs, "tokens_per_s": n * args.tokens / secs,
               "all_s": times, "engine_init_s": init_s}
        results.append(row)
        if env.rank == 0:
            print("RESULT " + json.dumps(row), flush=True)
    engine.sleep()
    if env.rank == 0:
        with open(os.path.join(args.out, f"bench_allreduce_{mode}.json"), "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()
    engine.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
