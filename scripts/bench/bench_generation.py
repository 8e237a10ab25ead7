"""Where a decode step's time goes: the rollout of one training step on one GPU, per engine variant.

    python scripts/bench/bench_generation.py --arch qwen2-0.5b --out $OUT          (the default variants, ~8 min H200)
    python scripts/bench/bench_generation.py --arch qwen2-1.5b --out $OUT --variants ours,ours-none,ours-all
    python scripts/bench/bench_generation.py --list                                 (the variants and their processes)

The work is scripts/bench/bench_step.sh's rollout: --prompts arithmetic prompts (character tokenizer) x
--samples samples, --max-tokens new tokens with EOS ignored, a random-weight Qwen2 shape
(tests/gpu/runs.py), the engine settings of configs/qwen{0.5b,1.5b}-gsm8k.toml with bench_step's
max_num_batched_tokens = 4096. Variants that can share one engine (the log-prob request and its
conversion are per call) run in one process; every other engine setting gets a fresh process (vLLM
allows one sleep-mode engine per process), run one after the other by this script. All processes
share one vLLM compile cache (VLLM_CACHE_ROOT = --cache-dir, by default a new directory): the first
compiles, the others start as a restart on the same machine would (the start-up lines say whether
the cache was hit; pass the --cache-dir of an earlier run to see warm starts only).

Per variant, one profiled call (also the variant's warm-up) runs decode steps [S, S + --window)
(S: mid-response) under torch.profiler (CUDA activity only), then --calls timed calls, each after
a prefix-cache reset (as after a weight sync). Columns:
  s/call   wall seconds of each timed generate call
  steps    decode steps: the mean response length (= --max-tokens, EOS being ignored)
  ms/step  median s/call / steps (prefill included: a few steps' worth)
  GPU ms   GPU busy time per decode step in the profiled window: the union of its kernels'
           intervals / the forward passes in it (its sampling kernels counted)
  CPU ms   ms/step - GPU ms: what the GPU waits for the host (scheduling, outputs, launches)
  BW ms    bandwidth floor: (matmul weights + the mean KV cache of a step) bytes / HBM bandwidth
           (4.8 TB/s H200, 3.35 TB/s H100 SXM, else the copy bandwidth measured in the process)
  MM ms    matmul floor: 2 x matmul parameters x batch / bf16 matmul peak measured in the process
Per process: engine start-up seconds, vLLM's split of them (model load, torch.compile, CUDA-graph
capture) and compile-cache loads. plain-mp runs the engine core in another process: no GPU column.
Writes --out/bench_generation_<arch>.json and each process's log and JSON (--keep-traces: the traces).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import statistics
import sys
import tempfile
import time
from typing import NamedTuple

SCRIPTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # scripts/: gpu_check_runner
ROOT = os.path.dirname(SCRIPTS)
sys.path.insert(0, ROOT)
sys.path.insert(0, SCRIPTS)

import gpu_check_runner  # noqa: E402  (runs each process with its log and time limit)


class Group(NamedTuple):
    """One engine, in one process: its layout and its config overrides on top of the bench's."""

    layout: str  # "colocated" (spmd_rl's VLLMEngine), "plain-mp" / "plain-inproc" (vllm.LLM)
    overrides: tuple[str, ...]
    doc: str


class Variant(NamedTuple):
    group: str
    logprobs: str  # "plan" (the shipped rule: Config.rollout_logprobs_plan), "all" or "none"
    flat: bool  # log-probs in vLLM's flat lists (SamplingParams.flat_logprobs)
    pause_gc: bool  # the garbage collector paused during the call
    doc: str
    streamed: bool = False  # the requests run as a streamed run (VLLMEngine.start: partial rollouts), n = 1 each


