"""torchrun worker behind tests/gpu/test_colocate.py: every colocation check of one (arch, tp)
layout in one process, results as JSON (one file per rank) for the pytest side to judge.

    torchrun --nproc-per-node=N tests/gpu/colocate_worker.py --arch qwen2-0.5b --tp 1 --out DIR

Steps (random-weight model written once to --model-root, no hub):
  R. a plain vLLM engine loads the checkpoint from disk: prompt log-probs of fixed sequences and
     greedy continuations (the reference), then it is shut down in-process;
  A. the FSDP2 actor built as the trainer builds it (spmd_rl.model.loading.build_sharded: with several
     ranks, rank 0's weights broadcast into shards built on the meta device; fp32 masters, bf16
     compute) against a plain `from_pretrained` bf16 model on the same sequences;
  E. our VLLMEngine (load_format="dummy", sleep mode): `--cycles` rounds of
     wake(weights) -> load_weights(iter_weights(actor)) -> wake(kv) -> checks -> sleep, with the
     actor's weights perturbed between rounds; free device memory recorded at every stage. The
     second round's sleep sees the device's free memory drop as if another process allocated
     during it (vLLM 0.26's freed-memory assertion fires: spmd_rl/rollout/vllm/sleep.py); the
     rounds after it must wake, sync and free as before.
  T. (--train-steps > 0) the actor is trained (AdamW, cross-entropy) to answer every prompt with
     one fixed 16-token continuation, synced into the engine, and the engine's greedy answers are
     compared with the trained actor's own greedy decoding (no KV cache, fixed step count).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import json
import os
import shutil
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from spmd_rl.config.run_config import Config  # noqa: E402
from spmd_rl.model.loading import (  # noqa: E402
    build_sharded,
    load_causal_lm,
    materialize_random_model,
    random_model_config,
    reshard,  # noqa: E402  (the trainer's own: checked by root_sharded below)
)
from spmd_rl.rollout.base import SamplingParams  # noqa: E402
from spmd_rl.rollout.vllm import sleep as vllm_sleep  # noqa: E402
from spmd_rl.rollout.weight_sync import iter_weights  # noqa: E402
from spmd_rl.runtime.distributed import init_distributed  # noqa: E402
from spmd_rl.runtime.gpu_memory import GiB  # noqa: E402

QWEN_EOS = 151643  # <|endoftext|> of the Qwen2 tokenizer


@contextlib.contextmanager
def other_process_allocates_during():
    """vLLM's reading of the device's free memory (`torch.accelerator.get_memory_info`) drops by
    the device's total after its first call in the block, as when another process allocates
    meanwhile: vLLM's freed-memory check must fail whatever the engine frees."""
    real = torch.accelerator.get_memory_info
    seen = {"readings": 0}

    def reading(*a, **k):
        free, total = real(*a, **k)
        seen["readings"] += 1
        return (free - total if seen["readings"] > 1 else free), total

    torch.accelerator.get_memory_info = reading
    try:
        yield seen
    finally:
        torch.accelerator.get_memory_info = real


def free_gib() -> float:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0] / GiB


def build_model_dir(root: str, arch: str, tie: int) -> str:
    config = random_model_config(arch)
    if tie >= 0:
        config.tie_word_embeddings = bool(tie)
    config.eos_token_id = QWEN_EOS
    path = os.path.join(root, f"{arch}-tie{int(config.tie_word_embeddings)}")
    with torch.device("cuda"):  # random init on the GPU: minutes faster than on the CPU for 7B
        return materialize_random_model(path, config, seed=0, dtype=torch.bfloat16)


@torch.no_grad()
def teacher_forced(model, seqs: list[list[int]], device, temperature: float = 1.0):
    """Per sequence: logits (float32, positions 0..L-2) and log p(seq[t] | seq[:t]) for t >= 1,
    under logits / temperature. One right-padded forward (same count on every rank: FSDP)."""
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits.float()
    out_logits, out_lp = [], []
    for i, s in enumerate(seqs):
        lg = logits[i, : len(s) - 1]
        lp = F.log_softmax(lg / temperature, -1).gather(-1, torch.tensor(s[1:], device=device)[:, None])[:, 0]
        out_logits.append(lg)
        out_lp.append(lp)
    return out_logits, out_lp


def root_sharded(model) -> bool:
    from torch.distributed.tensor import DTensor

    return all(isinstance(p, DTensor) for p in model.parameters())


