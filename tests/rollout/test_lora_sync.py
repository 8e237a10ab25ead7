"""A LoRA actor's merged weight sync (spmd_rl/rollout/weight_sync.py + spmd_rl/model/lora.py): the
engine gets PEFT's merged weights under transformers' names, and its log-probs are the actor's; and
the trap of merged sync: after several small-learning-rate updates the engine's log-probs must
follow the actor's, not stay at the initial model's.

One 2-rank job measures everything (spawning processes dominates the time); the tests read its
numbers. "miss" = |engine's move - actor's move| / |actor's move| over fixed sequences' log-probs,
from before the updates to after: 0 = the engine follows the actor, 1 = it stayed at the initial
policy.

Measured (this file's job, deterministic): miss at the start (B = 0) / once B has grown to W's scale:
fp32 engine, merged 0.005 / 0.001; bf16 engine weights, merged 0.95 / 0.33; the adapter sync into bf16
base and LoRA layers 0.004 / 0.42."""

import functools
import json

import pytest
import torch

from tests.helpers.dist_utils import run_distributed

pytest.importorskip("peft")

WORLD = 2
RANK, ALPHA = 8, 16.0
SMALL_LR, STEPS = 1e-6, 5  # AdamW moves each adapter entry by ~lr per step


def _measure(rank, world, path, out_file):
    from peft import get_peft_model
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    from spmd_rl.model.loading import build_sharded, load_causal_lm
    from spmd_rl.model.lora import LoraSettings, lora_config
    from spmd_rl.rollout.hf_engine import HFEngine
    from spmd_rl.rollout.weight_sync import gather_adapter, iter_base_weights, iter_weights

    ids = torch.randint(0, 60, (8, 16), generator=torch.Generator().manual_seed(3))
    targets = torch.roll(ids, -1, 1)

    def actor_logprobs(grad=False):
        with torch.set_grad_enabled(grad):
            return actor(input_ids=ids, logprob_targets=targets, temperature=1.0)[0]

    @torch.no_grad()
    def engine_logprobs(engine):
        return torch.log_softmax(engine.model(input_ids=ids).logits.float(), -1).gather(-1, targets[..., None])[..., 0]

    def train(lr):
        opt = torch.optim.AdamW([p for p in actor.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
        for _ in range(STEPS):
            (-actor_logprobs(grad=True).mean()).backward()
            opt.step()
            opt.zero_grad()

    def engine(weights_dtype):
        """An fp32 engine given the actor's merged weights at `weights_dtype` (a bf16 engine's weights
        computed in fp32, so what is measured is the weights' rounding, not bf16 arithmetic)."""
        e = HFEngine(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), 0, [1], torch.device("cpu"))
        e.load_weights((n, t.float()) for n, t in iter_weights(actor, weights_dtype, 1))
        return e

    def trap(result, when):
        """Several small updates; how much of the actor's move reaches each engine."""
        before = {dt: engine_logprobs(engine(dt)) for dt in (torch.float32, torch.bfloat16)}
        apart_before = adapter_apart_logprobs()
        a0 = actor_logprobs()
        train(SMALL_LR)
        moved = actor_logprobs() - a0

        def miss(after, before):
            return (((after - before) - moved).norm() / moved.norm()).item()

        result[f"miss_fp32_{when}"] = miss(engine_logprobs(engine(torch.float32)), before[torch.float32])
        result[f"miss_bf16_{when}"] = miss(engine_logprobs(engine(torch.bfloat16)), before[torch.bfloat16])
        result[f"miss_bf16_adapter_apart_{when}"] = miss(adapter_apart_logprobs(), apart_before)

    def adapter_apart_logprobs():
        """The adapter sync (iter_base_weights once, gather_adapter) into an engine whose base and
        LoRA layers hold bf16, as vLLM's (lora_dtype = the model's dtype), computed in fp32."""
        engine_model = load_causal_lm(path, torch.bfloat16, lora=settings._replace(adapter_dtype=torch.bfloat16))
        e = HFEngine(engine_model, 0, [1], torch.device("cpu"))
        e.load_weights(iter_base_weights(actor, torch.bfloat16, 1))
        e.load_adapter(gather_adapter(actor))
        e.model.float()
        return engine_logprobs(e)

    torch.manual_seed(0)  # the adapter's A, drawn on rank 0
    mesh = init_device_mesh("cpu", (world,))
    settings = LoraSettings(RANK, ALPHA, (), torch.float32)
    # the GPU layout: base frozen in bf16, adapter fp32 (computed in fp32 here: CPU)
    actor = build_sharded(functools.partial(load_causal_lm, path, torch.bfloat16, lora=settings), mesh,
                          torch.float32, False)
    result = {}
    # 1. the trap at the start of training: B ~ 0
    trap(result, "fresh")
    # 2. after updates at a large learning rate (B ~ 0.05, above W's scale), the engine holds PEFT's merged model
    train(1e-2)
    full = get_model_state_dict(actor, options=StateDictOptions(full_state_dict=True))
    twin = get_peft_model(base := AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16),
                          lora_config(settings, base))
    twin.load_state_dict({f"base_model.model.{k}": v for k, v in full.items() if ".lora_" in k}, strict=False)
    merged = twin.merge_and_unload().state_dict()  # PEFT merges in the adapter's fp32, the sum cast to bf16
    synced = dict(iter_weights(actor, torch.float32, 1))
    result["names"] = sorted(synced) == sorted(k for k in merged if k != "lm_head.weight")
    result["merge_err"] = max((synced[k].to(torch.bfloat16).float() - merged[k].float()).abs().max().item()
                              for k in synced)
    result["logprob_err"] = (engine_logprobs(engine(torch.float32)) - actor_logprobs()).abs().max().item()
    # 3. the trap again, B grown
    trap(result, "grown")
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump(result, f)


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    from spmd_rl.model.loading import materialize_random_model, random_model_config

    base = tmp_path_factory.mktemp("lora_sync")
    path = materialize_random_model(str(base / "tiny"), random_model_config("tiny"), 0, torch.bfloat16)
    out = base / "result.json"
    run_distributed(_measure, WORLD, path, str(out))
    return json.loads(out.read_text())


