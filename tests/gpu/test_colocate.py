"""GPU checks of the colocated FSDP2 actor + vLLM engine (python -m pytest tests/gpu -m gpu).

Each layout runs once, as a torchrun subprocess of tests/gpu/colocate_worker.py (one process per
GPU, exactly like training); the tests below judge its JSON. Random-weight models of real Qwen2
shapes are written to /tmp (SPMD_RL_GPU_MODEL_ROOT), no hub. Worker logs go to
SPMD_RL_GPU_LOG_DIR when set (else pytest's tmp dir).

Layouts: qwen2-0.5b (tied) TP=1 on 1 GPU, run with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
(the training setting that used to keep sleep from freeing memory); on 2 GPUs qwen2-7b (untied)
TP=2 and qwen2-0.5b TP=1 x 2 replicas. SPMD_RL_GPU_FULL=1 adds qwen2-0.5b TP=2 and qwen2-7b 1 x 2;
SPMD_RL_GPU_LAYOUTS=name,name picks layouts by id (in that order); SPMD_RL_GPU_WORKER_TIMEOUT
(seconds, default 1200) bounds each worker.

Tolerances (bf16):
  (a) actor vs from_pretrained, same bf16 weights and kernels: mean |d log p| <= 0.01 nats,
      max <= 0.1, ||d logits|| / ||logits|| <= 1e-2 (measured: 0 exactly for 0.5B and 7B; the
      meta-device/to_empty bug gave 0.57-1.3 nats);
  (b) synced dummy engine vs engine loaded from disk: max |d log p| <= 1e-3 (measured: 0 exactly,
      same weights and kernels); actor vs synced engine no worse than transformers vs the disk
      engine (+2e-3; measured equal: 0.0086 for 0.5B, 0.054 for 7B TP=2) and <= 0.15 nats on every
      cycle (perturbed random weights grow it: 0.094 for 7B); sampled-token log-probs vs the actor's
      log_softmax(logits / T): mean <= 0.15 (measured 0.011 for 0.5B, 0.07 for 7B at T = 0.8) and
      under half the mismatch against temperature 1 (which processed log-probs must not match);
  (c) sleep gives back >= 90% of what waking took, leaves <= 3 GiB of the engine behind after
      start-up (vLLM's buffers outside its sleep pool and CUDA graphs; measured with vLLM 0.26:
      2.1-2.4 GiB for 0.5B eager, 2.7 GiB for 7B TP=2 eager, 1.5 GiB for 1.5B with CUDA graphs;
      close() returns it), and free memory drifts < 0.25 GiB over the wake/sync/sleep cycles
      after a one-time <= 0.5 GiB warm-up of the first rollout (measured 0.29 GiB).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("colocate_worker.py")

pytestmark = pytest.mark.gpu


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _skip_reason(nproc: int) -> str | None:
    if not torch.cuda.is_available():
        return "needs CUDA"
    if importlib.util.find_spec("vllm") is None:
        return "needs vllm (pip install -e .[vllm])"
    if _gpus() < nproc:
        return f"needs {nproc} GPUs, {_gpus()} visible"
    return None


LAYOUTS = [
    ("0.5b-tp1", 1, ["--arch", "qwen2-0.5b", "--tp", "1", "--train-steps", "60"],
     {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}),
    ("7b-tp2", 2, ["--arch", "qwen2-7b", "--tp", "2", "--gpu-mem", "0.4"], {}),
    ("0.5b-tp1x2", 2, ["--arch", "qwen2-0.5b", "--tp", "1", "--train-steps", "60"], {}),
]
if os.environ.get("SPMD_RL_GPU_FULL") == "1":
    LAYOUTS += [
        ("0.5b-tp2", 2, ["--arch", "qwen2-0.5b", "--tp", "2"], {}),
        ("7b-tp1x2", 2, ["--arch", "qwen2-7b", "--tp", "1", "--gpu-mem", "0.4"], {}),
    ]

if os.environ.get("SPMD_RL_GPU_LAYOUTS"):  # e.g. "7b-tp2,0.5b-tp1x2"
    _by_name = {layout[0]: layout for layout in LAYOUTS}
    LAYOUTS = [_by_name[n] for n in os.environ["SPMD_RL_GPU_LAYOUTS"].split(",") if n in _by_name]


def run_worker(name: str, nproc: int, args: list[str], extra_env: dict, base: Path) -> list[dict]:
    out = base / name
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", **extra_env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(WORKER),
           *args, "--out", str(out), "--model-root", os.environ.get("SPMD_RL_GPU_MODEL_ROOT", "/tmp/spmd_rl_models")]
    timeout = float(os.environ.get("SPMD_RL_GPU_WORKER_TIMEOUT", "1200"))
    with open(out / "log.txt", "w") as log:
        # own session: on timeout the whole group (torchrun and its workers) goes, not just torchrun
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            pytest.fail(f"worker {name} ran past {timeout:.0f}s; log: {out}/log.txt\n"
                        + (out / "log.txt").read_text()[-3000:])
    results = []
    for r in range(nproc):
        f = out / f"rank{r}.json"
        if f.is_file():
            results.append(json.loads(f.read_text()))
    tail = (out / "log.txt").read_text()[-6000:]
    if len(results) != nproc or not all(r["ok"] for r in results):
        errors = "\n".join(r.get("error", "") for r in results)
        pytest.fail(f"worker {name} failed (rc {proc.returncode}):\n{errors}\n--- log tail ---\n{tail}")
    if proc.returncode != 0:  # every check ran; the process died on the way out
        warnings.warn(f"worker {name}: all checks ran but torchrun exited with {proc.returncode}; see {out}/log.txt")
        results[0]["exit_code"] = proc.returncode
    return results


@pytest.fixture(scope="module", params=LAYOUTS, ids=[layout[0] for layout in LAYOUTS])
def layout(request, tmp_path_factory):
    name, nproc, args, extra_env = request.param
    reason = _skip_reason(nproc)
    if reason:
        pytest.skip(reason)
    base = Path(os.environ["SPMD_RL_GPU_LOG_DIR"]) if os.environ.get("SPMD_RL_GPU_LOG_DIR") else tmp_path_factory.mktemp("gpu")
    results = run_worker(name, nproc, args, extra_env, base)
    summary = base / "summary.jsonl"
    with open(summary, "a") as f:
        f.write(json.dumps({"layout": name, "rank0": results[0]}) + "\n")
    return name, results


def test_fsdp_actor_matches_from_pretrained(layout):
    """(a) spmd_rl.model.loading' FSDP2 actor computes what a plain from_pretrained model computes."""
    name, results = layout
    for r in results:
        a = r["actor_vs_hf"]
        assert a["mean_abs_dlogp"] <= 0.01 and a["max_abs_dlogp"] <= 0.1 and a["logits_rel_err"] <= 1e-2, (name, a)


