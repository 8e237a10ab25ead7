"""One rank of tests/gpu/test_ulysses_gpu.py (torchrun --nproc_per_node=2): sequence parallelism
on the real path (PyTorch's varlen FlashAttention kernel, NCCL all-to-alls, bf16 compute, FSDP2 over
both GPUs, gradient checkpointing) against the same update without it, both against a float32
reference (all three with gradient checkpointing).

Three runs of the same weights (a random model of `--arch`'s shape, fp32 masters) on the same rows
(each rank draws its own ragged rows of odd lengths, 0.5-4k tokens):
  fp32     padded rows, sdpa, float32 compute, no sequence parallelism: the precision reference;
  ulysses1 packed rows, bf16, the trainer's data parallelism over both GPUs (ulysses_size = 1);
  ulysses2 packed rows, bf16, both GPUs one SP group sharing all rows (ulysses_size = 2).
Compared with the fp32 run: the old log-probs (no-grad pass) on response tokens, and the gradient of
one PPO update of all rows (the trainer's ppo_update; old log-probs = the fp32 run's, so the ratio
is about 1 and every token carries gradient), read from each rank's FSDP shard before the optimizer
step. bf16 cannot be compared bit for bit; the SP run must be as close to fp32 as the ulysses1 run:
mean |logp error| < 1.5x its + 1e-3, max < 2x + 0.05, gradient relative error < 1.5x + 1e-3; and
the two bf16 gradients' cosine > 0.99. Writes the numbers as JSON to --out (rank 0) and exits
non-zero when a bound fails.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from transformers import AutoModelForCausalLM  # noqa: E402

from spmd_rl.batching import sequence_parallel  # noqa: E402
from spmd_rl.batching.batch import Batch  # noqa: E402
from spmd_rl.config.actor import ActorConfig  # noqa: E402
from spmd_rl.model.loading import apply_fsdp, prepare_policy, random_model_config  # noqa: E402
from spmd_rl.runtime import sp_groups
from spmd_rl.runtime.distributed import all_reduce_sum, init_distributed  # noqa: E402
from spmd_rl.train.actor import actor_loss_fn, compute_logprobs  # noqa: E402
from spmd_rl.train.update import ppo_update  # noqa: E402

ROWS = 4


class CaptureGrads(torch.optim.Optimizer):
    """An optimizer whose step keeps this rank's shard of every gradient (float32) and moves nothing."""

    def __init__(self, params):
        super().__init__(params, {"lr": 0.0})
        self.grads: list[torch.Tensor] = []

    @torch.no_grad()
    def step(self, closure=None):
        self.grads = [p.grad.to_local().float().clone() for g in self.param_groups for p in g["params"]]


def odd_rows(vocab: int, seed: int, device) -> Batch:
    g = torch.Generator().manual_seed(seed)
    lens = [2 * int(torch.randint(256, 2049, (1,), generator=g)) + 1 for _ in range(ROWS)]  # 513..4097, odd
    width = max(lens)
    ids = torch.randint(0, vocab, (ROWS, width), generator=g)
    attn = torch.zeros(ROWS, width, dtype=torch.long)
    resp = torch.zeros(ROWS, width)
    for i, n in enumerate(lens):
        attn[i, :n] = 1
        resp[i, 100:n] = 1
    return Batch({"input_ids": ids * attn, "attention_mask": attn, "response_mask": resp,
                  "advantages": torch.randn(ROWS, width, generator=g) * resp,
                  "row_id": torch.arange(ROWS) + seed * ROWS})


def build(config, state, packed: bool, compute, sp, mesh, device):
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    model.load_state_dict(state)
    prepare_policy(model, remove_padding=packed, chunked_logprobs=True)
    apply_fsdp(model, mesh, compute, gradient_checkpointing=True)
    return sequence_parallel.apply(model, sp)


