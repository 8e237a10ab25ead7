"""Benchmark of the training side (actor update and no-grad log-prob pass), each feature on/off,
in one torchrun run; MFU against the bf16 matmul peak measured in the same run.

    torchrun --nproc-per-node=1 scripts/bench/bench_train.py --arch qwen2-0.5b,qwen2-1.5b --out $OUT \
        --profile packed-nogc,packed-nogc-liger-headcompile
    torchrun --nproc-per-node=2 scripts/bench/bench_train.py --arch qwen2-7b --out $OUT

Per rank: `--seqs` sequences (prompt 60-120 tokens, response uniform 32..`--max-response`: the
ragged lengths of RL rollouts), as one PPO mini-batch. The code timed is the trainer's own:
`update.ppo_update` with `actor.actor_loss_fn` (forward, backward, grad clip, AdamW step) and
`actor.compute_logprobs`, on an FSDP2 actor (fp32 masters, bf16 compute) of a random-weight model
of the preset shape. Variants (`--variants`, default: the packed-nogc family):
  padded-full     padded micro-batches of --mbs rows, full [tokens, vocab] fp32 logits (the old path)
  padded-chunked  the same, log-probs from the hidden states in chunks
  packed          packed rows (varlen attention), chunked log-probs, micro-batches of --budget tokens
  packed-nogc     packed without gradient checkpointing (the baseline of the fused variants)
  packed-nogc-liger         + model.fused_kernels = "liger" (liger-kernel's RMSNorm, rotary, SwiGLU)
  packed-nogc-compile       + model.fused_kernels = "compile" (torch.compile of each decoder layer)
  packed-nogc-headcompile   + model.fused_logprob_head = "compile" (the head's chunk math compiled)
  packed-nogc-liger-headcompile, packed-nogc-compile-headcompile: both switches
  packed-compile-headcompile  both switches with gradient checkpointing (configs/qwen1.5b-gsm8k.toml)
  packed-halfgc-compile-headcompile  the same with half the layers checkpointed
                                     (model.gradient_checkpointing_layers = 0.5)
(the padded variants run with gradient checkpointing; packed too unless -nogc).
Each variant runs once untimed (warm-up: torch.compile and Triton compile there), then `--reps`
times; the best counts. "compile s" = warm-up seconds - best seconds (compilation, mostly), and
the graphs dynamo compiled during the timed reps (recompiles) are reported: both should be 0
for a variant without torch.compile, and the second should be 0 for every variant.
MFU = 6 (update) or 2 (log-prob pass) x parameters x real tokens / seconds / peak; peak memory is
PyTorch's max allocated and the driver's used memory at the end. With `--fit`, then the largest
packed token budget that fits one micro-batch of the update, with and without checkpointing
(doubling until out of memory). `--profile VARIANT[,...]`: torch.profiler over one update and one
log-prob pass of each named variant (after its warm-up), the top `--top-kernels` kernels by CUDA
time (name, calls, total ms, % of the pass's kernel time) and the time per kind of kernel,
printed and written to --out (bench_train_profile.txt / .json). Prints a table last (rank 0);
JSON to --out.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from spmd_rl.batching.batch import Batch  # noqa: E402
from spmd_rl.config.actor import ActorConfig  # noqa: E402
from spmd_rl.model.fused_kernels import compiled_graphs  # noqa: E402
from spmd_rl.model.loading import (  # noqa: E402
    apply_fsdp,
    count_parameters,
    load_causal_lm,
    materialize_random_model,
    random_model_config,
    reshard,  # noqa: E402
    set_fused_kernels,
    set_gradient_checkpointing,
    set_layout,
)
from spmd_rl.runtime.distributed import all_reduce_sum, init_distributed  # noqa: E402
from spmd_rl.runtime.gpu_memory import GiB  # noqa: E402
from spmd_rl.train.actor import actor_loss_fn, compute_logprobs  # noqa: E402
from spmd_rl.train.optim import make_optimizer  # noqa: E402
from spmd_rl.train.update import ppo_update  # noqa: E402

VARIANTS = {  # name: (packed, chunked, gradient checkpointing, model.fused_kernels, model.fused_logprob_head)
    "padded-full": (False, False, True, "none", "none"),
    "padded-chunked": (False, True, True, "none", "none"),
    "packed": (True, True, True, "none", "none"),
    "packed-nogc": (True, True, False, "none", "none"),
    "packed-nogc-liger": (True, True, False, "liger", "none"),
    "packed-nogc-compile": (True, True, False, "compile", "none"),
    "packed-nogc-headcompile": (True, True, False, "none", "compile"),
    "packed-nogc-liger-headcompile": (True, True, False, "liger", "compile"),
    "packed-nogc-compile-headcompile": (True, True, False, "compile", "compile"),
    "packed-compile-headcompile": (True, True, True, "compile", "compile"),  # the 1.5B preset's settings
    # the same with half of the layers checkpointed (model.gradient_checkpointing_layers = 0.5)
    "packed-halfgc-compile-headcompile": (True, True, 0.5, "compile", "compile"),
}
DEFAULT_VARIANTS = [v for v in VARIANTS if v.startswith("packed-nogc")]


def cuda_sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def matmul_peak_tflops(device) -> float:
    if device.type != "cuda":
        return float("nan")  # CPU smoke runs of this script
    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    best = 0.0
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(10):
            a @ b
        torch.cuda.synchronize()
        best = max(best, 10 * 2 * n**3 / (time.perf_counter() - t) / 1e12)
    return best


def rollout_batch(seqs: int, vocab: int, max_response: int, seed: int, fixed_len: int = 0) -> Batch:
    """Ragged RL-like rows; `fixed_len`: every row exactly that long (the largest-budget search)."""
    g = torch.Generator().manual_seed(seed)
    plen = torch.randint(60, 121, (seqs,), generator=g)
    rlen = torch.randint(32, max_response + 1, (seqs,), generator=g)
    if fixed_len:
        rlen = fixed_len - plen
    L = int((plen + rlen).max())
    ids = torch.randint(0, vocab, (seqs, L), generator=g)
    attn = torch.zeros(seqs, L, dtype=torch.long)
    resp = torch.zeros(seqs, L)
    for i in range(seqs):
        p, r = int(plen[i]), int(rlen[i])
        attn[i, :p + r] = 1
        resp[i, p:p + r] = 1
    return Batch({"input_ids": ids * attn, "attention_mask": attn, "response_mask": resp,
                  "old_logprobs": -torch.rand(seqs, L, generator=g) * resp,
                  "advantages": torch.randn(seqs, L, generator=g) * resp})


def set_variant(model, packed: bool, chunked: bool, gc_on: float, kernels: str = "none", head: str = "none") -> str:
    """Switch the model to a variant; returns the decoder kernels in effect ("none" after liger's
    fallback on a machine without CUDA/Triton/liger-kernel). `gc_on`: the share of layers
    checkpointed (True: all)."""
    set_layout(model, packed)
    model.spmd_chunked_logprobs = chunked  # logprob_head.install's switches
    model.spmd_logprob_head = head
    kernels = set_fused_kernels(model, kernels)
    set_gradient_checkpointing(model, gc_on)
    return kernels


def timed(fn, model, opt):
    """(seconds, result, error or None, memory) of fn(); after an out-of-memory error the model is
    brought back to a clean state (resharded, no gradients) so the next variant can run."""
    cuda = torch.cuda.is_available()
    cuda_sync()
    dist.barrier()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    try:
        out, err = fn(), None
    except torch.OutOfMemoryError as e:
        out, err = None, f"OOM ({str(e).splitlines()[0][:80]})"
    except Exception as e:  # a failing variant (a compile error, say) is reported, the others still run
        traceback.print_exc()
        out, err = None, f"{type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}"
    cuda_sync()
    secs = time.perf_counter() - t
    mem = {}
    if cuda:
        free, total = torch.cuda.mem_get_info()
        mem = {"peak_gib": torch.cuda.max_memory_allocated() / GiB, "device_gib": (total - free) / GiB}
    flag = torch.tensor([0 if err is None else 1], dtype=torch.int64)  # ranks must agree, or the next collective hangs
    if int(all_reduce_sum(flag)[0]) and err is None:
        err = "OOM on another rank"
    if err:
        opt.zero_grad(set_to_none=True)
        model.set_requires_gradient_sync(True)
        reshard(model)
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return secs, out, err, mem


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="qwen2-0.5b", help="comma-separated presets")
    ap.add_argument("--seqs", type=int, default=256, help="sequences per rank (one mini-batch)")
    ap.add_argument("--max-response", type=int, default=512)
    ap.add_argument("--mbs", type=int, default=16, help="rows per micro-batch of the padded variants")
    ap.add_argument("--budget", type=int, default=16384, help="tokens per micro-batch of the packed variants")
    ap.add_argument("--logprob-budget", type=int, default=0, help="tokens per log-prob micro-batch (0 = 2 x budget)")
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    ap.add_argument("--reps", type=int, default=1, help="timed repetitions (>= 1, after one warm-up); the best counts")
    ap.add_argument("--fit", action="store_true", help="also search the largest packed micro-batch that fits")
    ap.add_argument("--fit-start", type=int, default=8192, help="first budget of the largest-budget search")
    ap.add_argument("--max-budget", type=int, default=131072, help="stop the largest-budget search here")
    ap.add_argument("--profile", default="", help="comma-separated variants to profile (one update, one log-prob pass)")
    ap.add_argument("--top-kernels", type=int, default=25, help="rows of the profile's kernel table")
    ap.add_argument("--model-root", default="/tmp/spmd_rl_models")
    ap.add_argument("--out", default="/tmp/bench_train")
    args = ap.parse_args()
    if args.reps < 1:
        ap.error("--reps must be >= 1")
    for name in args.variants.split(",") + [v for v in args.profile.split(",") if v]:
        if name not in VARIANTS:
            ap.error(f"unknown variant {name!r}: use {', '.join(VARIANTS)}")

    env = init_distributed("auto")
    dev = env.device
    os.makedirs(args.out, exist_ok=True)
    peak = matmul_peak_tflops(dev)
    results = {"peak_tflops_measured": peak, "world": env.world_size,
               "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
               "torch": torch.__version__, "args": vars(args), "rows": [], "profiles": []}
    path = os.path.join(args.out, f"bench_train_w{env.world_size}.json")

    def save() -> None:
        """Written after every row and profile: a run cut short keeps what it measured."""
        if env.is_main:
            with open(path, "w") as f:
                json.dump(results, f, indent=1)
            if results["profiles"]:
                write_profiles(results["profiles"], args.out)

    for arch in args.arch.split(","):
        bench_arch(arch, args, env, peak, results, save)
        gc.collect()
        torch.cuda.empty_cache()
    save()
    if env.is_main:
        print_table(results, path)
    dist.destroy_process_group()


def bench_arch(arch: str, args, env, peak: float, results: dict, save) -> None:
    """Every variant of `arch` (rows into results["rows"]), then its profiles and the fit search."""
    dev = env.device
    config = random_model_config(arch)
    mdir = materialize_random_model(os.path.join(args.model_root, arch), config, seed=0, dtype=torch.bfloat16)
    compute = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model = apply_fsdp(load_causal_lm(mdir, torch.float32), env.mesh, compute, gradient_checkpointing=True)
    n_params = count_parameters(model)
    opt = make_optimizer(model, 1e-6, 0.0, [0.9, 0.999])
    batch = rollout_batch(args.seqs, config.vocab_size, args.max_response, seed=env.rank)
    tokens = int(batch["attention_mask"].sum())
    all_tokens = tokens * env.world_size
    acfg = ActorConfig()
    rows, profiles = results["rows"], results["profiles"]
    for name in args.variants.split(","):
        packed, chunked, gc_on, kernels, head = VARIANTS[name]
        in_effect = set_variant(model, packed, chunked, gc_on, kernels, head)
        update, logprobs = phase_fns(model, opt, batch, acfg, args, dev, packed)
        row = {"arch": arch, "variant": name, "params": n_params, "tokens_per_rank": tokens,
               "micro": f"{args.budget} tok" if packed else f"{args.mbs} seqs", "gc": gc_on,
               "fused_kernels": in_effect, "fused_logprob_head": head}
        for phase, fn, flops_per_token in (("update", update, 6), ("logprob", logprobs, 2)):
            best, err, mem, warm, graphs = None, None, None, None, {}
            for rep in range(args.reps + 1):
                before = compiled_graphs()
                secs, _, err, m = timed(fn, model, opt)
                graphs["warmup" if rep == 0 else "timed"] = graphs.get("warmup" if rep == 0 else "timed", 0) + compiled_graphs() - before
                if err:
                    break
                if rep == 0:
                    warm = secs
                elif best is None or secs < best:
                    best, mem = secs, m
            if err:
                row[phase] = {"error": err}
                continue
            row[phase] = {"s": best, "tok_s_gpu": tokens / best, **(mem or {}),
                          "mfu_measured": flops_per_token * n_params * all_tokens / env.world_size / best / (peak * 1e12),
                          "mfu_989": flops_per_token * n_params * all_tokens / env.world_size / best / 989e12,
                          "warmup_s": warm, "compile_s": max(warm - best, 0.0),
                          "graphs_compiled_warmup": graphs.get("warmup", 0), "recompiles_timed": graphs.get("timed", 0)}
        rows.append(row)
        save()
        if env.is_main:
            print(json.dumps(row), flush=True)
    for name in [v for v in args.profile.split(",") if v]:
        profiles.append(profile_variant(model, opt, batch, acfg, args, env, arch, name))
        save()
    if args.fit:
        for gc_on in (True, False):
            rows.append(largest_budget(model, opt, acfg, config.vocab_size, gc_on, args, env, arch))
            save()
    set_variant(model, *VARIANTS["packed-nogc"])  # no compiled forwards left on a model about to be freed


def phase_fns(model, opt, batch, acfg, args, dev, packed: bool):
    """(update, log-prob pass) closures of the trainer's own code for the current variant."""
    budget = args.budget if packed else 0
    lp_budget = (args.logprob_budget or 2 * args.budget) if packed else 0

    def update():
        return ppo_update(model, opt, batch, actor_loss_fn(model, acfg, 1.0), mini_batch_size=len(batch),
                          micro_batch_size=args.mbs, epochs=1, grad_clip=1.0, loss_agg_mode="token-mean",
                          device=dev, max_tokens=budget)

    def logprobs():
        return compute_logprobs(model, batch, 1.0, args.mbs, dev, lp_budget)

    return update, logprobs