GROUPS = {
    "colocated": Group("colocated", (), "our engine as shipped: external_launcher, sleep mode, in-process"),
    "colocated-sync": Group("colocated", ("rollout.engine_kwargs={async_scheduling=false}",),
                            "our engine, async scheduling off"),
    "colocated-stepgraphs": Group("colocated", ("rollout.cudagraph_step_sizes=true",),
                                  "our engine, CUDA graphs of this run's batch sizes only"),
    "colocated-noprefix": Group("colocated", ("rollout.enable_prefix_caching=false",),
                                "our engine, prefix caching off (no block hashing)"),
    "colocated-block16": Group("colocated", ("rollout.block_size=0",),
                               "our engine, vLLM's default KV blocks of 16 tokens (ours: 64)"),
    "colocated-block128": Group("colocated", ("rollout.block_size=128",), "our engine, KV blocks of 128 tokens"),
    "colocated-eager": Group("colocated", ("rollout.enforce_eager=true",), "our engine without CUDA graphs"),
    "plain-mp": Group("plain-mp", (), "plain vllm.LLM in its default layout: the engine core in its own process"),
    "plain-inproc": Group("plain-inproc", (), "plain vllm.LLM, the engine core in this thread"),
}

VARIANTS = {
    "ours": Variant("colocated", "plan", True, True, "as shipped: log-probs of every 8th prompt (mismatch metrics)"),
    "ours-none": Variant("colocated", "none", True, True, "no rollout log-probs"),
    "ours-all": Variant("colocated", "all", True, True, "every prompt's log-probs (TIS/MIS runs), flat, GC paused"),
    "ours-all-streamed": Variant("colocated", "all", True, True, "every prompt's, as partial rollouts run them: "
                                 "a streamed run advanced 64 engine steps at a time", streamed=True),
    "ours-all-flat": Variant("colocated", "all", True, False, "every prompt's, flat lists, GC running"),
    "ours-all-gc": Variant("colocated", "all", False, True, "every prompt's, vLLM's dicts, GC paused"),
    "ours-all-dicts": Variant("colocated", "all", False, False, "every prompt's, vLLM's dicts, GC running (a9e81bb)"),
    "sync": Variant("colocated-sync", "plan", True, True, "as shipped, async scheduling off"),
    "sync-none": Variant("colocated-sync", "none", True, True, "no log-probs, async scheduling off"),
    "stepgraphs": Variant("colocated-stepgraphs", "plan", True, True, "as shipped, rollout.cudagraph_step_sizes"),
    "noprefix": Variant("colocated-noprefix", "plan", True, True, "as shipped, prefix caching off"),
    "block16": Variant("colocated-block16", "plan", True, True, "as shipped, KV blocks of 16 tokens (before a 2026-11-25 change)"),
    "block128": Variant("colocated-block128", "plan", True, True, "as shipped, KV blocks of 128 tokens"),
    "eager": Variant("colocated-eager", "plan", True, True, "as shipped, no CUDA graphs"),
    "plain-mp-none": Variant("plain-mp", "none", False, False, "plain vLLM, default layout, no log-probs"),
    "plain-mp-all": Variant("plain-mp", "all", False, False, "plain vLLM, default layout, every prompt's (dicts)"),
    "plain-none": Variant("plain-inproc", "none", False, False, "plain vLLM in this thread, no log-probs"),
    "plain-all": Variant("plain-inproc", "all", False, False, "plain vLLM in this thread, every prompt's (dicts)"),
}

DEFAULT_VARIANTS = "ours,ours-none,ours-all,ours-all-flat,ours-all-dicts,sync,stepgraphs,plain-mp-none"

CONFIGS = {"qwen2-0.5b": "configs/qwen0.5b-gsm8k.toml", "qwen2-1.5b": "configs/qwen1.5b-gsm8k.toml"}

HBM_BYTES_PER_S = (("H200", 4.8e12), ("H100", 3.35e12))  # nominal, SXM (an H100 PCIe has 2.0 TB/s)

STARTUP = {  # vLLM 0.26's start-up log lines -> seconds (GiB) of each part
    "model_load_s": r"Model loading took [\d.]+ GiB (?:memory )?and ([\d.]+) seconds",
    "compile_s": r"torch\.compile (?:and initial profiling/warmup run together )?took ([\d.]+) s in total",
    "graphs_s": r"Graph capturing finished in ([\d.]+) secs",
    "graphs_GiB": r"Graph capturing finished in [\d.]+ secs, took ([\d.]+) GiB",
    "engine_init_s": r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s",
}
STARTUP_COUNTS = {"compile_cache_loads": r"Directly load the compiled graph", "compiles": r"Compiling a graph for "}


