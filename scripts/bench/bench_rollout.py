"""Benchmark of the colocated rollout engine against plain vLLM, in one torchrun run on one machine.

    torchrun --nproc-per-node=1 scripts/bench/bench_rollout.py --arch qwen2-1.5b --out /tmp/bench
    torchrun --nproc-per-node=2 scripts/bench/bench_rollout.py --arch qwen2-7b --tp 2 --out /tmp/bench
    torchrun --nproc-per-node=1 scripts/bench/bench_rollout.py --engine-kwargs '{"async_scheduling": true}' --out /tmp/b2

A random-weight model of the preset shape is written once to --model-root (no hub). Measures:
  (a) generation throughput of a plain vLLM LLM loading the checkpoint from disk (same prompts and
      settings, no sleep mode) and of our VLLMEngine after a weight sync; ratio ours / plain;
  (b) weight-sync seconds: ours (spmd_rl.rollout.weight_sync.iter_weights, bucketed gathers, into
      VLLMEngine.load_weights) at several bucket sizes, the naive per-tensor `full_tensor()` sync,
      gather-only and load-only splits, against a floor = bytes moved / bandwidth measured in the
      same run (fp32->bf16 cast + all_gather + copy into the engine's parameters);
  (c) sleep and wake seconds; (d) peak device memory (driver view, polled) per phase;
  (e) the long tail: --prompts x --samples requests of the plain LLM, each of its own length from
      --length-profile (length_profile.py; EOS ignored), stepped by hand: generation wall, the share
      of it after 90% of the requests finished, tokens/s ("none" skips it).
--engine-kwargs hands more vllm.LLM arguments to both engines (as rollout.engine_kwargs) to compare
vLLM settings: give each variant its own --out. Prints a short table last (rank 0) and writes JSON to
--out/bench_<arch>_tp<K>_w<W>.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import length_profile  # noqa: E402  (scripts/bench/: the script's own directory)

from spmd_rl.config.rollout import RolloutConfig  # noqa: E402
from spmd_rl.config.run_config import Config
from spmd_rl.errors import ConfigError
from spmd_rl.model.loading import apply_fsdp, load_causal_lm, materialize_random_model, random_model_config  # noqa: E402
from spmd_rl.rollout.base import SamplingParams  # noqa: E402
from spmd_rl.rollout.vllm.kwargs import check_engine_kwargs  # noqa: E402
from spmd_rl.rollout.weight_sync import iter_weight_buckets, iter_weights  # noqa: E402
from spmd_rl.runtime.distributed import init_distributed  # noqa: E402
from spmd_rl.runtime.gpu_memory import GiB, PeakPoller  # noqa: E402

QWEN_EOS = 151643


def sync_time(fn) -> float:
    torch.cuda.synchronize()
    dist.barrier()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    dist.barrier()
    return time.perf_counter() - t


def median_time(fn, reps: int) -> float:
    return statistics.median(sync_time(fn) for _ in range(reps))


def event_time(fn, iters: int) -> float:
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / 1e3 / iters


def timed_generate(fn) -> tuple[float, int]:
    """(seconds, tokens generated) of one vllm LLM.generate call."""
    t0 = time.perf_counter()
    outs = fn()
    return time.perf_counter() - t0, sum(len(c.token_ids) for o in outs for c in o.outputs)


def summarize_runs(runs: list[tuple[float, float]]) -> dict:
    """Median throughput of repeated generate runs, and every run's tokens/s (their spread says
    how far one ratio can be trusted)."""
    tps = [n / s for s, n in runs]
    return {"tok_per_s": statistics.median(tps), "runs_tok_per_s": tps, "s": [s for s, _ in runs],
            "tokens": [n for _, n in runs]}


def bandwidths(world: int) -> dict:
    """Device copy (bytes read + written per second), fp32->bf16 cast (likewise) and all_gather
    (bytes landing in each rank's output per second) on random data."""
    out = {}
    x = torch.randn(2**29, device="cuda", dtype=torch.bfloat16)  # 1 GiB
    y = torch.empty_like(x)
    out["copy_GBps"] = 2 * x.numel() * 2 / event_time(lambda: y.copy_(x), 10) / 1e9
    x = y = None  # free the GiB before the next pair
    x = torch.randn(2**28, device="cuda", dtype=torch.float32)  # 1 GiB
    y = torch.empty(x.shape, device="cuda", dtype=torch.bfloat16)
    out["cast_GBps"] = x.numel() * 6 / event_time(lambda: y.copy_(x), 10) / 1e9
    x = y = None
    if world > 1:
        send = torch.randn(2**27, device="cuda", dtype=torch.bfloat16)  # 256 MiB per rank
        recv = torch.empty(world * send.numel(), device="cuda", dtype=torch.bfloat16)
        dist.barrier()
        t = event_time(lambda: dist.all_gather_into_tensor(recv, send), 10)
        out["allgather_out_GBps"] = recv.numel() * 2 / t / 1e9
        out["allgather_bus_GBps"] = recv.numel() * 2 * (world - 1) / world / t / 1e9
        del send, recv
    torch.cuda.empty_cache()
    return out


@torch.no_grad()
def naive_sync(eng, actor) -> None:
    """The probe's naive sync: per parameter full_tensor() (an fp32 all_gather), cast, one
    load_weights call per tensor."""
    for name, p in actor.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
        eng.load_weights([(name, t.to(torch.bfloat16))], strict=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="qwen2-1.5b", choices=["qwen2-0.5b", "qwen2-1.5b", "qwen2-7b"])
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=128, help="prompts per replica (TP group)")
    ap.add_argument("--samples", type=int, default=4, help="samples per prompt (not --n: torchrun takes that as its own --nnodes/--nproc-per-node/...)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--gpu-mem", type=float, default=0.5)
    ap.add_argument("--eager", action="store_true", help="enforce_eager (no CUDA graphs) for both engines")
    ap.add_argument("--capture-sizes", default="1,2,4,8,16,32,48,64,96,128,160,192,224,256")
    ap.add_argument("--buckets", default="64,256,512,2048", help="bucket sizes (MB) of our sync to time")
    ap.add_argument("--bucket-mb", type=int, default=512, help="our default bucket (rollout.weight_sync_bucket_mb)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions of each sync variant (median)")
    ap.add_argument("--gen-reps", type=int, default=3, help="repetitions of each generate measurement (median)")
    ap.add_argument("--engine-kwargs", default="{}", metavar="JSON",
                    help='more vllm.LLM arguments for both engines, as rollout.engine_kwargs (checked the same way), '
                         'e.g. \'{"async_scheduling": true}\'')
    ap.add_argument("--skip-plain", action="store_true")
    ap.add_argument("--length-profile", default=length_profile.DEFAULT,
                    help="per-request lengths of the tail run (e): lognormal:mean=M,sigma=S,cap=C, uniform:N, "
                         "hist:FILE, or none; the engines' max_model_len fits the cap")
    ap.add_argument("--model-root", default="/tmp/spmd_rl_models")
    ap.add_argument("--out", default="/tmp/bench_rollout")
    args = ap.parse_args()
    try:
        extra = json.loads(args.engine_kwargs)
    except json.JSONDecodeError as e:
        ap.error(f"--engine-kwargs is not JSON: {e}")
    if not isinstance(extra, dict):
        ap.error(f"--engine-kwargs must be a JSON object, got {args.engine_kwargs}")
    try:
        profile = None if args.length_profile == "none" else length_profile.parse(args.length_profile)
    except (ValueError, OSError) as e:
        ap.error(str(e))
    try:  # as a run's config check: no argument of ours replaced, every name one vllm.LLM takes
        check_engine_kwargs(RolloutConfig(engine="vllm", engine_kwargs=extra))
    except ConfigError as e:
        ap.error(str(e))

    env = init_distributed("cuda")
    rank, world = env.rank, env.world_size
    tp = args.tp
    replica, tp_rank = rank // tp, rank % tp
    say = (lambda *a: print(f"[bench r{rank}]", *a, flush=True)) if rank == 0 else (lambda *a: None)
    res: dict = {"arch": args.arch, "tp": tp, "world": world, "device": torch.cuda.get_device_name(),
                 "torch": torch.__version__, "args": vars(args),
                 "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")}
    poller = PeakPoller(env.local_rank).start()
    free = lambda: torch.cuda.mem_get_info()[0] / GiB  # noqa: E731

    # model + config
    poller.phase("model_dir")
    config = random_model_config(args.arch)
    config.eos_token_id = QWEN_EOS
    with torch.device("cuda"):  # random init on the GPU (same recipe as tests/gpu/colocate_worker.py)
        mdir = materialize_random_model(os.path.join(args.model_root, f"{args.arch}-tie{int(config.tie_word_embeddings)}"),
                                        config, seed=0, dtype=torch.bfloat16)
    gc.collect()
    torch.cuda.empty_cache()
    cfg = Config()
    r = cfg.rollout
    r.engine, r.tensor_parallel_size, r.gpu_memory_utilization = "vllm", tp, args.gpu_mem
    r.enforce_eager = args.eager
    r.cudagraph_capture_sizes = [int(s) for s in args.capture_sizes.split(",") if s] if not args.eager else []
    r.weight_sync_bucket_mb = args.bucket_mb
    r.temperature, r.n = args.temperature, args.samples
    cfg.data.max_prompt_length = args.prompt_len
    cfg.data.max_response_length = max(args.max_tokens, profile.cap if profile else 0)
    r.engine_kwargs = extra  # both engines get them (engine_kwargs)

    from vllm import LLM

    from spmd_rl.rollout.vllm.engine import VLLMEngine, engine_kwargs, prompt_logprobs, shutdown_llm, to_vllm_sampling

    g = torch.Generator().manual_seed(10_000 + replica)
    P = torch.randint(0, config.vocab_size, (args.prompts, args.prompt_len), generator=g).tolist()
    per = -(-len(P) // tp)
    mine = P[tp_rank * per:(tp_rank + 1) * per]  # contiguous shares: the group's union is P in order
    sampling = SamplingParams(n=args.samples, temperature=args.temperature, max_new_tokens=args.max_tokens, seed=1)
    vsp = to_vllm_sampling(sampling, [QWEN_EOS])
    requests = [{"prompt_token_ids": p} for p in P]
    seeded = [to_vllm_sampling(sampling, [QWEN_EOS], seed=j) for j in range(len(P))]  # a seed per request, as ours
    warm = SamplingParams(n=1, temperature=1.0, max_new_tokens=16, seed=0)
    probe = P[0][:64]

    # (d) bandwidths
    poller.phase("bandwidth")
    res["bw"] = bandwidths(world)
    say("bandwidths", res["bw"])

    # (a) plain vLLM from disk
    if not args.skip_plain:
        poller.phase("plain_init")
        t = time.perf_counter()
        llm = LLM(**engine_kwargs(cfg, mdir, r.seed + replica, dummy=False, sleep_mode=False))
        res["plain_init_s"] = time.perf_counter() - t
        llm.generate([{"prompt_token_ids": p} for p in P[:8]], to_vllm_sampling(warm, [QWEN_EOS]), use_tqdm=False)
        plain_probe = prompt_logprobs(llm, [probe])[0]
        poller.phase("plain_generate")
        torch.manual_seed(1)
        # Alternating the two request forms over the repetitions: drift of the machine (clocks,
        # temperature) hits both alike.
        runs: dict[str, list] = {"plain": [], "plain_seeded": []}
        for _ in range(args.gen_reps):
            runs["plain"].append(timed_generate(lambda: llm.generate(requests, vsp, use_tqdm=False)))
            runs["plain_seeded"].append(timed_generate(lambda: llm.generate(requests, seeded, use_tqdm=False)))
        res["plain_gen"], res["plain_seeded_gen"] = summarize_runs(runs["plain"]), summarize_runs(runs["plain_seeded"])
        say("plain", res["plain_gen"], "seeded", res["plain_seeded_gen"])
        if profile is not None:  # (e) the same prompts, each sample its own request of its own length
            poller.phase("plain_tail")
            tail_prompts = [p for p in P for _ in range(args.samples)]
            lengths = length_profile.draw(profile, len(tail_prompts), seed=replica)
            params = [to_vllm_sampling(SamplingParams(temperature=args.temperature, max_new_tokens=n), [QWEN_EOS],
                                       seed=j, ignore_eos=True) for j, n in enumerate(lengths)]
            llm.reset_prefix_cache()
            start, finishes = length_profile.timed_run(llm, tail_prompts, params)
            res["plain_tail"] = {"profile": args.length_profile, **length_profile.tail_report(start, finishes, lengths)}
            say("tail", res["plain_tail"])
        poller.phase("plain_shutdown")
        shutdown_llm(llm)
        del llm
        gc.collect()
        torch.cuda.empty_cache()

    # actor
    poller.phase("actor_build")
    actor = apply_fsdp(load_causal_lm(mdir, torch.float32), env.mesh, torch.bfloat16)
    n_params = sum(p.numel() for p in actor.parameters())
    res["params"] = n_params
    res["free_before_engine_GiB"] = free()

    # our engine
    poller.phase("engine_init")
    t = time.perf_counter()
    eng = VLLMEngine(cfg, mdir, rank, world, env.local_rank, env.local_world_size)
    res["engine_init_s"] = time.perf_counter() - t
    res["free_engine_asleep_GiB"] = free()
    times: dict[str, list[float]] = {k: [] for k in ("wake_weights", "sync", "wake_kv", "sleep")}

    def cycle_up(label: str, kv: bool = True) -> None:
        poller.phase(f"wake_weights{label}")
        times["wake_weights"].append(sync_time(lambda: eng.wake_up(["weights"])))
        poller.phase(f"sync{label}")
        times["sync"].append(sync_time(lambda: eng.load_weights(iter_weights(actor, torch.bfloat16, args.bucket_mb))))
        if kv:
            poller.phase(f"wake_kv{label}")
            times["wake_kv"].append(sync_time(lambda: eng.wake_up(["kv_cache"])))

    def cycle_down(label: str) -> None:
        poller.phase(f"sleep{label}")
        times["sleep"].append(sync_time(eng.sleep))
        poller.phase(f"asleep{label}")

    cycle_up("")
    eng.generate(mine if mine else [], warm)
    ours_probe = eng.prompt_logprobs([probe])[0]
    if not args.skip_plain:
        res["probe_max_abs_dlogp_vs_plain"] = max(abs(a - b) for a, b in zip(ours_probe, plain_probe))
    poller.phase("generate")
    replicas = world // tp
    ours_runs = []
    for _ in range(args.gen_reps):
        dist.barrier()
        t0 = time.perf_counter()
        comps = eng.generate(mine, sampling)
        dt = time.perf_counter() - t0
        # every rank of a TP group returns its share; the group's tokens are the sum over its ranks
        ntok = torch.tensor([sum(len(c.token_ids) for x in comps for c in x)], device="cuda", dtype=torch.float64)
        dtt = torch.tensor([dt], device="cuda", dtype=torch.float64)
        dist.all_reduce(ntok)
        dist.all_reduce(dtt, op=dist.ReduceOp.MAX)
        ours_runs.append((dtt.item(), ntok.item() / replicas))
    res["ours_gen"] = summarize_runs(ours_runs)
    # The same requests straight into our engine's vllm.LLM: what our wrapper (gathers, per-request
    # sampling params, conversion of the outputs) costs on top of vLLM itself.
    res["ours_llm_only_gen"] = summarize_runs(
        [timed_generate(lambda: eng.llm.generate(requests, seeded, use_tqdm=False)) for _ in range(args.gen_reps)])
    say("ours", res["ours_gen"], "llm only", res["ours_llm_only_gen"])
    cycle_down("")

    # (b) sync variants, weights awake and KV cache asleep as in training
    cycle_up("_2", kv=False)
    eng_bytes = eng.engine_parameter_bytes()
    poller.phase("sync_variants")
    sync = {}
    for mb in [int(b) for b in args.buckets.split(",") if b]:
        sync[f"ours_{mb}MB"] = median_time(lambda: eng.load_weights(iter_weights(actor, torch.bfloat16, mb)), args.reps)
    sync["naive_per_tensor"] = median_time(lambda: naive_sync(eng, actor), args.reps)
    sync["gather_only"] = median_time(lambda: [None for _ in iter_weight_buckets(actor, torch.bfloat16, args.bucket_mb)],
                                      args.reps)
    gathered = list(iter_weights(actor, torch.bfloat16, args.bucket_mb))
    sync["load_only"] = median_time(lambda: eng.load_weights(gathered), args.reps)
    gathered = None
    gc.collect()
    torch.cuda.empty_cache()
    # the last load must leave the engine right: load ours once more and check the probe
    eng.load_weights(iter_weights(actor, torch.bfloat16, args.bucket_mb))
    times["wake_kv"].append(sync_time(lambda: eng.wake_up(["kv_cache"])))
    after = eng.prompt_logprobs([probe])[0]
    res["probe_max_abs_dlogp_after_variants"] = max(abs(a - b) for a, b in zip(after, ours_probe))
    cycle_down("_2")
    bw = res["bw"]
    full_bf16 = 2 * n_params
    floor = {
        "cast_s": 6 * n_params / world / (bw["cast_GBps"] * 1e9),
        "allgather_s": full_bf16 / (bw["allgather_out_GBps"] * 1e9) if world > 1 else 0.0,
        "engine_copy_s": 2 * eng_bytes / (bw["copy_GBps"] * 1e9),
    }
    floor["total_s"] = sum(floor.values())
    res["sync"] = {"bytes_full_bf16": full_bf16, "engine_bytes_per_rank": eng_bytes, "variants_s": sync,
                   "floor": floor, "cycle_sync_s": times["sync"]}
    res["times"] = times
    res["peak_used_GiB"] = poller.stop()
    res["free_end_GiB"] = free()

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, f"bench_{args.arch}_tp{tp}_w{world}.json")
        with open(path, "w") as f:
            json.dump(res, f, indent=1)
        print_table(res, path)
    eng.close()
    dist.barrier()
    dist.destroy_process_group()