def test_merged_sync_is_pefts_merge_under_transformers_names(measured):
    assert measured["names"]  # q_proj.weight, not q_proj.base_layer.weight; no lora_A/B
    assert measured["merge_err"] == 0.0  # bit for bit PEFT's merge_and_unload, at bf16
    assert measured["logprob_err"] < 1e-5  # the fp32 engine samples the actor's policy


def test_small_updates_reach_an_fp32_engine(measured):
    """The merge is computed in fp32 from the fp32 adapter: an fp32 engine follows every update (a merge
    computed in bf16 loses them: miss 0.95 fresh, 0.76 with B grown, measured by breaking lora.merge)."""
    assert measured["miss_fp32_fresh"] < 0.05 and measured["miss_fp32_grown"] < 0.05, measured


def test_merged_sync_into_bf16_weights_loses_small_updates(measured):
    """The trap, and why model.lora_sync defaults to "adapter": merged at bf16, W + s*B@A rounds back to W
    where the update is below half a bf16 step of W, and the engine keeps sampling the initial policy."""
    assert measured["miss_bf16_fresh"] > 0.5, measured


def test_adapter_sync_into_a_bf16_engine_keeps_small_updates(measured):
    """The adapter sync at the same bf16 precision: the update is kept in B (near 0 at the start), not in W,
    and the engine follows the actor."""
    assert measured["miss_bf16_adapter_apart_fresh"] < 0.05, measured


@pytest.mark.xfail(strict=True, reason="a bf16 adapter rounds away updates below half a bf16 step of B or A: once B has "
                   "grown (here to W's scale) the adapter sync loses them too. vLLM 0.26's LoRA kernels take bf16 or "
                   "fp16 adapters only (lora_expand asserts it), so the engine's adapter cannot be fp32")
def test_adapter_sync_into_a_bf16_engine_keeps_small_updates_once_b_has_grown(measured):
    assert measured["miss_bf16_adapter_apart_grown"] < 0.05, measured


def _hsdp_body(rank, world, path):
    from peft import get_peft_model
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers import AutoModelForCausalLM

    from spmd_rl.model.loading import build_sharded, load_causal_lm
    from spmd_rl.model.lora import LoraSettings, base_name, lora_config
    from spmd_rl.rollout.weight_sync import iter_weights
    from spmd_rl.runtime.distributed import fsdp_mesh

    torch.manual_seed(0)
    settings = LoraSettings(RANK, ALPHA, ("q_proj", "down_proj"), torch.float32)
    actor = build_sharded(functools.partial(load_causal_lm, path, torch.float32, lora=settings),
                          fsdp_mesh("cpu", world, 2), torch.float32, False)  # 2 replicas x shard groups of 2
    opt = torch.optim.AdamW([p for p in actor.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(0, 60, (2, 9), generator=torch.Generator().manual_seed(rank))
    for _ in range(2):
        actor(input_ids=ids, logprob_targets=ids, temperature=1.0)[0].mean().backward()
        opt.step()
        opt.zero_grad()
    full = get_model_state_dict(actor, options=StateDictOptions(full_state_dict=True))
    twin = get_peft_model(base := AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                          lora_config(settings, base))
    twin.load_state_dict({f"base_model.model.{k}": v for k, v in full.items() if ".lora_" in k}, strict=False)
    merged = twin.merge_and_unload().state_dict()
    synced = dict(iter_weights(actor, torch.float32, 1))
    assert sorted(synced) == sorted(k for k in merged if k != "lm_head.weight")
    base = {base_name(k): v for k, v in full.items() if ".lora_" not in k}
    changed = [k for k in synced if not torch.equal(synced[k], base[k])]
    assert sorted({k.split(".")[-2] for k in changed}) == ["down_proj", "q_proj"], changed  # the targets alone
    for k, t in synced.items():
        torch.testing.assert_close(t, merged[k], atol=1e-6, rtol=1e-6)


def test_merged_sync_under_hsdp_with_some_targets(tmp_path):
    from spmd_rl.model.loading import materialize_random_model, random_model_config

    path = materialize_random_model(str(tmp_path / "tiny"), random_model_config("tiny"), 0, torch.float32)
    run_distributed(_hsdp_body, 4, path)