# --------------------------------------------------------------------------- arguments and plan


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="qwen2-0.5b", choices=sorted(CONFIGS))
    ap.add_argument("--variants", default=DEFAULT_VARIANTS, help="comma-separated, from --list")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--samples", type=int, default=8, help="samples per prompt (rollout.n)")
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--calls", type=int, default=3, help="timed generate calls per variant")
    ap.add_argument("--window", type=int, default=32, help="decode steps under the profiler")
    ap.add_argument("--deadline-s", type=float, default=540.0, help="no process starts after this; one running is "
                    "stopped at it (the results so far are kept)")
    ap.add_argument("--out", default="/tmp/bench_generation")
    ap.add_argument("--cache-dir", default="", help="vLLM's compile cache (VLLM_CACHE_ROOT) of every process; default: a "
                    "new directory under /tmp (the first process compiles, the others find it)")
    ap.add_argument("--keep-traces", action="store_true", help="keep the profiler traces (--out/trace_*.json, MBs)")
    ap.add_argument("--list", action="store_true", help="print the variants and exit")
    ap.add_argument("--worker", default="", help=argparse.SUPPRESS)  # internal: run one process's group
    args = ap.parse_args(argv)
    names = [v for v in args.variants.split(",") if v]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown or not names:
        ap.error(f"--variants: unknown {unknown or 'none given'}; choose from {', '.join(VARIANTS)}")
    if min(args.prompts, args.samples, args.max_tokens, args.calls, args.window) < 1:
        ap.error("--prompts, --samples, --max-tokens, --calls and --window must be >= 1")
    if args.window + 8 > args.max_tokens:
        ap.error(f"--window {args.window} needs --max-tokens >= {args.window + 8}")
    args.variants = names
    return args


def plan(names: list[str]) -> list[tuple[str, list[str]]]:
    """The processes to run: (group, its variants in the order given), groups in order of first mention."""
    groups: dict[str, list[str]] = {}
    for name in names:
        groups.setdefault(VARIANTS[name].group, []).append(name)
    return list(groups.items())


def describe_variants() -> str:
    lines = []
    for group, g in GROUPS.items():
        lines.append(f"{group}: {g.doc}" + (f" ({', '.join(g.overrides)})" if g.overrides else ""))
        lines += [f"  {name:16s} {v.doc}" for name, v in VARIANTS.items() if v.group == group]
    return "\n".join(lines + [f"default: {DEFAULT_VARIANTS}"])


def worker_command(args: argparse.Namespace, group: str, names: list[str]) -> list[str]:
    return [sys.executable, os.path.abspath(__file__), "--arch", args.arch, "--prompts", str(args.prompts),
            "--samples", str(args.samples), "--max-tokens", str(args.max_tokens), "--calls", str(args.calls),
            "--window", str(args.window), "--out", args.out, "--worker", group, "--variants", ",".join(names)] + (
        ["--keep-traces"] if args.keep_traces else [])


# --------------------------------------------------------------------------- numbers


def checkpoint_shape(config: dict, tensor_shapes: dict[str, list[int]]) -> dict:
    """Parameters a decode step multiplies by (the embedding only as a tied lm_head) and KV-cache
    bytes per token (bf16), from config.json and the checkpoint's tensor shapes."""
    total = sum(_numel(s) for s in tensor_shapes.values())
    emb = config["vocab_size"] * config["hidden_size"]
    tied = config.get("tie_word_embeddings", False) or "lm_head.weight" not in tensor_shapes
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return {"params": total, "matmul_params": total if tied else total - emb,
            "kv_bytes_per_token": 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 2}


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def hbm_bandwidth(device_name: str, copy_GBps: float) -> tuple[float, str]:
    """(bytes per second, where the number comes from) of the device's memory."""
    if "PCIe" not in device_name:
        for name, bw in HBM_BYTES_PER_S:
            if name in device_name:
                return bw, f"{name} nominal {bw / 1e12:.2f} TB/s"
    return copy_GBps * 1e9, f"measured copy {copy_GBps:.0f} GB/s"