def same_count(seqs: list[list[int]]) -> list[list[int]]:
    """Pad the list with copies of a dummy sequence so every rank does one forward of equal batch."""
    n = torch.tensor([len(seqs)], device="cuda")
    dist.all_reduce(n, op=dist.ReduceOp.MAX)
    return seqs + [[0, 1]] * (int(n.item()) - len(seqs))


def absdiff(a: list[list[float]] | list[torch.Tensor], b) -> torch.Tensor:
    return torch.cat([(torch.as_tensor(x, dtype=torch.float64).cpu() - torch.as_tensor(y, dtype=torch.float64).cpu()).abs()
                      for x, y in zip(a, b)])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="qwen2-0.5b")
    ap.add_argument("--tie", type=int, default=-1, help="-1: the preset's choice; 0/1 force untied/tied")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--cycles", type=int, default=3)
    ap.add_argument("--gpu-mem", type=float, default=0.3)
    ap.add_argument("--bucket-mb", type=int, default=512)
    ap.add_argument("--train-steps", type=int, default=0, help="stage T: optimizer steps on the fixed-answer task")
    ap.add_argument("--model-root", default="/tmp/spmd_rl_models")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    env = init_distributed("cuda")
    rank, world = env.rank, env.world_size
    res: dict = {"rank": rank, "world": world, "arch": args.arch, "tp": args.tp,
                 "expandable_segments": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""), "ok": False}
    os.makedirs(args.out, exist_ok=True)
    try:
        run(args, env, res)
        res["ok"] = True
    except BaseException:
        res["error"] = traceback.format_exc()
        print(f"[r{rank}] FAILED\n{res['error']}", flush=True)
        raise
    finally:
        with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
            json.dump(res, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def run(args, env, res: dict) -> None:
    from vllm import LLM

    from spmd_rl.rollout.vllm.engine import VLLMEngine, engine_kwargs, prompt_logprobs, shutdown_llm, to_vllm_sampling

    rank, world, dev = env.rank, env.world_size, env.device
    tp = args.tp
    tp_rank, replica = rank % tp, rank // tp
    log = (lambda *a: print(f"[r{rank}]", *a, flush=True))
    t_start = time.perf_counter()
    mdir = build_model_dir(args.model_root, args.arch, args.tie)
    gc.collect()
    torch.cuda.empty_cache()
    with open(os.path.join(mdir, "config.json")) as f:
        hf_cfg = json.load(f)
    V = hf_cfg["vocab_size"]
    res["tied"] = hf_cfg.get("tie_word_embeddings")
    res["t_model_dir"] = time.perf_counter() - t_start

    cfg = Config()
    cfg.rollout.engine = "vllm"
    cfg.rollout.tensor_parallel_size = tp
    cfg.rollout.gpu_memory_utilization = args.gpu_mem
    cfg.rollout.enforce_eager = True
    cfg.rollout.max_num_seqs = 64
    cfg.data.max_prompt_length, cfg.data.max_response_length = 256, 256

    g = torch.Generator().manual_seed(1234)
    seqs = [torch.randint(0, V, (n,), generator=g).tolist() for n in (48, 64, 96, 128)]
    prompts = [torch.randint(0, V, (int(n),), generator=g).tolist() for n in torch.randint(8, 40, (8,), generator=g)]
    my_prompts = prompts[tp_rank::tp]  # each rank of a TP group passes its own share

    # ---------------------------------------------------------------- R: reference engine from disk
    res["free_start"] = free_gib()
    t0 = time.perf_counter()
    ref = LLM(**engine_kwargs(cfg, mdir, cfg.rollout.seed + replica, dummy=False, sleep_mode=False))
    res["t_ref_init"] = time.perf_counter() - t0
    ref_lp = prompt_logprobs(ref, seqs)
    greedy = SamplingParams(n=2, temperature=0.0, max_new_tokens=16)
    ref_greedy = [list(o.outputs[0].token_ids) for o in ref.generate(
        [{"prompt_token_ids": p} for p in prompts], to_vllm_sampling(greedy, [QWEN_EOS]), use_tqdm=False)]
    shutdown_llm(ref)
    del ref
    gc.collect()
    torch.cuda.empty_cache()
    res["free_after_ref_shutdown"] = free_gib()
    log(f"reference engine done in {time.perf_counter() - t0:.1f}s")

    # ---------------------------------------------------------------- A: FSDP2 actor vs from_pretrained
    t0 = time.perf_counter()
    actor = build_sharded(functools.partial(load_causal_lm, mdir, torch.float32), env.mesh, torch.bfloat16,
                          from_checkpoint=False)
    actor.eval()
    hf = load_causal_lm(mdir, torch.bfloat16).to(dev).eval()
    la, lpa = teacher_forced(actor, seqs, dev)
    res["all_params_dtensor_after_forward"] = root_sharded(actor)
    reshard(actor)
    res["all_params_dtensor_after_reshard"] = root_sharded(actor)
    lh, lph = teacher_forced(hf, seqs, dev)
    d = absdiff(lpa, lph)
    num = sum(((x - y) ** 2).sum() for x, y in zip(la, lh)).sqrt()
    den = sum((y ** 2).sum() for y in lh).sqrt()
    res["actor_vs_hf"] = {"mean_abs_dlogp": d.mean().item(), "max_abs_dlogp": d.max().item(),
                          "logits_rel_err": (num / den).item(), "tokens": d.numel()}
    res["hf_vs_vllm_disk"] = {"mean_abs_dlogp": absdiff(lph, ref_lp).mean().item()}
    del hf, la, lh
    gc.collect()
    torch.cuda.empty_cache()
    res["t_actor"] = time.perf_counter() - t0
    log("actor vs hf", res["actor_vs_hf"])

    # ---------------------------------------------------------------- E: our engine
    torch.cuda.synchronize()
    dist.barrier()
    res["free_before_engine"] = free_gib()
    res_torch_before = (torch.cuda.memory_allocated() / GiB, torch.cuda.memory_reserved() / GiB)
    # The model class must be inspected again, and in this process (rollout/vllm/model_inspection.py): the
    # reference engine above inspected it already (vLLM's in-memory and on-disk caches are cleared).
    from vllm import envs as vllm_envs
    from vllm.model_executor.models import registry as vllm_registry

    from spmd_rl.rollout.vllm.model_inspection import InspectionCount

    modelinfos = os.path.join(vllm_envs.VLLM_CACHE_ROOT, "modelinfos")
    dist.barrier()
    if rank == 0:
        shutil.rmtree(modelinfos, ignore_errors=True)
    vllm_registry._try_inspect_model_cls.cache_clear()
    dist.barrier()
    inspections = InspectionCount.in_process
    t0 = time.perf_counter()
    eng = VLLMEngine(cfg, mdir, rank, world, env.local_rank, env.local_world_size)
    res["t_engine_init"] = time.perf_counter() - t0
    res["inspections_in_process"] = InspectionCount.in_process - inspections
    res["modelinfos_written"] = sorted(os.listdir(modelinfos)) if os.path.isdir(modelinfos) else []
    res["free_after_engine_init_asleep"] = free_gib()
    res["torch_alloc_reserved_before_engine"] = res_torch_before
    res["torch_alloc_reserved_engine_asleep"] = (torch.cuda.memory_allocated() / GiB, torch.cuda.memory_reserved() / GiB)
    res["cycles"] = []
    base_lp = None
    for c in range(args.cycles):
        row: dict = {"cycle": c}
        if c > 0:  # a new policy: the engine must follow it
            torch.manual_seed(100 + c)
            with torch.no_grad():
                for p in actor.parameters():
                    loc = p.to_local() if hasattr(p, "to_local") else p
                    loc.add_(torch.randn_like(loc) * 0.01)
        torch.cuda.synchronize()
        dist.barrier()
        torch.cuda.empty_cache()
        row["free_train"] = free_gib()
        t = time.perf_counter(); eng.wake_up(["weights"]); torch.cuda.synchronize(); row["t_wake_weights"] = time.perf_counter() - t
        row["free_weights_awake"] = free_gib()
        t = time.perf_counter(); eng.load_weights(iter_weights(actor, torch.bfloat16, args.bucket_mb)); torch.cuda.synchronize()
        row["t_sync"] = time.perf_counter() - t
        t = time.perf_counter(); eng.wake_up(["kv_cache"]); torch.cuda.synchronize(); row["t_wake_kv"] = time.perf_counter() - t
        row["free_awake"] = free_gib()

        vlp = eng.prompt_logprobs(seqs)
        _, alp = teacher_forced(actor, seqs, dev)
        reshard(actor)
        dm = absdiff(alp, vlp)
        row["actor_vs_engine_mean"], row["actor_vs_engine_max"] = dm.mean().item(), dm.max().item()
        dr = absdiff(vlp, ref_lp)
        row["engine_vs_disk_mean"], row["engine_vs_disk_max"] = dr.mean().item(), dr.max().item()
        if c == 0:
            base_lp = vlp
            res["generate"] = check_generate(eng, actor, my_prompts, prompts, ref_greedy, tp, tp_rank, V, dev)
        else:
            row["engine_change_vs_cycle0"] = absdiff(vlp, base_lp).mean().item()
        torch.cuda.synchronize()
        dist.barrier()
        with (other_process_allocates_during() if c == 1 else contextlib.nullcontext()) as seen:
            t = time.perf_counter(); eng.sleep(); torch.cuda.synchronize(); row["t_sleep"] = time.perf_counter() - t
        if c == 1:
            row["sleep_readings_under_other_process"] = seen["readings"]
            row["sleeps_survived"] = vllm_sleep.survived
        row["free_asleep"] = free_gib()
        res["cycles"].append(row)
        log(json.dumps(row))
    if args.train_steps > 0:
        res["trained"] = check_trained_greedy(eng, actor, prompts, my_prompts, args, dev, V)
        log("trained", json.dumps(res["trained"]))
    t = time.perf_counter()
    eng.close()
    res["t_close"] = time.perf_counter() - t
    res["free_after_close"] = free_gib()
    res["t_total"] = time.perf_counter() - t_start


TARGET_LEN = 16


def fixed_answer(V: int) -> list[int]:
    """The learnable task of stage T: every prompt is answered with these tokens (not EOS)."""
    return [(1000 + 7919 * i) % V for i in range(TARGET_LEN)]


def train_fixed_answer(actor, prompts: list[list[int]], target: list[int], steps: int, dev) -> list[float]:
    """Cross-entropy on the answer tokens only; every rank trains on all prompts (same batch)."""
    from spmd_rl.train.optim import make_optimizer

    opt = make_optimizer(actor, lr=5e-4, weight_decay=0.0)
    seqs = [p + target for p in prompts]
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for i, (p, s) in enumerate(zip(prompts, seqs)):
        ids[i, : len(s)], mask[i, : len(s)] = torch.tensor(s), 1
        labels[i, len(p): len(s)] = torch.tensor(target)
    ids, mask, labels = ids.to(dev), mask.to(dev), labels.to(dev)
    losses = []
    for _ in range(steps):
        logits = actor(input_ids=ids, attention_mask=mask).logits.float()
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    del opt
    return losses


@torch.no_grad()
def actor_greedy(actor, prompts: list[list[int]], n_tokens: int, dev) -> list[list[int]]:
    """Greedy decoding by full forwards, one prompt at a time, a fixed number of steps (FSDP needs
    the same forward count on every rank)."""
    out = []
    for p in prompts:
        ids = torch.tensor([p], device=dev)
        for _ in range(n_tokens):
            nxt = actor(input_ids=ids).logits[:, -1].float().argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)
        out.append(ids[0, len(p):].tolist())
    reshard(actor)
    return out


