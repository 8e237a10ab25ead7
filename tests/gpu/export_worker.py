"""torchrun worker (1 process) behind tests/gpu/test_export_gpu.py: does vLLM serve an exported
checkpoint exactly like the engine that the trainer syncs from the same checkpoint?

    torchrun --nproc-per-node=1 tests/gpu/export_worker.py --trained-run RUN --step N --export DIR --out OUT

  D. a plain vLLM engine loads the Hugging Face export (DIR) from disk: prompt log-probs of fixed
     random sequences; shut down in-process;
  S. the FSDP2 actor is restored from RUN/checkpoints/step_N (DCP) and streamed into our
     VLLMEngine (dummy weights, sleep mode) as in training: prompt log-probs of the same sequences;
  I. the same for the run's starting model (RUN/init_model) from disk, to show the training moved
     the log-probs by more than the D-vs-S difference.
Results as JSON in OUT/result.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from spmd_rl.checkpoint.checkpointer import ModelAndOptimizer  # noqa: E402
from spmd_rl.config.run_config import load_config  # noqa: E402
from spmd_rl.model.loading import DTYPES, apply_fsdp, load_causal_lm  # noqa: E402
from spmd_rl.rollout.weight_sync import iter_weights  # noqa: E402
from spmd_rl.runtime.distributed import init_distributed  # noqa: E402


def disk_logprobs(cfg, model_dir: str, seqs):
    from vllm import LLM

    from spmd_rl.rollout.vllm.engine import engine_kwargs, prompt_logprobs, shutdown_llm

    llm = LLM(**engine_kwargs(cfg, model_dir, cfg.rollout.seed, dummy=False, sleep_mode=False))
    lp = prompt_logprobs(llm, seqs)
    shutdown_llm(llm)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return lp


def maxdiff(a, b) -> float:
    return max(abs(x - y) for s, t in zip(a, b) for x, y in zip(s, t))


def meandiff(a, b) -> float:
    d = [abs(x - y) for s, t in zip(a, b) for x, y in zip(s, t)]
    return sum(d) / len(d)


def run(args, res: dict) -> None:
    from spmd_rl.rollout.vllm.engine import VLLMEngine

    env = init_distributed("cuda")
    cfg = load_config(os.path.join(args.trained_run, "config.toml"))
    cfg.rollout.gpu_memory_utilization = 0.3
    with open(os.path.join(args.export, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    g = torch.Generator().manual_seed(1234)
    # prompt_logprobs asks one token more than the sequence: the longest fits max_model_len - 1
    longest = (cfg.rollout.max_model_len or cfg.data.max_prompt_length + cfg.data.max_response_length) - 1
    seqs = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (16, 32, longest)]

    res["export_lp"] = disk_logprobs(cfg, args.export, seqs)
    res["init_lp"] = disk_logprobs(cfg, os.path.join(args.trained_run, "init_model"), seqs)

    actor = apply_fsdp(load_causal_lm(os.path.join(args.trained_run, "init_model"), DTYPES[cfg.model.dtype]), env.mesh,
                       DTYPES[cfg.model.compute_dtype])
    dcp.load({"actor": ModelAndOptimizer(actor, None)},
             checkpoint_id=os.path.join(args.trained_run, "checkpoints", f"step_{args.step}"))
    eng = VLLMEngine(cfg, os.path.join(args.trained_run, "init_model"), env.rank, env.world_size, env.local_rank,
                     env.local_world_size)
    eng.wake_up(["weights"])
    eng.load_weights(iter_weights(actor, DTYPES[cfg.rollout.dtype], cfg.rollout.weight_sync_bucket_mb))
    eng.wake_up(["kv_cache"])
    res["synced_lp"] = eng.prompt_logprobs(seqs)
    eng.close()
    res["export_vs_synced_max"] = maxdiff(res["export_lp"], res["synced_lp"])
    res["export_vs_synced_mean"] = meandiff(res["export_lp"], res["synced_lp"])
    res["init_vs_synced_mean"] = meandiff(res["init_lp"], res["synced_lp"])
    print(json.dumps({k: v for k, v in res.items() if not k.endswith("_lp")}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trained-run", required=True, help="run_dir of the trained run (not --run: torchrun takes that as --run-path)")
    ap.add_argument("--step", type=int, required=True)
    ap.add_argument("--export", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    res: dict = {"ok": False}
    os.makedirs(args.out, exist_ok=True)
    try:
        run(args, res)
        res["ok"] = True
    except BaseException:
        res["error"] = traceback.format_exc()
        print(res["error"], flush=True)
        raise
    finally:
        with open(os.path.join(args.out, "result.json"), "w") as f:
            json.dump(res, f)
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