def floors(shape: dict, batch: int, context_mean: float, hbm: float, peak_tflops: float) -> dict:
    """Per decode step: the bandwidth floor (weights + mean KV cache read once) and the matmul
    floor (2 flops per matmul parameter per sequence at the measured peak), in ms."""
    weights = 2 * shape["matmul_params"]
    kv = batch * context_mean * shape["kv_bytes_per_token"]
    return {"weights_GB": weights / 1e9, "kv_GB": kv / 1e9, "bw_ms": (weights + kv) / hbm * 1e3,
            "mm_ms": 2 * shape["matmul_params"] * batch / (peak_tflops * 1e12) * 1e3}


def gpu_time(trace: dict, steps: int) -> dict:
    """GPU busy time of a chrome trace's CUDA kernels (the union of their intervals), per forward
    pass: the sampler's Gumbel kernels counted (one per forward), else `steps`."""
    kernels = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in trace.get("traceEvents", [])
                     if e.get("cat") == "kernel" and e.get("ph") == "X")
    if not kernels:
        return {"kernels": 0}
    busy, end = 0.0, float("-inf")
    for start, stop, _ in kernels:
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    sampled = sum("gumbel_sample" in name for _, _, name in kernels)
    forwards = sampled or steps
    per_name: dict[str, float] = {}
    for start, stop, name in kernels:
        per_name[name] = per_name.get(name, 0.0) + stop - start
    span = max(s for _, s, _ in kernels) - kernels[0][0]
    top = sorted(per_name.items(), key=lambda kv: -kv[1])[:8]
    return {"kernels": len(kernels), "forwards": forwards, "forwards_counted": bool(sampled),
            "gpu_ms_per_step": busy / 1e3 / forwards, "kernels_per_step": len(kernels) / forwards,
            "gpu_busy_frac": busy / span if span > 0 else 1.0,
            "top_kernels": [{"name": n[:120], "ms_per_step": us / 1e3 / forwards} for n, us in top]}


def parse_startup(log: str) -> dict:
    """Start-up seconds vLLM logged (first of each line), and how often it loaded or compiled a graph."""
    out: dict = {}
    for key, pattern in STARTUP.items():
        m = re.search(pattern, log)
        if m:
            out[key] = float(m.group(1))
    out.update({key: len(re.findall(pattern, log)) for key, pattern in STARTUP_COUNTS.items()})
    return out


def variant_row(name: str, v: dict, proc: dict) -> dict:
    """A table row from a variant's raw measurements and its process's."""
    calls = v.get("calls_s", [])
    row = {"variant": name, "group": VARIANTS[name].group, "logprobs": logprob_label(v), "calls_s": calls,
           "steps": v.get("steps", float("nan"))}
    if calls:
        row["ms_step"] = statistics.median(calls) / row["steps"] * 1e3
    window = v.get("window") or {}
    if "gpu_ms_per_step" in window:
        row["gpu_ms"] = window["gpu_ms_per_step"]
        if "ms_step" in row:
            row["cpu_ms"] = row["ms_step"] - row["gpu_ms"]
    shape, batch = proc.get("shape"), proc.get("batch")
    if shape and batch and proc.get("peak_tflops"):
        hbm, _ = hbm_bandwidth(proc.get("device", ""), proc.get("copy_GBps", float("nan")))
        row.update(floors(shape, batch, proc["prompt_len_mean"] + row["steps"] / 2, hbm, proc["peak_tflops"]))
    return row


def logprob_label(v: dict) -> str:
    every = v.get("logprobs_every")
    if every is None:
        return "?"
    if every == 0:
        return "none"
    how = ("flat" if v.get("flat") else "dicts") + (", GC off" if v.get("pause_gc") else "")
    return f"{'all' if every == 1 else f'1 in {every}'} ({how})"