def test_synced_engine_matches_engine_loaded_from_disk(layout):
    """(b) weights streamed from the FSDP shards into a load_format="dummy" engine give the prompt
    log-probs of an engine that read the checkpoint itself; later cycles follow the new weights."""
    name, results = layout
    for r in results:
        c0 = r["cycles"][0]
        assert c0["engine_vs_disk_max"] <= 1e-3, (name, c0)
        # the sync adds nothing to the kernel-level vLLM/transformers difference
        assert c0["actor_vs_engine_mean"] <= r["hf_vs_vllm_disk"]["mean_abs_dlogp"] + 2e-3, (name, c0, r["hf_vs_vllm_disk"])
        for c in r["cycles"]:
            assert c["actor_vs_engine_mean"] <= 0.15, (name, c)
        for c in r["cycles"][1:]:
            # the perturbed policy moved the engine far more than the engine/actor mismatch
            assert c["engine_change_vs_cycle0"] > max(0.1, 3 * c["actor_vs_engine_mean"]), (name, c)


def test_engine_inspects_the_model_in_process(layout):
    """vLLM's model inspection ran in the engine's own process (spmd_rl/rollout/vllm/model_inspection.py:
    not a new Python importing torch and vLLM, 20-27 s of a start) and still wrote vLLM's cache."""
    name, results = layout
    assert sum(r["inspections_in_process"] for r in results) >= 1, (name, [r["inspections_in_process"] for r in results])
    assert any(f.endswith("Qwen2ForCausalLM.json") for f in results[0]["modelinfos_written"]), (name, results[0]["modelinfos_written"])
    print(f"{name}: engine start {results[0]['t_engine_init']:.1f} s (reference engine from disk: "
          f"{results[0]['t_ref_init']:.1f} s, which inspected in a new Python)")


