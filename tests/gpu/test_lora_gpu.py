"""A LoRA actor's adapter reaches our vLLM engine, both ways (model.lora_sync), on one GPU: the
numbers come from tests/gpu/lora_worker.py (its docstring says what each is), a random Qwen2-0.5B
shape with rank 32 on every linear layer and its B drawn non-zero.

- the adapter sync gives the actor's log-probs at bf16 level, where losing the adapter would be off
  by `effect`; a zero adapter gives the base's; after a sleep (level 1) and a wake-up the base is
  still there and a new adapter replaces the old one without the base being sent again;
- merged weights give the actor's log-probs too;
- the trap: after 5 small AdamW steps the engine fed by the adapter sync follows the actor's move of
  its log-probs; the merged sync, whose bf16 W + s B A rounds the change away, is printed beside it;
- with rollout.weights_stay_on_gpu (the worker run again, --weights-stay) the weights stay mapped while
  the engine sleeps, nothing else does, and every number above holds as without it;
- rollout.lora_matmul's matmuls are as close to float64 as vLLM's Punica kernels at a 7B layer's shapes.
"""

from __future__ import annotations

import json

import pytest
from runs import random_model_dir, run_worker, skip_reason

pytestmark = pytest.mark.gpu


def run_lora_worker(tmp_path_factory, *flags):
    reason = skip_reason(1)
    if reason:
        pytest.skip(reason)
    pytest.importorskip("peft")
    out = tmp_path_factory.mktemp("lora") / "result.json"
    result = run_worker("lora_worker.py", ["--model", random_model_dir("qwen2-0.5b"), *flags], out, timeout=900)
    print("lora sync on the GPU", *flags, json.dumps(result))
    return result


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    return run_lora_worker(tmp_path_factory)


@pytest.fixture(scope="module")
def measured_weights_stay(tmp_path_factory):
    return run_lora_worker(tmp_path_factory, "--weights-stay")


def test_the_adapter_sync_gives_the_actors_policy(measured):
    m = measured
    assert m["sleep_level"] == 1, m  # the base stays (in host memory) across sleeps
    assert m["adapter"] < 0.05, m  # bf16 level (a broken name mapping or a lost adapter shows `effect`)
    assert m["effect"] > max(0.2, 5 * m["adapter"]), m  # the adapter moves the policy far beyond that
    assert m["no_adapter"] < 0.05, m  # B = 0: the base's policy
    assert m["after_sleep"] < 0.05, m  # a new adapter, the base kept through sleep and wake-up
    assert m["held_asleep"] == {}, m  # without rollout.weights_stay_on_gpu nothing stays mapped


def test_the_merged_sync_gives_the_actors_policy(measured):
    assert measured["merged"] < 0.05, measured


def test_after_small_updates_the_adapter_synced_engine_follows_the_actor(measured):
    m = measured
    assert m["actor_move"] > 0, m
    assert m["miss_adapter"] < 0.3, m
    print(f"after 5 AdamW steps at lr 1e-5 (mean |move| {m['actor_move']:.2e} nats): the engine missed "
          f"{m['miss_adapter']:.2f} of the actor's move with the adapter sync, {m['miss_merged']:.2f} merged")


def test_the_weights_kept_on_the_gpu_while_it_sleeps_give_the_same_policy(measured_weights_stay):
    m = measured_weights_stay
    assert set(m["held_asleep"]) == {"weights"}, m  # the KV cache is freed, the weights stay
    assert m["held_asleep"]["weights"] >= m["engine_weight_bytes"], m  # the base's bf16 bytes at least
    for key in ("adapter", "no_adapter", "after_sleep", "merged"):
        assert m[key] < 0.05, (key, m)
    assert m["effect"] > max(0.2, 5 * m["adapter"]), m
    assert m["actor_move"] > 0 and m["miss_adapter"] < 0.3, m


LAYERS_7B = {"qkv": (3584, (3584, 512, 512)), "o": (3584, (3584,)), "gate_up": (3584, (18944, 18944)),
             "down": (18944, (3584,))}
"""Qwen2.5-7B's adapted layers as vLLM's LoRA layers call them at one GPU: input width, output slices."""