def _f(x, fmt: str = ".1f") -> str:
    return "-" if x is None or (isinstance(x, float) and x != x) else format(x, fmt)


def format_table(report: dict) -> str:
    a, rows = report["args"], report["rows"]
    head = (f"bench_generation {a['arch']} on {report.get('device', '?')} (torch {report.get('torch', '?')}, vLLM "
            f"{report.get('vllm', '?')}): {a['prompts']} prompts x {a['samples']} = {a['prompts'] * a['samples']} "
            f"sequences, {a['max_tokens']} new tokens; floors: HBM {report.get('hbm', '?')}, bf16 matmul peak "
            f"{_f(report.get('peak_tflops'), '.0f')} TFLOP/s")
    cols = f"{'variant':15s} {'log-probs':24s} {'s/call':>17s} {'steps':>5s} {'ms/step':>7s} {'GPU ms':>6s} " \
           f"{'CPU ms':>6s} {'BW ms':>5s} {'MM ms':>5s}"
    lines = ["", "=" * len(cols), head, "-" * len(cols), cols]
    for r in rows:
        calls = " ".join(f"{s:.2f}" for s in r["calls_s"]) or r.get("error", "-")
        lines.append(f"{r['variant']:15s} {r['logprobs']:24s} {calls:>17s} {_f(r['steps'], '.0f'):>5s} "
                     f"{_f(r.get('ms_step')):>7s} {_f(r.get('gpu_ms')):>6s} {_f(r.get('cpu_ms')):>6s} "
                     f"{_f(r.get('bw_ms'), '.2f'):>5s} {_f(r.get('mm_ms'), '.2f'):>5s}")
    lines += ["-" * len(cols), "processes (start-up s: engine = our constructor or vllm.LLM; vLLM's own split):"]
    for group, p in report["processes"].items():
        s = p.get("startup", {})
        if "init_s" not in p:
            lines.append(f"  {group:21s} exit {p.get('rc', '-')}: {p.get('error', '?')} (log {p.get('log', '-')})")
            continue
        cache = ("compile cache hit" if s.get("compile_cache_loads") and not s.get("compiles") else
                 "compiled" if s.get("compiles") else "no compile lines")
        lines.append(f"  {group:21s} exit {p.get('rc', '?')}, engine {_f(p.get('init_s'), '.0f')} s (vLLM init "
                     f"{_f(s.get('engine_init_s'), '.0f')}: model {_f(s.get('model_load_s'))}, compile "
                     f"{_f(s.get('compile_s'))}, graphs {_f(s.get('graphs_s'), '.0f')} s / "
                     f"{_f(s.get('graphs_GiB'), '.2f')} GiB; {cache}); async scheduling "
                     f"{p.get('engine', {}).get('async_scheduling', '?')}, {p.get('engine', {}).get('graph_sizes', '?')} "
                     f"graph sizes; process {_f(p.get('process_s'), '.0f')} s")
    lines.append(f"json: {report.get('json', '?')}")
    return "\n".join(lines)


def build_report(args: argparse.Namespace, processes: dict[str, dict]) -> dict:
    rows = []
    for name in args.variants:
        proc = processes.get(VARIANTS[name].group, {})
        v = proc.get("variants", {}).get(name)
        rows.append(variant_row(name, v, proc) if v else
                    {"variant": name, "group": VARIANTS[name].group, "logprobs": "-", "calls_s": [],
                     "steps": float("nan"), "error": proc.get("error", "not run")})
    first = next((p for p in processes.values() if "device" in p), {})
    hbm = hbm_bandwidth(first["device"], first.get("copy_GBps", float("nan")))[1] if first else "?"
    return {"args": {k: getattr(args, k) for k in ("arch", "prompts", "samples", "max_tokens", "calls", "window",
                                                    "variants")},
            "device": first.get("device"), "torch": first.get("torch"), "vllm": first.get("vllm"), "hbm": hbm,
            "peak_tflops": first.get("peak_tflops"), "rows": rows, "processes": processes}


# --------------------------------------------------------------------------- one process (GPU)


