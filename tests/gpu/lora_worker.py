"""torchrun worker behind tests/gpu/test_lora_gpu.py: a LoRA actor's adapter into our vLLM engine, both
ways (model.lora_sync), on one GPU; results as JSON for the pytest side to judge.

    torchrun --nproc-per-node=1 tests/gpu/lora_worker.py --model DIR --out FILE [--weights-stay]

The actor is built as the trainer builds it (FSDP2, the base frozen in bf16, the adapter fp32, rank
32 on every linear layer), its adapter's B drawn non-zero so that the adapter moves the policy. One
engine, built for the adapter sync (vLLM's LoRA layers, sleep level 1), measures, as mean |Δ log p|
over fixed sequences' teacher-forced log-probs:
  adapter     the base once + the adapter, against the actor (the adapter applied by vLLM);
  effect      the actor against the actor with its adapter disabled (what a lost adapter would show);
  no_adapter  the engine with the adapter's B zeroed, against the actor with its adapter disabled;
  after_sleep a sleep and a wake-up, a new adapter (B drawn again) and no base sent: against the actor;
  merged      the merged weights (W + s B A in bf16) with a zero adapter: against the actor.
Then the trap: 5 AdamW steps at lr 1e-5 (each adapter entry moves ~5e-5: W + s B A rounds such a
change away in bf16), and `miss_adapter` / `miss_merged` = |engine's move - actor's move| / |actor's
move| of the log-probs, the engine re-synced each way (0: it follows the actor; 1: it kept the old
policy). Seconds of each sync are recorded too, and `held_asleep`: the bytes of vLLM's sleep pool
mapped after the first sleep, by tag (with --weights-stay, rollout.weights_stay_on_gpu: the weights).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from spmd_rl.config.run_config import Config  # noqa: E402
from spmd_rl.model.loading import build_sharded, load_causal_lm  # noqa: E402
from spmd_rl.model.lora import LoraSettings, adapter_disabled  # noqa: E402
from spmd_rl.rollout.weight_sync import gather_adapter, iter_base_weights, iter_weights  # noqa: E402
from spmd_rl.runtime.distributed import fsdp_mesh, init_distributed  # noqa: E402

RANK, ALPHA = 32, 32.0


def sequences(n: int = 16, length: int = 48, vocab: int = 60) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(n)]


def actor_logprobs(actor, seqs) -> torch.Tensor:
    ids = torch.tensor(seqs, device="cuda")
    targets = torch.roll(ids, -1, 1)
    with torch.no_grad():
        lp = actor(input_ids=ids, logprob_targets=targets, temperature=1.0)[0]
    return lp[:, :-1].double().cpu()  # position t: log p(seq[t+1] | seq[:t+1])


def engine_logprobs(engine, seqs) -> torch.Tensor:
    return torch.tensor(engine.prompt_logprobs(seqs), dtype=torch.float64)


def mean_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().mean().item()


def draw_b(actor, seed: int, std: float = 0.02) -> None:
    g = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        for name, p in actor.named_parameters():
            if ".lora_B." in name:
                local = p.to_local() if hasattr(p, "to_local") else p
                local.copy_(torch.randn(local.shape, generator=g, device="cuda") * std)


def zero_adapter(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) if ".lora_B." in k else v for k, v in tensors.items()}


def timed(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def adapter_sync(engine, actor, base: bool, tensors=None) -> float:
    """The adapter sync: weights awake, the base (when `base`) and the adapter (`tensors`, else the
    actor's) sent, the KV cache awake; the seconds of the sends."""
    engine.wake_up(["weights"])
    t = 0.0
    if base:
        t += timed(lambda: engine.load_weights(iter_base_weights(actor, torch.bfloat16, 512)))[1]
    t += timed(lambda: engine.load_adapter(gather_adapter(actor) if tensors is None else tensors))[1]
    engine.wake_up(["kv_cache"])
    return t


def merged_sync(engine, actor) -> float:
    """The merged sync: W + s B A sent for every weight, the engine's LoRA layers given a zero adapter;
    the seconds of the weights' send."""
    engine.wake_up(["weights"])
    _, t = timed(lambda: engine.load_weights(iter_weights(actor, torch.bfloat16, 512)))
    engine.load_adapter(zero_adapter(gather_adapter(actor)))
    engine.wake_up(["kv_cache"])
    return t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--weights-stay", action="store_true", help="rollout.weights_stay_on_gpu = true")
    args = ap.parse_args()
    init_distributed("cuda")  # the process group the engine joins
    from spmd_rl.rollout.vllm.engine import VLLMEngine

    cfg = Config()
    cfg.model.lora_rank, cfg.model.lora_alpha = RANK, ALPHA
    cfg.rollout.engine, cfg.rollout.gpu_memory_utilization, cfg.rollout.enforce_eager = "vllm", 0.3, True
    cfg.data.max_prompt_length, cfg.data.max_response_length = 64, 64
    cfg.rollout.weights_stay_on_gpu = args.weights_stay
    settings = LoraSettings(RANK, ALPHA, (), torch.float32)
    actor = build_sharded(functools.partial(load_causal_lm, args.model, torch.bfloat16, lora=settings),
                          fsdp_mesh("cuda", 1), torch.bfloat16, False)
    draw_b(actor, 0)
    seqs = sequences()
    r: dict = {}
    engine = VLLMEngine(cfg, args.model, 0, 1, 0, 1)
    r["sleep_level"] = engine.sleep_level

    sync = functools.partial(adapter_sync, engine, actor)
    r["sync_base_and_adapter_s"] = sync(base=True)
    act = actor_logprobs(actor, seqs)
    with adapter_disabled(actor):
        base_act = actor_logprobs(actor, seqs)
    r["adapter"] = mean_abs(engine_logprobs(engine, seqs), act)
    r["effect"] = mean_abs(act, base_act)
    engine.sleep()
    from spmd_rl.rollout.vllm.sleep import held_while_asleep

    r["held_asleep"] = held_while_asleep()
    r["engine_weight_bytes"] = engine.engine_parameter_bytes()
    sync(base=False, tensors=zero_adapter(gather_adapter(actor)))
    r["no_adapter"] = mean_abs(engine_logprobs(engine, seqs), base_act)
    engine.sleep()
    draw_b(actor, 1)
    r["sync_adapter_s"] = sync(base=False)
    r["after_sleep"] = mean_abs(engine_logprobs(engine, seqs), actor_logprobs(actor, seqs))
    engine.sleep()

    r["sync_merged_s"] = merged_sync(engine, actor)
    r["merged"] = mean_abs(engine_logprobs(engine, seqs), actor_logprobs(actor, seqs))
    engine.sleep()

    # the trap: small updates, the engine re-synced each way
    def engine_now(merged: bool) -> torch.Tensor:
        if merged:
            merged_sync(engine, actor)
        else:
            sync(base=True)  # the base as it is (frozen: the same), the adapter as it is
        out = engine_logprobs(engine, seqs)
        engine.sleep()
        return out

    before = {m: engine_now(m) for m in (False, True)}
    a0 = actor_logprobs(actor, seqs)
    opt = torch.optim.AdamW([p for p in actor.parameters() if p.requires_grad], lr=1e-5, weight_decay=0.0)
    ids = torch.tensor(seqs, device="cuda")
    for _ in range(5):
        lp = actor(input_ids=ids, logprob_targets=torch.roll(ids, -1, 1), temperature=1.0)[0]
        (-lp.float().mean()).backward()
        opt.step()
        opt.zero_grad()
    moved = actor_logprobs(actor, seqs) - a0
    r["actor_move"] = moved.abs().mean().item()
    for m, key in ((False, "miss_adapter"), (True, "miss_merged")):
        r[key] = ((engine_now(m) - before[m] - moved).norm() / moved.norm()).item()
    engine.close()
    with open(args.out, "w") as f:
        json.dump(r, f, indent=1)
    print("LORA_RESULT", json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