# --------------------------------------------------------------------------- profile


def kernel_kind(name: str) -> str:
    """A kernel's kind, from its name, for the profile's summary."""
    n = name.lower()
    if "nccl" in n:
        return "nccl"
    if "flash" in n or "fmha" in n or "attention" in n:
        return "attention"
    if any(k in n for k in ("gemm", "cutlass", "xmma", "nvjet", "cublas", "gemv", "wgmma", "splitk")):
        return "matmul"
    if n.startswith("triton_"):
        return "inductor (triton)"
    if any(k in n for k in ("rms_norm", "rope", "swiglu", "silu_mul")):
        return "liger (triton)"
    if "multi_tensor_apply" in n or "foreach" in n:
        return "optimizer (foreach)"
    if "memcpy" in n or "memset" in n:
        return "memcpy/memset"
    if "reduce" in n or "softmax" in n or "logsumexp" in n:
        return "eager reduction"
    if "elementwise" in n or "vectorized" in n or "unrolled" in n:
        return "eager element-wise"
    return "other"


def kernel_table(prof, top: int) -> dict:
    """Top kernels by CUDA time of a finished torch.profiler session (on CPU: top ops by self CPU
    time, for smoke runs): rows of name, calls, total ms, % of all kernel time; and ms per kind."""
    from torch.autograd import DeviceType

    cuda = torch.cuda.is_available()
    events = []
    for e in prof.key_averages():
        if cuda:
            if e.device_type != DeviceType.CUDA:
                continue
            us = getattr(e, "self_device_time_total", None)
            us = e.self_cuda_time_total if us is None else us
        else:
            us = e.self_cpu_time_total
        if us > 0:
            events.append((e.key, e.count, us / 1e3))
    total = sum(ms for _, _, ms in events) or float("nan")
    events.sort(key=lambda r: -r[2])
    kinds: dict[str, float] = {}
    for name, _, ms in events:
        kinds[kernel_kind(name)] = kinds.get(kernel_kind(name), 0.0) + ms
    return {"total_ms": total, "unit": "CUDA kernels" if cuda else "CPU ops (self time)",
            "kernels": [{"name": n, "calls": c, "ms": ms, "pct": 100 * ms / total} for n, c, ms in events[:top]],
            "kinds": [{"kind": k, "ms": ms, "pct": 100 * ms / total} for k, ms in sorted(kinds.items(), key=lambda kv: -kv[1])]}