def bench_config(args: argparse.Namespace, group: Group, device_total: float | None = None):
    """The shipped config of the shape with bench_step.sh's settings and the group's overrides, its
    "auto" speed settings chosen as the trainer chooses them for a GPU of `device_total` bytes
    (spmd_rl/preflight/speed_settings.py; None: without a GPU)."""
    from spmd_rl.config.run_config import load_config
    from spmd_rl.preflight import speed_settings

    cfg = load_config(os.path.join(ROOT, CONFIGS[args.arch]), [
        'model.init="random"', f'model.arch="{args.arch}"', 'model.tokenizer="char"', 'model.path=""',
        "data.apply_chat_template=false", "data.max_prompt_length=128", f"data.max_response_length={args.max_tokens}",
        "data.val_files=[]",
        f"data.train_batch_size={args.prompts}", f"rollout.n={args.samples}", "rollout.max_num_batched_tokens=4096",
        *group.overrides])
    speed_settings.resolve(cfg, 1, device_total)
    return cfg


def bench_prompts(count: int) -> list[list[int]]:
    from spmd_rl.data.prompts import tokenize_prompt
    from spmd_rl.data.synthetic import synthetic_rows
    from spmd_rl.model.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    return [tokenize_prompt(tok, p, False) for p in synthetic_rows("arithmetic", count, 0, "train")["prompt"]]


def checkpoint_tensors(model_dir: str, device: str = "cuda"):
    """(name, tensor) of every tensor of the model directory's safetensors files, on `device`."""
    import glob

    from safetensors import safe_open

    for path in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        with safe_open(path, "pt", device=device) as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def tensor_shapes(model_dir: str) -> dict[str, list[int]]:
    import glob

    from safetensors import safe_open

    shapes = {}
    for path in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        with safe_open(path, "pt") as f:
            shapes.update({name: list(f.get_slice(name).get_shape()) for name in f.keys()})
    return shapes


class Colocated:
    """spmd_rl's VLLMEngine with the checkpoint's weights loaded, EOS ignored (random weights)."""

    def __init__(self, cfg, model_dir: str):
        import functools

        from spmd_rl.rollout.vllm import engine as vllm_engine
        from spmd_rl.runtime.distributed import init_distributed

        vllm_engine.to_vllm_sampling = functools.partial(vllm_engine.to_vllm_sampling, ignore_eos=True)
        env = init_distributed("cuda")
        self.eng = vllm_engine.VLLMEngine(cfg, model_dir, env.rank, env.world_size, env.local_rank,
                                          env.local_world_size)
        self.init_s = self.eng.init_seconds
        self.eng.stop_ids = []
        self.eng.wake_up(["weights"])
        self.eng.load_weights(checkpoint_tensors(model_dir))
        self.eng.wake_up(["kv_cache"])
        self.llm = self.eng.llm
        self.streamed = False  # the variant's (Variant.streamed), set before each

    def levers(self, flat: bool, pause_gc: bool) -> None:
        self.eng.flat_logprobs, self.eng.pause_gc = flat, pause_gc

    def generate(self, prompts, sampling):
        if not self.streamed:
            return self.eng.generate(prompts, sampling)
        rows = [p for p in prompts for _ in range(sampling.n)]  # n = 1 a request, as partial rollouts ask
        run, done = self.eng.start(rows, dataclasses.replace(sampling, n=1)), {}
        while len(done) < len(rows):
            done.update(run.advance(64))
        run.stop()
        return [[done[k * sampling.n + i] for i in range(sampling.n)] for k in range(len(prompts))]

    def close(self) -> None:
        import torch.distributed as dist

        self.eng.close()
        dist.destroy_process_group()