@pytest.mark.parametrize("tokens", [512, 4096], ids=["decode-512", "prefill-4096"])
def test_one_adapter_matmuls_match_vllms_punica_kernels(tokens):
    """rollout.lora_matmul's wrapper (spmd_rl/rollout/vllm/lora_matmul.py) against vLLM's Punica Triton kernels
    on the same adapter and token map (a tenth of the tokens without the adapter), both against float64, at
    its first call (which joins the layer's slices) and after a new adapter is written through vLLM's slice
    tensors: as close as the kernels, and tokens without the adapter keep the base output exactly. The
    engine's wrapper without the mask (EveryTokenPunica: every request carries the adapter) gives the
    masked wrapper's output bit for bit on the tokens with the adapter."""
    reason = skip_reason(1)
    if reason:
        pytest.skip(reason)
    pytest.importorskip("vllm")
    import torch
    from vllm.config.lora import LoRAConfig
    from vllm.lora.layers.utils import LoRAMapping
    from vllm.lora.punica_wrapper.punica_gpu import PunicaWrapperGPU

    from spmd_rl.rollout.vllm import lora_matmul

    lora_matmul.install()
    from vllm.lora.punica_wrapper.punica_selector import get_punica_wrapper

    config = LoRAConfig(max_loras=1, max_lora_rank=32, lora_dtype=torch.bfloat16)
    ids = [0 if t % 10 == 3 else 1 for t in range(tokens)]  # LoRA id 1 in slot 0; id 0: no adapter
    mapping = LoRAMapping(index_mapping=tuple(ids), prompt_mapping=tuple(ids), is_prefill=tokens > 512)
    theirs = PunicaWrapperGPU(8192, 512, "cuda", lora_config=config)
    ours = get_punica_wrapper(8192, 512, "cuda", lora_config=config)
    assert type(ours).__name__ == "OneAdapterPunica"
    lora_matmul.install(every_request_has_adapter=True)
    every = get_punica_wrapper(8192, 512, "cuda", lora_config=config)
    assert type(every).__name__ == "EveryTokenPunica"
    for w in (theirs, ours, every):
        w.update_metadata(mapping, [1], 1, 152064)
    gen = torch.Generator(device="cuda").manual_seed(0)
    has = torch.tensor(ids, device="cuda") == 1

    def draw(t, fan_in):  # a new adapter, written into vLLM's slot tensor as its set_lora does
        t[0] = 0
        t[0, 0].copy_(torch.randn(t.shape[2:], generator=gen, device="cuda") / fan_in ** 0.5)

    for name, (fan_in, outs) in LAYERS_7B.items():
        x = torch.randn(tokens, fan_in, generator=gen, device="cuda").bfloat16()
        y0 = torch.randn(tokens, sum(outs), generator=gen, device="cuda").bfloat16()
        a = tuple(torch.zeros(1, 1, 32, fan_in, device="cuda", dtype=torch.bfloat16) for _ in outs)
        b = tuple(torch.zeros(1, 1, n, 32, device="cuda", dtype=torch.bfloat16) for n in outs)
        a_theirs, b_theirs = tuple(t.clone() for t in a), tuple(t.clone() for t in b)
        a_every, b_every = tuple(t.clone() for t in a), tuple(t.clone() for t in b)  # its own joined matrices
        for load in ("first", "reloaded"):
            for t, t_theirs, t_every in zip((*a, *b), (*a_theirs, *b_theirs), (*a_every, *b_every)):
                draw(t, t.shape[-1])
                t_theirs.copy_(t)
                t_every.copy_(t)
            want, offset = y0.double().clone(), 0
            for ai, bi, n in zip(a_theirs, b_theirs, outs):
                want[has, offset:offset + n] += (x[has].double() @ ai[0, 0].double().t()) @ bi[0, 0].double().t()
                offset += n
            got = {}
            for label, w, aa, bb in (("punica", theirs, a_theirs, b_theirs), ("matmul", ours, a, b),
                                     ("every", every, a_every, b_every)):
                y = y0.clone()
                w.add_lora_linear(y, x, aa, bb, 1.0, outs)
                got[label] = y
            err = {k: (v.double() - want)[has].abs().max().item() for k, v in got.items()}  # the adapter's tokens
            print(f"{name} at {tokens} tokens, {load} adapter: max error against float64 {err}")
            assert err["matmul"] <= 1.5 * err["punica"] + 1e-3, (name, load, err)
            assert torch.equal(got["matmul"][~has], y0[~has]), (name, load)
            assert torch.equal(got["punica"][~has], y0[~has]), (name, load)
            assert torch.equal(got["every"][has], got["matmul"][has]), (name, load)
