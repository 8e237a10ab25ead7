"""Benchmark of checkpoint stalls and restart costs, on GPUs, under torchrun.

    torchrun --nproc-per-node=2 scripts/bench/bench_checkpoint.py --phase save --arch qwen2-7b --out OUT
    torchrun --nproc-per-node=2 scripts/bench/bench_checkpoint.py --phase engine --arch qwen2-7b --tp 2 --out OUT

`scripts/bench/bench_checkpoint.sh OUT` runs both phases (engine twice: cold, then warm cache) and
prints the table; see docs/performance.md, "Checkpoint stall and restart".

--phase save: an FSDP2 actor of the preset shape (fp32 masters, bf16 compute, gradient
  checkpointing, AdamW states materialised by a first step; weights random, built on the meta
  device and filled on the GPU: their values do not matter here) trains steps of --micro
  micro-batches of --batch x --seq random tokens. Measured, in one run:
  (a) step seconds without any save;
  (b) the stall of a synchronous save (spmd_rl.checkpoint.checkpointer.Checkpointer, async_save=False): the
      whole write;
  (c) the stall of an asynchronous save (first save: host buffers allocated and pinned), then
      the step seconds while that save is being written, its write seconds (from the save's call,
      the stall included, and after the stall) with --write-threads writer threads per rank;
  (d) the stall of every later asynchronous save: staging into the same, reused host buffers;
  (e) resume: seconds to load the checkpoint back into the FSDP model and optimizer (each rank
      reads its shards; the page cache may still hold the files: a lower bound on a cold disk).
  Only one checkpoint exists at a time (a 7B fp32 one is ~85 GiB) under --dir, removed at the end.
--phase engine: builds the colocated VLLMEngine (dummy weights, CUDA graphs on) with
  VLLM_CACHE_ROOT = --cache and reports its init seconds and whether the cache held a
  compilation already (run it twice: cold, then warm).
Rank 0 prints a JSON line starting with "RESULT " and writes --out/bench_checkpoint_<phase>*.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from spmd_rl.checkpoint import saving  # noqa: E402
from spmd_rl.checkpoint.checkpointer import Checkpointer, ModelAndOptimizer  # noqa: E402
from spmd_rl.model.loading import allocate_meta_model, apply_fsdp, random_model_config  # noqa: E402
from spmd_rl.runtime.distributed import init_distributed  # noqa: E402
from spmd_rl.train.optim import make_optimizer  # noqa: E402

QWEN_EOS = 151643


def build_actor(arch: str, env):
    from transformers import AutoModelForCausalLM

    config = random_model_config(arch)
    config.use_cache = False
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    compute = torch.bfloat16 if env.device.type == "cuda" else torch.float32
    apply_fsdp(model, env.mesh, compute, gradient_checkpointing=True)
    allocate_meta_model(model, env.device)  # the trainer's own: tied, inv_freq computed
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().normal_(0.0, 0.02)
    return model, config


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def all_ranks_true(flag: bool, device) -> bool:
    t = torch.tensor([0 if flag else 1], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item() == 0


def phase_save(args, env, say) -> dict:
    model, config = build_actor(args.arch, env)
    opt = make_optimizer(model, 1e-6, 0.0)
    models = {"actor": ModelAndOptimizer(model, opt)}
    state_bytes = sum(t.to_local().numel() * t.element_size() for t in model.parameters()) * 3  # weights + 2 moments
    g = torch.Generator(device=env.device).manual_seed(env.rank)

    def step() -> float:
        sync(env.device)
        t = time.perf_counter()
        for _ in range(args.micro):
            ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), device=env.device, generator=g)
            model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(env.device)
        return time.perf_counter() - t

    def timed(fn) -> float:
        sync(env.device)
        dist.barrier()
        t = time.perf_counter()
        fn()
        sync(env.device)
        dist.barrier()
        return time.perf_counter() - t

    def remove(path: str) -> None:
        dist.barrier()
        if env.rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        dist.barrier()

    res: dict = {"state_GiB_per_rank": state_bytes / 2**30}
    step()  # warm-up; creates the AdamW states
    res["steps_idle_s"] = [step() for _ in range(args.steps)]
    say("steps without a save", res["steps_idle_s"])

    sync_ck = Checkpointer(os.path.join(args.dir, "sync"), keep_last=1, async_save=False)
    res["sync_stall_s"] = timed(lambda: sync_ck.save(1, models, {"step": 1}))
    say("synchronous save stall", res["sync_stall_s"])
    remove(os.path.join(args.dir, "sync"))

    ck = Checkpointer(os.path.join(args.dir, "async"), keep_last=1, async_save=True)
    t0 = time.perf_counter()
    res["async_first_stall_s"] = timed(lambda: ck.save(2, models, {"step": 2}))
    in_flight = []
    while not all_ranks_true(not ck.in_flight(), env.device):  # every rank runs the same number of steps
        in_flight.append(step())
    ck.wait()
    res["async_write_s"] = time.perf_counter() - t0  # from the save's call: the stall included
    res["steps_in_flight_s"] = in_flight
    say("async first stall", res["async_first_stall_s"], "write (from the call, stall included)", res["async_write_s"],
        "steps in flight", in_flight)
    # What every later save waits for: staging into the host buffers the first save allocated (the
    # same call Checkpointer.save makes, without writing another ~85 GiB).
    stager = ck.saver._stager
    res["async_stall_s"] = [timed(lambda: stager.stage({k: m.state_dict() for k, m in models.items()}))
                            for _ in range(2)]
    say("async later stalls (staging into reused buffers)", res["async_stall_s"])
    res["load_s"] = timed(lambda: ck.load(os.path.join(args.dir, "async", "step_2"), models))
    say("load", res["load_s"])
    ck.close()
    remove(args.dir)
    idle = statistics.median(res["steps_idle_s"])
    busy = statistics.median(in_flight) if in_flight else float("nan")
    res["summary"] = {
        "state_GiB_per_rank": round(res["state_GiB_per_rank"], 1), "write_threads": saving.WRITE_THREADS,
        "step_s_idle": round(idle, 2), "step_s_save_in_flight": round(busy, 2),
        "slowdown_in_flight": round(busy / idle - 1, 3),
        "stall_sync_s": round(res["sync_stall_s"], 1), "stall_async_first_s": round(res["async_first_stall_s"], 1),
        "stall_async_s": round(min(res["async_stall_s"]), 1), "async_write_s": round(res["async_write_s"], 1),
        "async_write_after_stall_s": round(res["async_write_s"] - res["async_first_stall_s"], 1),
        "sync_write_GBps_per_rank": round(res["state_GiB_per_rank"] * 2**30 / 1e9 / res["sync_stall_s"], 2),
        "load_s": round(res["load_s"], 1),
    }
    return res


def phase_engine(args, env, say) -> dict:
    from spmd_rl.config.run_config import Config

    os.environ["VLLM_CACHE_ROOT"] = os.path.abspath(args.cache)
    compiled_before = os.path.isdir(os.path.join(args.cache, "torch_compile_cache"))
    mdir = os.path.join(args.dir, f"{args.arch}-config")
    if env.rank == 0:
        config = random_model_config(args.arch)
        config.eos_token_id = QWEN_EOS
        config.save_pretrained(mdir)  # dummy weights: the engine reads only the config
    dist.barrier()
    cfg = Config()
    r = cfg.rollout
    r.engine, r.tensor_parallel_size, r.gpu_memory_utilization, r.enforce_eager = "vllm", args.tp, 0.5, False
    cfg.data.max_prompt_length, cfg.data.max_response_length = 128, 512
    from spmd_rl.rollout.vllm.engine import VLLMEngine

    t = time.perf_counter()
    eng = VLLMEngine(cfg, mdir, env.rank, env.world_size, env.local_rank, env.local_world_size)
    init = time.perf_counter() - t
    eng.close()
    say("engine init", init, "cache warm" if compiled_before else "cache cold")
    return {"engine_init_s": init, "cache_warm": compiled_before, "cache": args.cache,
            "summary": {f"engine_init_s_{'warm' if compiled_before else 'cold'}": round(init, 1)}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--phase", choices=["save", "engine"], required=True)
    ap.add_argument("--arch", default="qwen2-7b", choices=["tiny", "qwen2-0.5b", "qwen2-1.5b", "qwen2-7b"],
                    help="tiny runs --phase save on CPU too (a smoke test of the script)")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3, help="timed steps without a save")
    ap.add_argument("--micro", type=int, default=4, help="micro-batches per step")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=640)
    ap.add_argument("--dir", default="/tmp/spmd_rl_bench_checkpoint", help="checkpoints / model config (local disk)")
    ap.add_argument("--cache", default="/tmp/spmd_rl_bench_vllm_cache", help="VLLM_CACHE_ROOT of --phase engine")
    ap.add_argument("--out", default="/tmp/bench_checkpoint")
    ap.add_argument("--write-threads", type=int, default=0,
                    help="threads (and files) per rank that write a checkpoint; 0: the checkpointer's WRITE_THREADS")
    args = ap.parse_args()
    if args.write_threads:  # what the step's slowdown while a save is written depends on, if anything
        saving.WRITE_THREADS = args.write_threads
    env = init_distributed("auto")
    say = (lambda *a: print("[bench r0]", *a, flush=True)) if env.rank == 0 else (lambda *a: None)
    res = {"phase": args.phase, "arch": args.arch, "world": env.world_size, "torch": torch.__version__,
           "device": torch.cuda.get_device_name() if env.device.type == "cuda" else "cpu", "args": vars(args)}
    res.update(phase_save(args, env, say) if args.phase == "save" else phase_engine(args, env, say))
    if env.rank == 0:
        os.makedirs(args.out, exist_ok=True)
        name = f"bench_checkpoint_{args.phase}" + ("" if args.phase == "save" else f"_{'warm' if res['cache_warm'] else 'cold'}")
        with open(os.path.join(args.out, name + ".json"), "w") as f:
            json.dump(res, f, indent=1)
        print("RESULT " + json.dumps({"phase": args.phase, **res["summary"]}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