class Plain:
    """A plain vllm.LLM reading the checkpoint, the same settings without sleep mode; requests as
    ours (a seed each, log-probs per prompt), EOS ignored."""

    def __init__(self, cfg, model_dir: str):
        from vllm import LLM

        from spmd_rl.rollout.vllm.engine import engine_kwargs

        t0 = time.perf_counter()
        self.llm = LLM(**engine_kwargs(cfg, model_dir, cfg.rollout.seed, dummy=False, sleep_mode=False,
                                       distributed_executor_backend=None))
        self.init_s = time.perf_counter() - t0
        self.flat = self.pause_gc = False

    def levers(self, flat: bool, pause_gc: bool) -> None:
        self.flat, self.pause_gc = flat, pause_gc

    def generate(self, prompts, sampling):
        from spmd_rl.rollout.vllm.engine import to_vllm_sampling
        from spmd_rl.rollout.vllm.outputs import completion, paused_gc

        asks = sampling.asks_logprobs(len(prompts))
        sps = [to_vllm_sampling(sampling, [], ask, self.flat, seed=j, ignore_eos=True) for j, ask in enumerate(asks)]
        with paused_gc(self.pause_gc):
            outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False)
            return [[completion(c, ask) for c in o.outputs] for o, ask in zip(outs, asks)]

    def close(self) -> None:
        pass


def profiled_call(gen, prompts, sampling, window: int, trace_path: str | None) -> dict:
    """One call that stops after the profiled window: engine steps [start, start + window) (one
    forward each once decoding) under torch.profiler when `trace_path` is given (CUDA only), the
    GPU synchronised at its end; returns the window's wall ms per step and its GPU time."""
    import torch

    start = max(sampling.max_new_tokens // 2 - window // 2, 4)
    sp = dataclasses.replace(sampling, max_new_tokens=min(sampling.max_new_tokens, start + window + 8))
    engine = gen.llm.llm_engine
    step_fn = engine.step
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) if trace_path else None
    state = {"n": 0}

    def step():
        state["n"] += 1
        if state["n"] == start:
            if prof is not None:
                prof.start()
            state["t0"] = time.perf_counter()
        out = step_fn()
        if state["n"] == start + window - 1:
            torch.cuda.synchronize()
            state["t1"] = time.perf_counter()
            if prof is not None:
                prof.stop()
        return out

    engine.step = step
    try:
        gen.llm.reset_prefix_cache()
        gen.generate(prompts, sp)
    finally:
        del engine.step
    if "t1" not in state:
        if "t0" in state and prof is not None:
            prof.stop()
        return {"error": f"the call ended after {state['n']} engine steps, before the window's end"}
    res = {"start_step": start, "steps": window, "wall_ms_per_step": (state["t1"] - state["t0"]) * 1e3 / window}
    if prof is not None:
        prof.export_chrome_trace(trace_path)
        with open(trace_path) as f:
            res.update(gpu_time(json.load(f), window))
    return res


def engine_settings(llm) -> dict:
    cfg = getattr(llm.llm_engine, "vllm_config", None)
    if cfg is None:
        return {}
    sizes = cfg.compilation_config.cudagraph_capture_sizes or []
    return {"async_scheduling": cfg.scheduler_config.async_scheduling, "graph_sizes": len(sizes),
            "max_graph_size": max(sizes) if sizes else 0}