def check_trained_greedy(eng, actor, prompts, my_prompts, args, dev, V) -> dict:
    target = fixed_answer(V)
    actor.train()
    losses = train_fixed_answer(actor, prompts, target, args.train_steps, dev)
    actor.eval()
    reshard(actor)
    eng.wake_up(["weights"])
    eng.load_weights(iter_weights(actor, torch.bfloat16, args.bucket_mb))
    eng.wake_up(["kv_cache"])
    got = [x[0].token_ids for x in eng.generate(my_prompts, SamplingParams(n=1, temperature=0.0, max_new_tokens=TARGET_LEN))]
    eng.sleep()
    want = actor_greedy(actor, my_prompts, TARGET_LEN, dev)
    pairs = [(a, b) for g, w in zip(got, want) for a, b in zip(g, w)]
    return {"loss_first": losses[0], "loss_last": losses[-1],
            "actor_answers_target": sum(w == target for w in want), "prompts": len(want),
            "engine_equals_actor": sum(g == w for g, w in zip(got, want)),
            "token_agreement": sum(a == b for a, b in pairs) / max(1, len(pairs)),
            "engine_lengths": [len(g) for g in got]}


def check_generate(eng, actor, my_prompts, prompts, ref_greedy, tp, tp_rank, V, dev) -> dict:
    out: dict = {}
    # sampling: shapes, finish reasons, determinism under a fixed seed, log-prob semantics
    T, n, L = 0.8, 2, 32
    sp = SamplingParams(n=n, temperature=T, max_new_tokens=L, seed=7)
    a = eng.generate(my_prompts, sp)
    eng.llm.reset_prefix_cache()
    b = eng.generate(my_prompts, sp)
    out["n_prompts"], out["n_results"] = len(my_prompts), len(a)
    out["n_per_prompt"] = sorted({len(x) for x in a})
    out["lengths_ok"] = all(len(c.token_ids) == len(c.logprobs) and 0 < len(c.token_ids) <= L for x in a for c in x)
    out["finish_ok"] = all((c.finish_reason == "length" and len(c.token_ids) == L)
                           or (c.finish_reason == "stop" and c.token_ids[-1] == QWEN_EOS) for x in a for c in x)
    out["deterministic"] = all(c.token_ids == d.token_ids for x, y in zip(a, b) for c, d in zip(x, y))
    out["samples_differ_within_prompt"] = any(x[0].token_ids != x[1].token_ids for x in a)
    # log-probs of every 2nd prompt only, in vLLM's dicts instead of the flat lists (rollout/vllm/outputs.py):
    # the same tokens and numbers as b (also after a prefix-cache reset) where asked, none elsewhere
    flat, eng.flat_logprobs = eng.flat_logprobs, False
    eng.llm.reset_prefix_cache()
    c = eng.generate(my_prompts, dataclasses.replace(sp, logprobs_every=2))
    eng.flat_logprobs = flat
    out["flat_logprobs_used"] = flat
    out["dicts_equal_flat"] = all(k.token_ids == m.token_ids and (k.logprobs == m.logprobs if i % 2 == 0 else
                                                                  k.logprobs is None)
                                  for i, (x, y) in enumerate(zip(c, b)) for k, m in zip(x, y))
    seqs = [p + c.token_ids for p, x in zip(my_prompts, a) for c in x]
    eng_lp = [c.logprobs for x in a for c in x]
    padded = same_count(seqs)
    _, lpT = teacher_forced(actor, padded, dev, temperature=T)
    _, lp1 = teacher_forced(actor, padded, dev, temperature=1.0)
    reshard(actor)
    # response tokens only: positions len(prompt)-1 .. end of the teacher-forced log-probs
    offs = [len(p) for p, x in zip(my_prompts, a) for _ in x]
    dT = absdiff([lpT[i][o - 1:] for i, o in enumerate(offs)], eng_lp)
    d1 = absdiff([lp1[i][o - 1:] for i, o in enumerate(offs)], eng_lp)
    out["sample_logprob_vs_actor_T_mean"], out["sample_logprob_vs_actor_T_max"] = dT.mean().item(), dT.max().item()
    out["sample_logprob_vs_actor_T1_mean"] = d1.mean().item()
    # replicas with the same call seed must still sample differently (engine seed = rollout.seed + replica)
    world = dist.get_world_size()
    if world > tp:
        firsts = [None] * world
        dist.all_gather_object(firsts, [c.token_ids for x in a for c in x] if tp_rank == 0 else None)
        reps = [f for f in firsts if f is not None]
        out["replicas_differ"] = any(r != reps[0] for r in reps[1:])
    # greedy: n copies, equal to the disk engine's greedy tokens
    eng.llm.reset_prefix_cache()  # prefill the prompts afresh, as the disk engine did (cached
    # prefixes change the numerics slightly, which flips argmax ties of near-flat random-model logits)
    gr = eng.generate(my_prompts, SamplingParams(n=2, temperature=0.0, max_new_tokens=16))
    out["greedy_copies_equal"] = all(x[0].token_ids == x[1].token_ids for x in gr)
    want = ref_greedy[tp_rank::tp]
    out["greedy_matches_disk"] = sum(x[0].token_ids == w for x, w in zip(gr, want))
    out["greedy_total"] = len(want)
    # stop tokens: every 20th id stops; a stopped response ends with (only) its stop token
    stop = list(range(0, V, 20))
    st = eng.generate(my_prompts, SamplingParams(n=1, temperature=1.0, max_new_tokens=64, stop_token_ids=stop, seed=3))
    ss = set(stop)
    ok, n_stop = True, 0
    for x in st:
        c = x[0]
        inner = any(t in ss for t in c.token_ids[:-1])
        if c.finish_reason == "stop":
            n_stop += 1
            ok &= (c.token_ids[-1] in ss or c.token_ids[-1] == QWEN_EOS) and not inner
        else:
            ok &= len(c.token_ids) == 64 and not inner and c.token_ids[-1] not in ss
    out["stop_ok"], out["n_stopped"], out["n_stop_prompts"] = ok, n_stop, len(st)
    # a rank with no prompts still takes part (TP groups gather) and gets []
    out["empty_ok"] = eng.generate([], sp) == []
    return out


if __name__ == "__main__":
    main()