def profile_variant(model, opt, batch, acfg, args, env, arch: str, name: str) -> dict:
    """torch.profiler over one update and one log-prob pass of variant `name`, warm (after its
    timed runs, or a warm-up of its own)."""
    from torch.profiler import ProfilerActivity, profile

    packed, chunked, gc_on, kernels, head = VARIANTS[name]
    in_effect = set_variant(model, packed, chunked, gc_on, kernels, head)
    out = {"arch": arch, "variant": name, "fused_kernels": in_effect, "fused_logprob_head": head}
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    timed_before = name in args.variants.split(",")  # compiled and warm already
    for phase, fn in zip(("update", "logprob"), phase_fns(model, opt, batch, acfg, args, env.device, packed)):
        if not timed_before:
            _, _, err, _ = timed(fn, model, opt)  # warm-up: compiles here, not under the profiler
            if err:
                out[phase] = {"error": err}
                continue
        cuda_sync()
        dist.barrier()
        t = time.perf_counter()
        try:
            with profile(activities=activities) as prof:
                fn()
                cuda_sync()
        except Exception as e:  # reported; the rest of the run goes on (a single rank: no collective to agree on)
            traceback.print_exc()
            out[phase] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}"}
            opt.zero_grad(set_to_none=True)
            model.set_requires_gradient_sync(True)
            reshard(model)
            continue
        secs = time.perf_counter() - t
        out[phase] = {"s_profiled": secs, **kernel_table(prof, args.top_kernels)}
        del prof
        gc.collect()
    if env.is_main:
        print(profile_text(out), flush=True)
    return out