def test_generate_contract(layout):
    """Token ids in/out, n per prompt, finish reasons, stop tokens, seeded determinism, greedy,
    sampled-token log-probs under logits / temperature (flat lists = vLLM's dicts, only for the
    prompts that ask), replicas sampling differently."""
    name, results = layout
    for r in results:
        g = r["generate"]
        assert g["n_results"] == g["n_prompts"] and g["n_per_prompt"] == [2], (name, g)
        assert g["lengths_ok"] and g["finish_ok"] and g["deterministic"], (name, g)
        assert g["samples_differ_within_prompt"], (name, g)
        assert g["flat_logprobs_used"] and g["dicts_equal_flat"], (name, g)  # rollout/vllm/outputs.py on vLLM 0.26
        assert g["sample_logprob_vs_actor_T_mean"] <= 0.15, (name, g)
        assert g["sample_logprob_vs_actor_T_mean"] < 0.5 * g["sample_logprob_vs_actor_T1_mean"], (name, g)
        assert g["greedy_copies_equal"], (name, g)
        assert g["greedy_matches_disk"] >= 0.75 * g["greedy_total"], (name, g)
        assert g["stop_ok"] and g["n_stopped"] > 0, (name, g)
        assert g["empty_ok"], (name, g)
        if "replicas_differ" in g:
            assert g["replicas_differ"], (name, g)


def test_sleep_frees_memory_without_growth(layout):
    """(c) sleep hands vLLM's memory back; no growth over wake/sync/sleep cycles."""
    name, results = layout
    for r in results:
        cyc = r["cycles"]
        for c in cyc:
            taken = c["free_train"] - c["free_awake"]
            returned = c["free_asleep"] - c["free_awake"]
            assert taken > 1.0 and returned >= 0.9 * taken, (name, c)
        left_behind = r["free_before_engine"] - cyc[-1]["free_asleep"]
        assert left_behind <= 3.0, (name, left_behind, r["free_before_engine"], cyc[-1])
        asleep = [c["free_asleep"] for c in cyc]
        train = [c["free_train"] for c in cyc]
        # the first rollout loads kernels / workspaces once (~0.3 GiB measured); after it, no drift
        assert train[0] - train[1] <= 0.5, (name, train)
        assert max(asleep) - min(asleep) < 0.25 and max(train[1:]) - min(train[1:]) < 0.25, (name, asleep, train)
        # the second sleep read the device's free memory falling (another process, simulated):
        # vLLM's check failed there, and the cycle after it still took and gave back its memory
        assert cyc[1]["sleep_readings_under_other_process"] >= 2 and cyc[1]["sleeps_survived"] == 1, (name, cyc[1])
        assert len(cyc) >= 3, (name, len(cyc))


def test_trained_actor_greedy_equals_engine_greedy(layout):
    """Stage T (0.5B layouts; the 7B one skips it for memory): after training on a learnable task
    and a sync, vLLM's greedy answers are the trained actor's. The actor must have learnt the
    answer (else equal greedy outputs of two untrained copies would prove nothing about the sync),
    and the engine must agree on >= 7 of 8 prompts, >= 95% of tokens (bf16 argmax near-ties)."""
    name, results = layout
    if "trained" not in results[0]:
        pytest.skip(f"{name} runs without --train-steps")
    for r in results:
        t = r["trained"]
        assert t["loss_last"] < 0.1 * t["loss_first"], (name, t)
        assert t["actor_answers_target"] >= 0.75 * t["prompts"], (name, t)
        assert t["engine_equals_actor"] >= t["prompts"] - max(1, t["prompts"] // 8), (name, t)
        assert t["token_agreement"] >= 0.95, (name, t)

