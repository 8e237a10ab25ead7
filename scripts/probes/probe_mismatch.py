"""Where the rollout/actor log-prob mismatch of a random-weight shape comes from (0.052 mean at
the 7B shape with TP=2 against 0.008 at 0.5B; docs/performance.md, "Two and four GPUs", 2026-11-23).

    torchrun --standalone --nproc-per-node=2 scripts/probes/probe_mismatch.py --arch qwen2-7b --out OUT
    torchrun --standalone --nproc-per-node=1 scripts/probes/probe_mismatch.py --arch qwen2-0.5b --out OUT

One random-weight model of the shape, its files in bfloat16 (so every implementation below computes
with the very same weights), teacher-forced log-probs of the same random token sequences from:
  vllm-tp<K>  vLLM 0.26 loading the files, tensor parallel over the torchrun ranks (bf16);
  hf-bf16     transformers' model in bfloat16 (sdpa): the computation of the training actor, whose
              log-probs equal from_pretrained's exactly (tests/gpu/test_colocate.py);
  hf-fp32     the same weights in float32: the reference.
Rank 0 prints, for each pair, the mean, 99th percentile and max |d log p| over all tokens, plus the
mean log-prob and the logits' standard deviation. If vllm-tp<K> and hf-bf16 are each as far from
hf-fp32 as from one another, the mismatch is bfloat16 rounding of the shape, not the engine, the
tensor parallelism or the weight sync. Writes OUT/probe_mismatch_<arch>_tp<K>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from spmd_rl.model.loading import random_model_config  # noqa: E402
from spmd_rl.runtime.distributed import init_distributed  # noqa: E402


def build_model_dir(arch: str, path: str) -> None:
    """A random-weight model of the shape in bf16 files, initialised on the GPU (seconds, not minutes)."""
    from transformers import AutoModelForCausalLM

    if os.path.isfile(os.path.join(path, "config.json")):
        return
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(random_model_config(arch), dtype=torch.bfloat16)
    model.save_pretrained(path)
    del model
    torch.cuda.empty_cache()


@torch.no_grad()
def hf_logprobs(path: str, dtype: torch.dtype, seqs: torch.Tensor, chunk: int = 4) -> tuple[torch.Tensor, float]:
    """[n, L-1] log p(seq[t] | seq[:t]) from transformers' model in `dtype`; and the logits' std."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").cuda().eval()
    out, stds = [], []
    for i in range(0, len(seqs), chunk):
        ids = seqs[i:i + chunk].cuda()
        logits = model(input_ids=ids).logits.float()
        stds.append(float(logits.std()))
        out.append(torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0].cpu())
    del model
    torch.cuda.empty_cache()
    return torch.cat(out).double(), sum(stds) / len(stds)


def compare(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    d = (a - b).abs().flatten()
    return {"mean": float(d.mean()), "p99": float(d.quantile(0.99)), "max": float(d.max())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="qwen2-7b")
    ap.add_argument("--model-dir", default="", help="default: OUT/model_<arch> (built if missing)")
    ap.add_argument("--seqs", type=int, default=32)
    ap.add_argument("--length", type=int, default=384)
    ap.add_argument("--gpu-mem", type=float, default=0.35, help="vLLM's gpu_memory_utilization")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    env = init_distributed("cuda")
    path = args.model_dir or os.path.join(args.out, f"model_{args.arch}")
    if env.rank == 0:
        os.makedirs(args.out, exist_ok=True)
        build_model_dir(args.arch, path)
    dist.barrier()
    vocab = random_model_config(args.arch).vocab_size
    g = torch.Generator().manual_seed(1)
    seqs = torch.randint(100, vocab - 100, (args.seqs, args.length), generator=g)

    from vllm import LLM

    from spmd_rl.rollout.vllm.engine import prompt_logprobs

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    llm = LLM(model=path, tensor_parallel_size=env.world_size, distributed_executor_backend="external_launcher",
              dtype="bfloat16", seed=0, skip_tokenizer_init=True, enforce_eager=True,
              gpu_memory_utilization=args.gpu_mem, max_model_len=args.length + 8,
              kv_cache_memory_bytes=2 << 30)  # no memory profiling: safe beside other processes on the GPU
    got = {f"vllm-tp{env.world_size}": torch.tensor(prompt_logprobs(llm, seqs.tolist()), dtype=torch.float64)}
    if env.rank == 0:
        got["hf-bf16"], std_bf16 = hf_logprobs(path, torch.bfloat16, seqs)
        got["hf-fp32"], std_fp32 = hf_logprobs(path, torch.float32, seqs)
        names = list(got)
        rows = {f"{a} vs {b}": compare(got[a], got[b]) for i, a in enumerate(names) for b in names[i + 1:]}
        res = {"arch": args.arch, "tp": env.world_size, "seqs": args.seqs, "length": args.length,
               "mean_logprob_fp32": float(got["hf-fp32"].mean()), "logits_std_fp32": std_fp32,
               "logits_std_bf16": std_bf16, "abs_diff": rows}
        print("RESULT " + json.dumps(res), flush=True)
        for k, v in rows.items():
            print(f"{args.arch} tp{env.world_size} {k:28s} mean {v['mean']:.4f}  p99 {v['p99']:.4f}  max {v['max']:.4f}")
        with open(os.path.join(args.out, f"probe_mismatch_{args.arch}_tp{env.world_size}.json"), "w") as f:
            json.dump(res, f, indent=1)
    dist.barrier()
    from spmd_rl.rollout.vllm.engine import shutdown_llm

    shutdown_llm(llm)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