def profile_text(p: dict) -> str:
    lines = []
    for phase in ("update", "logprob"):
        r = p[phase]
        head = f"### profile: {p['arch']} {p['variant']} (fused_kernels={p['fused_kernels']}, " \
               f"fused_logprob_head={p['fused_logprob_head']}), one {'update' if phase == 'update' else 'log-prob pass'}"
        if "error" in r:
            lines += [head, "", r["error"], ""]
            continue
        lines += [head, "", f"{r['unit']}: {r['total_ms']:.1f} ms in all ({r['s_profiled']:.2f} s under the profiler)", "",
                  "| kernel | calls | total ms | % |", "|---|---|---|---|"]
        lines += [f"| `{k['name'][:110]}` | {k['calls']} | {k['ms']:.1f} | {k['pct']:.1f} |" for k in r["kernels"]]
        lines += ["", "| kind | total ms | % |", "|---|---|---|"]
        lines += [f"| {k['kind']} | {k['ms']:.1f} | {k['pct']:.1f} |" for k in r["kinds"]]
        lines.append("")
    return "\n".join(lines)


def write_profiles(profiles: list[dict], out: str) -> None:
    with open(os.path.join(out, "bench_train_profile.json"), "w") as f:
        json.dump(profiles, f, indent=1)
    with open(os.path.join(out, "bench_train_profile.txt"), "w") as f:
        f.write("\n".join(profile_text(p) for p in profiles))