def run(config, state, batch, packed, compute, sp, mesh, budget, device):
    """(old log-probs of `batch` [rows, L] on CPU, gradient shards of one update of `batch`)."""
    model = build(config, state, packed, compute, sp, mesh, device)
    tokens = budget * sp.size if packed else 0
    logp = compute_logprobs(model, batch, 1.0, 1, device, max_tokens=2 * tokens)
    if "old_logprobs" not in batch:  # the fp32 run: its own; the others get the fp32 run's
        batch["old_logprobs"] = logp
    opt = CaptureGrads(model.parameters())
    cfg = ActorConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, loss_agg_mode="token-mean")
    ppo_update(model, opt, batch, actor_loss_fn(model, cfg, 1.0), mini_batch_size=len(batch), micro_batch_size=1,
               epochs=1, grad_clip=0.0, loss_agg_mode="token-mean", device=device, max_tokens=tokens)
    grads = opt.grads
    del model, opt
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return logp, grads


def global_sum(values: list[float], device) -> list[float]:
    return all_reduce_sum(torch.tensor(values, dtype=torch.float64, device=device)).tolist()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="qwen2-1.5b")
    ap.add_argument("--budget", type=int, default=8448, help="tokens per GPU of an update micro-batch")
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of this script (gloo, the exact CPU attention)")
    args = ap.parse_args()
    env = init_distributed(args.device)
    device, world = env.device, env.world_size
    config = random_model_config(args.arch)
    torch.manual_seed(0)
    with device:
        init = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = {}
    for k, v in init.state_dict().items():
        v = v.contiguous()
        dist.broadcast(v, 0)  # the same weights on every rank
        state[k] = v.cpu()
    del init

    mine = odd_rows(config.vocab_size, env.rank, device)
    single = sp_groups.make_groups(1)
    pair = sp_groups.make_groups(world)
    ref_logp, ref_grads = run(config, state, mine, False, torch.float32, single, env.mesh, args.budget, device)
    assert torch.equal(mine["old_logprobs"], ref_logp)  # ratio ~ 1: every response token carries gradient
    results = {}
    for name, sp in (("ulysses1", single), ("ulysses2", pair)):
        batch = sequence_parallel.share_rows(mine, len(mine), 0, sp)
        logp, grads = run(config, state, batch, True, torch.bfloat16, sp, env.mesh, args.budget, device)
        own = [i for i, r in enumerate(batch["row_id"].tolist()) if r // ROWS == env.rank]  # this rank's rows
        width = ref_logp.shape[1]  # the shared rows may be wider (the other rank's longest row)
        err = (logp[own][:, :width] - ref_logp).abs()[mine["response_mask"] > 0]
        diff = sum(float((g - r).double().square().sum()) for g, r in zip(grads, ref_grads))
        ref2 = sum(float(r.double().square().sum()) for r in ref_grads)
        s = global_sum([float(err.sum()), err.numel(), diff, ref2], device)
        peak = all_reduce_sum(torch.tensor([float(err.max())], device=device), op=dist.ReduceOp.MAX).item()
        results[name] = {"logp_err_mean": s[0] / s[1], "logp_err_max": peak, "grad_rel_err": (s[2] / s[3]) ** 0.5,
                         "grads": grads}
    g1, g2 = results["ulysses1"].pop("grads"), results["ulysses2"].pop("grads")
    dot, n1, n2 = global_sum([sum(float((a.double() * b.double()).sum()) for a, b in zip(g1, g2)),
                              sum(float(a.double().square().sum()) for a in g1),
                              sum(float(b.double().square().sum()) for b in g2)], device)
    results["cosine_ulysses2_ulysses1"] = dot / (n1 * n2) ** 0.5
    u1, u2 = results["ulysses1"], results["ulysses2"]
    checks = {
        "logp mean": u2["logp_err_mean"] < 1.5 * u1["logp_err_mean"] + 1e-3,
        "logp max": u2["logp_err_max"] < 2 * u1["logp_err_max"] + 0.05,
        "gradient": u2["grad_rel_err"] < 1.5 * u1["grad_rel_err"] + 1e-3,
        "cosine": results["cosine_ulysses2_ulysses1"] > 0.99,
    }
    results.update(arch=args.arch, checks=checks, torch=torch.__version__,
                   device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu")
    if env.is_main:
        print(json.dumps(results, indent=1), flush=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