def print_table(res: dict, path: str) -> None:
    s = res["sync"]
    v, fl = s["variants_s"], s["floor"]
    ours = v[f"ours_{res['args']['bucket_mb']}MB"] if f"ours_{res['args']['bucket_mb']}MB" in v else min(
        x for k, x in v.items() if k.startswith("ours_"))
    a = res["args"]
    lines = ["", "=" * 78,
             f"bench_rollout {res['arch']} tp={res['tp']} world={res['world']} on {res['device']} (torch {res['torch']})",
             f"workload per replica: {a['prompts']} prompts x n={a['samples']}, prompt {a['prompt_len']}, up to "
             f"{a['max_tokens']} new tokens, T={a['temperature']}, {'eager' if a['eager'] else 'CUDA graphs'}"
             + (f", engine kwargs {a['engine_kwargs']}" if a.get("engine_kwargs", "{}") != "{}" else ""),
             "-" * 78]
    if "plain_gen" in res:
        p, ps, o = res["plain_gen"], res["plain_seeded_gen"], res["ours_gen"]
        lines.append(f"generate  plain vLLM {p['tok_per_s']:9.0f} tok/s   ours {o['tok_per_s']:9.0f} tok/s   "
                     f"ratio {o['tok_per_s'] / p['tok_per_s']:.3f}  (init plain {res['plain_init_s']:.0f}s, "
                     f"ours {res['engine_init_s']:.0f}s)")
        lines.append(f"          plain vLLM, a seed per request {ps['tok_per_s']:.0f} tok/s (ratio ours / it "
                     f"{o['tok_per_s'] / ps['tok_per_s']:.3f}); medians of {len(o['runs_tok_per_s'])}, runs: plain "
                     + ", ".join(f"{x:.0f}" for x in p["runs_tok_per_s"]) + "; seeded "
                     + ", ".join(f"{x:.0f}" for x in ps["runs_tok_per_s"]) + "; ours "
                     + ", ".join(f"{x:.0f}" for x in o["runs_tok_per_s"]))
        lines.append(f"          our engine's vllm.LLM called directly (no wrapper): "
                     f"{res['ours_llm_only_gen']['tok_per_s']:.0f} tok/s")
        lines.append(f"          prompt log-prob max |d| ours vs plain: {res['probe_max_abs_dlogp_vs_plain']:.2e}")
    else:
        lines.append(f"generate  ours {res['ours_gen']['tok_per_s']:.0f} tok/s")
    lines.append(f"sync      {s['bytes_full_bf16'] / 1e9:.2f} GB bf16; ours@{a['bucket_mb']}MB {ours:.4f}s   "
                 f"naive per-tensor {v['naive_per_tensor']:.4f}s   floor {fl['total_s']:.4f}s")
    lines.append("          " + "  ".join(f"{k} {x:.4f}" for k, x in v.items() if k.startswith("ours_")))
    lines.append(f"          split: gather-only {v['gather_only']:.4f}s  load-only {v['load_only']:.4f}s;  floor = cast "
                 f"{fl['cast_s']:.4f} + allgather {fl['allgather_s']:.4f} + engine copy {fl['engine_copy_s']:.4f}")
    bw = res["bw"]
    lines.append(f"          bw: copy {bw['copy_GBps']:.0f} GB/s, cast {bw['cast_GBps']:.0f} GB/s"
                 + (f", all_gather out {bw['allgather_out_GBps']:.0f} GB/s (bus {bw['allgather_bus_GBps']:.0f})"
                    if "allgather_out_GBps" in bw else ""))
    t = res["times"]
    med = lambda xs: statistics.median(xs) if xs else float("nan")  # noqa: E731
    lines.append(f"sleep     {med(t['sleep']):.3f}s   wake weights {med(t['wake_weights']):.3f}s   wake kv "
                 f"{med(t['wake_kv']):.3f}s   (medians of {len(t['sleep'])}/{len(t['wake_weights'])}/{len(t['wake_kv'])})")
    pk = res["peak_used_GiB"]
    keys = [k for k in ("plain_generate", "actor_build", "engine_init", "sync", "wake_kv", "generate", "sleep",
                        "asleep", "sync_variants") if k in pk]
    lines.append("peak used GiB (device): " + "  ".join(f"{k} {pk[k]:.1f}" for k in keys))
    lines.append(f"json: {path}")
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
