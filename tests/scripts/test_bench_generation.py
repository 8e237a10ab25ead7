"""scripts/bench/bench_generation.py on CPU: its arguments, the processes it plans, the numbers it derives
(floors, GPU time of a trace, vLLM's start-up lines, the model's shape), the profiled window's step
hook, and the whole orchestration with a stand-in for the GPU processes, down to the printed table."""

from __future__ import annotations

import json
import os
import shlex
import sys

import pytest
import torch

from tests.helpers import ROOT

sys.path.insert(0, os.path.join(ROOT, "scripts", "bench"))

import bench_generation as bg  # noqa: E402


def test_arguments_and_the_processes_they_plan():
    args = bg.parse_args([])
    assert args.variants == bg.DEFAULT_VARIANTS.split(",") and (args.prompts, args.samples, args.max_tokens) == (
        64, 8, 512)
    assert [g for g, _ in bg.plan(args.variants)] == ["colocated", "colocated-sync", "colocated-stepgraphs", "plain-mp"]
    assert bg.plan(["sync", "ours-none", "sync-none", "ours"]) == [("colocated-sync", ["sync", "sync-none"]),
                                                                   ("colocated", ["ours-none", "ours"])]
    for bad, words in ((["--variants", "ours,nope"], "unknown ['nope']"), (["--calls", "0"], "must be >= 1"),
                       (["--max-tokens", "30"], "needs --max-tokens >= 40")):
        with pytest.raises(SystemExit):
            bg.parse_args(bad)
    assert all(v.group in bg.GROUPS for v in bg.VARIANTS.values())
    assert "plain-mp-none" in bg.describe_variants()


def test_a_worker_gets_the_runs_settings():
    args = bg.parse_args(["--arch", "qwen2-1.5b", "--prompts", "16", "--calls", "2", "--window", "8", "--out", "/o"])
    cmd = bg.worker_command(args, "colocated-sync", ["sync", "sync-none"])
    w = bg.parse_args(cmd[2:])
    assert (w.worker, w.variants, w.arch, w.prompts, w.calls, w.window, w.out, w.max_tokens, w.keep_traces) == (
        "colocated-sync", ["sync", "sync-none"], "qwen2-1.5b", 16, 2, 8, "/o", 512, False)
    assert bg.parse_args(bg.worker_command(bg.parse_args(["--keep-traces"]), "colocated", ["ours"])[2:]).keep_traces



def test_the_engine_gets_the_speed_settings_the_trainer_would_choose():
    """The shipped configs say rollout.max_num_seqs = "auto": the bench's engine gets a number, the
    trainer's choice for the GPU (here: 512 sequences at once, a call's all, on a 141 GiB GPU), and
    the key's CPU value without one."""
    from spmd_rl.preflight import speed_settings

    args = bg.parse_args([])
    on_gpu = bg.bench_config(args, bg.GROUPS["colocated"], 141 * 2**30)
    assert on_gpu.rollout.max_num_seqs == 512 and "rollout.max_num_seqs" in on_gpu.auto_chosen
    assert bg.bench_config(args, bg.GROUPS["colocated"]).rollout.max_num_seqs == \
        speed_settings.NO_GPU_VALUES[speed_settings.SEQS]

QWEN05 = {"vocab_size": 151936, "hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14,
          "num_key_value_heads": 2, "tie_word_embeddings": True}


def test_floors_from_the_shape():
    shape = bg.checkpoint_shape(QWEN05, {"model.embed_tokens.weight": [151936, 896], "rest": [358_000_000]})
    assert shape == {"params": 151936 * 896 + 358_000_000, "matmul_params": 151936 * 896 + 358_000_000,
                     "kv_bytes_per_token": 2 * 24 * 2 * 64 * 2}
    untied = bg.checkpoint_shape({**QWEN05, "tie_word_embeddings": False},
                                 {"model.embed_tokens.weight": [151936, 896], "lm_head.weight": [151936, 896]})
    assert untied["matmul_params"] == 151936 * 896  # the embedding is a lookup, lm_head a matmul
    f = bg.floors(shape, batch=512, context_mean=326.0, hbm=4.8e12, peak_tflops=800.0)
    weights, kv = 2 * shape["matmul_params"], 512 * 326 * 12288
    assert f["bw_ms"] == pytest.approx((weights + kv) / 4.8e12 * 1e3)
    assert f["mm_ms"] == pytest.approx(2 * shape["matmul_params"] * 512 / 800e12 * 1e3)
    assert bg.hbm_bandwidth("NVIDIA H200", 3000.0) == (4.8e12, "H200 nominal 4.80 TB/s")
    assert bg.hbm_bandwidth("NVIDIA H100 80GB HBM3", 3000.0)[0] == 3.35e12
    assert bg.hbm_bandwidth("NVIDIA H100 PCIe", 1700.0) == (1.7e12, "measured copy 1700 GB/s")


