"""torchrun worker behind tests/gpu/test_moe_gpu.py::test_glm_latent_attention_lora_reaches_vllm_as_preflight_says:
LoRA on GLM-4.7-Flash's latent attention into our vLLM engine, on one GPU; results as JSON for the pytest side.

    torchrun --nproc-per-node=1 tests/gpu/mla_lora_worker.py --model DIR --out FILE

The actor as the trainer builds it (FSDP2, the base bf16, the adapter fp32, rank 16 on the attention's five
projections) and one engine built for the adapter sync with LoRA layers on the same five. An adapter is
drawn on some projections (B non-zero there, zero elsewhere); each figure is a mean |Δ log p| against the
actor, over fixed sequences' teacher-forced log-probs (`_prompt`) and over the engine's own sampled tokens
(`_decode`, what a training run's mismatch reads):
  others_*   B on q_a_proj, q_b_proj, kv_a_proj_with_mqa and o_proj, the adapter sync (preflight lets it through);
  kv_b_*     B on kv_b_proj only, the adapter sync (preflight refuses it: vLLM's latent attention folds
             kv_b_proj into matrices its LoRA layers do not adapt);
  merged_*   the same kv_b_proj adapter, merged (W + s B A, the folded matrices computed again after the load);
  effect_*   the actor with each adapter against the actor with it disabled (what a lost adapter shows).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from lora_worker import actor_logprobs, adapter_sync, engine_logprobs, mean_abs, merged_sync, sequences  # noqa: E402

from spmd_rl.config.run_config import Config  # noqa: E402
from spmd_rl.model.loading import build_sharded, load_causal_lm  # noqa: E402
from spmd_rl.model.lora import LoraSettings, adapter_disabled  # noqa: E402
from spmd_rl.rollout.base import SamplingParams  # noqa: E402
from spmd_rl.runtime.distributed import fsdp_mesh, init_distributed  # noqa: E402

RANK, ALPHA = 16, 32.0
OTHERS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj")
FOLDED = ("kv_b_proj",)


def draw_b(actor, modules: tuple[str, ...], seed: int, std: float = 0.2) -> None:
    """B of the adapters on `modules` drawn, every other B zero."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        for name, p in actor.named_parameters():
            if ".lora_B." in name:
                local = p.to_local() if hasattr(p, "to_local") else p
                drawn = any(f".{m}.lora_B." in name for m in modules)
                local.copy_(torch.randn(local.shape, generator=g, device="cuda") * std if drawn else 0.0)


def decode_logprobs(engine, actor, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's log-probs of its own sampled tokens, and the actor's of the same tokens."""
    sampling = SamplingParams(n=1, temperature=1.0, max_new_tokens=24, ignore_eos=True, seed=3)
    done = [c[0] for c in engine.generate(prompts, sampling)]
    act = actor_logprobs(actor, [p + c.token_ids for p, c in zip(prompts, done)])
    return torch.tensor([c.logprobs for c in done], dtype=torch.float64), act[:, len(prompts[0]) - 1:]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    init_distributed("cuda")
    from spmd_rl.rollout.vllm.engine import VLLMEngine

    cfg = Config()
    cfg.model.lora_rank, cfg.model.lora_alpha = RANK, ALPHA
    cfg.model.lora_target_modules = [*OTHERS, *FOLDED]
    cfg.rollout.engine, cfg.rollout.gpu_memory_utilization, cfg.rollout.enforce_eager = "vllm", 0.3, True
    cfg.data.max_prompt_length, cfg.data.max_response_length = 64, 64
    settings = LoraSettings(RANK, ALPHA, (*OTHERS, *FOLDED), torch.float32)
    actor = build_sharded(functools.partial(load_causal_lm, args.model, torch.bfloat16, lora=settings),
                          fsdp_mesh("cuda", 1), torch.bfloat16, False)
    engine = VLLMEngine(cfg, args.model, 0, 1, 0, 1)
    seqs, prompts = sequences(), [s[:16] for s in sequences(8)]
    r: dict[str, float] = {}

    def measure(tag: str) -> None:
        r[f"{tag}_prompt"] = mean_abs(engine_logprobs(engine, seqs), actor_logprobs(actor, seqs))
        r[f"{tag}_decode"] = mean_abs(*decode_logprobs(engine, actor, prompts))
        engine.sleep()

    def effect(tag: str) -> None:
        with_adapter = actor_logprobs(actor, seqs)
        with adapter_disabled(actor):
            r[f"effect_{tag}"] = mean_abs(with_adapter, actor_logprobs(actor, seqs))

    for seed, (tag, modules) in enumerate((("others", OTHERS), ("kv_b", FOLDED))):
        draw_b(actor, modules, seed)
        effect(tag)
        adapter_sync(engine, actor, base=tag == "others")  # the base once, then the adapter alone
        measure(tag)
    merged_sync(engine, actor)  # the kv_b_proj adapter merged
    measure("merged")
    engine.close()
    with open(args.out, "w") as f:
        json.dump(r, f, indent=1)
    print("MLA_LORA_RESULT", json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