def largest_budget(model, opt, acfg, vocab: int, gc_on: bool, args, env, arch: str) -> dict:
    """Double a single packed micro-batch's tokens until the update runs out of memory."""
    set_variant(model, True, True, gc_on)  # the plain packed path (no fused kernels)
    fits, budget, mem = 0, args.fit_start, None
    while budget <= args.max_budget:
        n = budget // 512
        b = rollout_batch(n, vocab, 512, seed=1, fixed_len=512)

        def update():
            return ppo_update(model, opt, b, actor_loss_fn(model, acfg, 1.0), mini_batch_size=n, micro_batch_size=n,
                              epochs=1, grad_clip=1.0, loss_agg_mode="token-mean", device=env.device, max_tokens=0)

        _, _, err, m = timed(update, model, opt)
        if err:
            break
        fits, mem = int(b["attention_mask"].sum()), m
        budget *= 2
    row = {"arch": arch, "variant": f"largest packed micro-batch, gc {'on' if gc_on else 'off'}",
           "fits_tokens": fits, **(mem or {})}
    if env.is_main:
        print(json.dumps(row), flush=True)
    return row



def print_table(res: dict, path: str) -> None:
    print(f"\nbench_train: {res['device']} x{res['world']}, torch {res['torch']}, bf16 matmul peak measured "
          f"{res['peak_tflops_measured']:.0f} TFLOP/s (MFU columns: vs measured / vs 989; compile s: warm-up minus "
          f"best, recomp: graphs compiled during the timed reps)")
    print(f"{'arch':11} {'variant':31} {'micro':>10} {'tok/rank':>8} | {'update s':>8} {'tok/s/gpu':>9} {'MFU':>11} "
          f"{'peak GiB':>8} {'compile s':>9} {'recomp':>6} | {'logprob s':>9} {'tok/s/gpu':>9} {'MFU':>11} {'peak GiB':>8} "
          f"{'compile s':>9} {'recomp':>6}")
    for r in res["rows"]:
        if "fits_tokens" in r:
            print(f"{r['arch']:11} {r['variant']}: {r['fits_tokens']} tokens fit "
                  f"(peak {r.get('peak_gib', float('nan')):.1f} GiB)")
            continue
        cells = []
        for phase in ("update", "logprob"):
            p = r[phase]
            if "error" in p:
                cells.append(f"{p['error'][:63]:63}")
            else:
                cells.append(f"{p['s']:8.2f} {p['tok_s_gpu']:9.0f} {100 * p['mfu_measured']:4.1f}/{100 * p['mfu_989']:4.1f}% "
                             f"{p.get('peak_gib', float('nan')):8.1f} {p['compile_s']:9.1f} {p['recompiles_timed']:6d}")
        variant = r["variant"] + ("" if r.get("fused_kernels", "none") == VARIANTS[r["variant"]][3] else " (unfused!)")
        print(f"{r['arch']:11} {variant:31} {r['micro']:>10} {r['tokens_per_rank']:8d} | {cells[0]} | {cells[1]}")
    print(f"(json: {path})")


if __name__ == "__main__":
    main()