def test_checkpoint_shape_counts_a_saved_model(tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    for tie in (True, False):
        config = Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie)
        model = Qwen2ForCausalLM(config)
        model.save_pretrained(tmp_path / str(tie))
        with open(tmp_path / str(tie) / "config.json") as f:
            shape = bg.checkpoint_shape(json.load(f), bg.tensor_shapes(str(tmp_path / str(tie))))
        total = sum(p.numel() for p in model.parameters())
        assert shape["params"] == total and shape["matmul_params"] == total - (0 if tie else 64 * 16)
        assert shape["kv_bytes_per_token"] == 2 * 2 * 2 * 4 * 2


def kernel(ts, dur, name="k"):
    return {"ph": "X", "cat": "kernel", "ts": ts, "dur": dur, "name": name}


def test_gpu_time_is_the_union_of_kernel_intervals_per_forward():
    trace = {"traceEvents": [kernel(0, 10), kernel(5, 10), kernel(20, 10, "_gumbel_sample_kernel"),
                             kernel(40, 5, "triton_gumbel_sample_x"), {"ph": "X", "cat": "cuda_runtime", "ts": 0,
                                                                        "dur": 100, "name": "cudaGraphLaunch"}]}
    got = bg.gpu_time(trace, steps=7)
    assert got["forwards"] == 2 and got["forwards_counted"]
    assert got["gpu_ms_per_step"] == pytest.approx(30 / 1e3 / 2) and got["gpu_busy_frac"] == pytest.approx(30 / 45)
    assert got["top_kernels"][0] == {"name": "k", "ms_per_step": pytest.approx(20 / 1e3 / 2)}
    assert bg.gpu_time({"traceEvents": [kernel(0, 4)]}, steps=4)["gpu_ms_per_step"] == pytest.approx(1e-3)
    assert bg.gpu_time({"traceEvents": []}, steps=4) == {"kernels": 0}


VLLM_LOG = """\
INFO 11-24 10:00:01 [model_runner.py:306] Model loading took 0.93 GiB and 1.250000 seconds
INFO 11-24 10:00:03 [backends.py:293] Directly load the compiled graph(s) for compile range (1, 4096) from the cache
INFO 11-24 10:00:09 [monitor.py:20] torch.compile took 8.40 s in total
INFO 11-24 10:00:20 [model_runner.py:748] Graph capturing finished in 11 secs, took 0.42 GiB
INFO 11-24 10:00:21 [core.py:341] init engine (profile, create kv cache, warmup model) took 19.50 s (compilation: 8.40 s)
"""


def test_startup_lines():
    assert bg.parse_startup(VLLM_LOG) == {"model_load_s": 1.25, "compile_s": 8.4, "graphs_s": 11.0, "graphs_GiB": 0.42,
                                          "engine_init_s": 19.5, "compile_cache_loads": 1, "compiles": 0}
    cold = "Compiling a graph for compile range (1, 4096) takes 20.1 s\ntorch.compile and initial profiling/warmup " \
           "run together took 31.20 s in total\nModel loading took 0.9 GiB memory and 2.5 seconds"
    assert bg.parse_startup(cold) == {"compile_s": 31.2, "model_load_s": 2.5, "compile_cache_loads": 0, "compiles": 1}


class StandInEngine:
    def __init__(self):
        self.steps = 0

    def step(self):
        self.steps += 1
        return []


class StandInGen:
    """Runs one engine step per new token, up to `stop_after` steps."""

    def __init__(self, stop_after=10**9):
        self.llm = type("LLM", (), {"reset_prefix_cache": lambda self: True})()
        self.llm.llm_engine = StandInEngine()
        self.stop_after, self.max_new_tokens = stop_after, None

    def generate(self, prompts, sampling):
        self.max_new_tokens = sampling.max_new_tokens
        for _ in range(min(sampling.max_new_tokens, self.stop_after)):
            self.llm.llm_engine.step()


def test_the_profiled_window_sits_mid_response_and_the_step_comes_back(monkeypatch):
    from spmd_rl.rollout.base import SamplingParams

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    gen = StandInGen()
    got = bg.profiled_call(gen, [[1]], SamplingParams(max_new_tokens=512), window=32, trace_path=None)
    assert got["start_step"] == 240 and got["steps"] == 32 and got["wall_ms_per_step"] >= 0
    assert gen.max_new_tokens == 280 and gen.llm.llm_engine.steps == 280  # the call stops soon after the window
    assert "step" not in vars(gen.llm.llm_engine)  # the engine's own step again
    short = StandInGen(stop_after=100)
    assert "before the window's end" in bg.profiled_call(short, [[1]], SamplingParams(max_new_tokens=512), 32,
                                                           None)["error"]
    assert "step" not in vars(short.llm.llm_engine)