def _load(path: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(path))[0], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_group(args: argparse.Namespace) -> None:
    """This process's engine and variants; its JSON (rewritten after each variant) under --out."""
    import torch
    from bench_rollout import bandwidths
    from bench_train import matmul_peak_tflops

    from spmd_rl.rollout.base import SamplingParams

    runs = _load(os.path.join(ROOT, "tests", "gpu", "runs.py"))  # by path: a "tests" package may be installed

    group = GROUPS[args.worker]
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"{args.worker}.json")
    res: dict = {"group": args.worker, "layout": group.layout, "variants": {}}

    def save() -> None:
        with open(path + ".tmp", "w") as f:
            json.dump(res, f, indent=1)
        os.replace(path + ".tmp", path)

    try:
        # where vLLM's engine core runs: read when the engine is built (ours sets "0" itself)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if group.layout == "plain-mp" else "0"
        torch.cuda.set_device(0)
        dev = torch.device("cuda", 0)
        import vllm

        res.update(device=torch.cuda.get_device_name(dev), torch=torch.__version__, vllm=vllm.__version__,
                   peak_tflops=matmul_peak_tflops(dev), copy_GBps=bandwidths(1)["copy_GBps"])
        torch.cuda.empty_cache()  # the engine sizes its pool from the free memory
        model_dir = runs.random_model_dir(args.arch)
        with open(os.path.join(model_dir, "config.json")) as f:
            res["shape"] = checkpoint_shape(json.load(f), tensor_shapes(model_dir))
        cfg = bench_config(args, group, torch.cuda.mem_get_info(dev)[1])
        prompts = bench_prompts(args.prompts)
        res.update(batch=args.prompts * args.samples, prompt_len_mean=sum(map(len, prompts)) / len(prompts))
        gen = Colocated(cfg, model_dir) if group.layout == "colocated" else Plain(cfg, model_dir)
        res["init_s"] = gen.init_s
        res["engine"] = engine_settings(gen.llm)
        save()
        every_of = {"plan": cfg.rollout_logprobs_plan()[0], "all": 1, "none": 0}
        for name in args.variants:
            v = VARIANTS[name]
            gen.levers(v.flat, v.pause_gc)
            gen.streamed = v.streamed
            sampling = SamplingParams(n=args.samples, temperature=1.0, max_new_tokens=args.max_tokens, seed=1,
                                      logprobs_every=every_of[v.logprobs])
            out = {"logprobs_every": sampling.logprobs_every, "flat": v.flat, "pause_gc": v.pause_gc}
            trace = None if group.layout == "plain-mp" else os.path.join(args.out, f"trace_{name}.json")
            out["window"] = profiled_call(gen, prompts, sampling, args.window, trace)
            if trace and os.path.exists(trace) and not args.keep_traces:
                os.remove(trace)
            calls, lengths, asked = [], [], 0
            for _ in range(args.calls):
                gen.llm.reset_prefix_cache()
                torch.cuda.synchronize()
                t = time.perf_counter()
                comps = gen.generate(prompts, sampling)
                calls.append(time.perf_counter() - t)
                lengths = [len(c.token_ids) for group_ in comps for c in group_]
                asked = sum(c.logprobs is not None for group_ in comps for c in group_)
            out.update(calls_s=calls, steps=sum(lengths) / len(lengths), rows_with_logprobs=asked)
            res["variants"][name] = out
            save()
            print(f"[bench_generation] {name}: {' '.join(f'{s:.2f}' for s in calls)} s per call", flush=True)
        gen.close()
    except BaseException as e:  # the parent reads what was measured and the error
        res["error"] = f"{type(e).__name__}: {e}"
        save()
        raise


# --------------------------------------------------------------------------- the orchestrator


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list:
        print(describe_variants())
        return 0
    if args.worker:
        run_group(args)
        return 0
    os.makedirs(args.out, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    env["VLLM_CACHE_ROOT"] = os.path.abspath(args.cache_dir or tempfile.mkdtemp(prefix="bench_generation_cache_"))
    deadline = time.time() + args.deadline_s
    processes: dict[str, dict] = {}
    for group, names in plan(args.variants):
        left = deadline - time.time()
        if left < 60:
            processes[group] = {"error": "skipped: --deadline-s reached"}
            continue
        log = os.path.join(args.out, f"{group}.log")
        rc, seconds = gpu_check_runner.run(worker_command(args, group, names), log, left, env)
        proc_json = os.path.join(args.out, f"{group}.json")
        proc = json.load(open(proc_json)) if os.path.exists(proc_json) else {}
        with open(log, errors="replace") as f:
            proc.update(rc=rc, process_s=seconds, log=log, startup=parse_startup(f.read()))
        if rc and "error" not in proc:
            proc["error"] = "timed out" if rc == 124 else f"exit {rc}"
        processes[group] = proc
        print(f"[bench_generation] {group}: exit {rc} after {seconds:.0f} s", flush=True)
    report = build_report(args, processes)
    report["json"] = os.path.join(args.out, f"bench_generation_{args.arch}.json")
    with open(report["json"], "w") as f:
        json.dump(report, f, indent=1)
    print(format_table(report), flush=True)
    return 0 if all(p.get("rc") == 0 for p in processes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