def fake_process(group: str, names: list[str], cmd: list[str], gpu: bool) -> dict:
    """What a GPU process of this group would write: round numbers per variant."""
    variants = {}
    for i, name in enumerate(names):
        v = bg.VARIANTS[name]
        window = {"start_step": 240, "steps": 32, "wall_ms_per_step": 9.0}
        if gpu:
            window.update(gpu_ms_per_step=3.2 + i, forwards=32)
        variants[name] = {"logprobs_every": {"plan": 8, "all": 1, "none": 0}[v.logprobs], "flat": v.flat,
                          "pause_gc": v.pause_gc, "window": window, "calls_s": [4.5 + i, 4.7 + i, 4.6 + i],
                          "steps": 512.0}
    return {"group": group, "device": "NVIDIA H200", "torch": "2.11", "vllm": "0.26.0", "peak_tflops": 800.0,
            "copy_GBps": 3900.0, "batch": 512, "prompt_len_mean": 70.0, "init_s": 70.0,
            "shape": bg.checkpoint_shape(QWEN05, {"all": [494_032_768]}), "engine": {"async_scheduling": True,
                                                                                    "graph_sizes": 51},
            "variants": variants, "argv": cmd}


def test_the_whole_run_with_stand_in_processes(monkeypatch, tmp_path, capsys):
    import gpu_check_runner

    def fake_run(cmd, log, timeout, env=None):
        args = bg.parse_args(cmd[2:])
        assert env["VLLM_CACHE_ROOT"] == str(tmp_path / "cache") and timeout > 0
        if args.worker == "colocated-sync":  # a process that dies before measuring anything
            open(log, "w").write("Traceback ...\nRuntimeError: CUDA out of memory\n")
            return 1, 12.0
        with open(os.path.join(args.out, f"{args.worker}.json"), "w") as f:
            json.dump(fake_process(args.worker, args.variants, cmd, gpu=args.worker != "plain-mp"), f)
        open(log, "w").write(VLLM_LOG)
        return 0, 95.0

    monkeypatch.setattr(gpu_check_runner, "run", fake_run)
    monkeypatch.delenv("VLLM_CACHE_ROOT", raising=False)
    rc = bg.main(["--out", str(tmp_path), "--variants", "ours,ours-none,sync,plain-mp-none", "--cache-dir",
                  str(tmp_path / "cache")])
    assert rc == 1  # one process failed
    report = json.load(open(tmp_path / "bench_generation_qwen2-0.5b.json"))
    rows = {r["variant"]: r for r in report["rows"]}
    ours = rows["ours"]
    assert ours["ms_step"] == pytest.approx(4.6 / 512 * 1e3) and ours["gpu_ms"] == pytest.approx(3.2)
    assert ours["cpu_ms"] == pytest.approx(4.6 / 512 * 1e3 - 3.2) and ours["logprobs"] == "1 in 8 (flat, GC off)"
    weights, kv = 2 * 494_032_768, 512 * (70 + 256) * 12288
    assert ours["bw_ms"] == pytest.approx((weights + kv) / 4.8e12 * 1e3)
    assert ours["mm_ms"] == pytest.approx(2 * 494_032_768 * 512 / 800e12 * 1e3)
    assert rows["ours-none"]["gpu_ms"] == pytest.approx(4.2) and rows["ours-none"]["logprobs"] == "none"
    assert "gpu_ms" not in rows["plain-mp-none"] and rows["plain-mp-none"]["ms_step"] > 0
    assert rows["sync"]["error"] == "exit 1" and rows["sync"]["calls_s"] == []
    out = capsys.readouterr().out
    table = out[out.index("bench_generation qwen2-0.5b on NVIDIA H200"):]
    line = next(s for s in table.splitlines() if s.startswith("ours "))
    assert shlex.split(line)[:4] == ["ours", "1", "in", "8"] and "4.50 4.70 4.60" in line
    assert line.split()[-6:] == ["512", "9.0", "3.2", "5.8", "0.63", "0.63"], line
    plain = next(s for s in table.splitlines() if s.startswith("plain-mp-none"))
    assert plain.split()[-4:] == ["-", "-", "0.63", "0.63"], plain
    assert "colocated             exit 0, engine 70 s (vLLM init 20: model 1.2, compile 8.4, graphs 11 s / 0.42 GiB; " \
           "compile cache hit); async scheduling True, 51 graph sizes; process 95 s" in table
    assert f"colocated-sync        exit 1: exit 1 (log {tmp_path}/colocated-sync.log)" in table
    assert next(s for s in table.splitlines() if s.startswith("sync ")).split()[1:] == ["-", "exit", "1"] + ["-"] * 6
