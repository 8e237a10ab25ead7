"""Model families other than Qwen2 through the CPU path, each as a tiny random model of its own
config class with the shape quirks that matter: packed rows = padded rows (log-probs and
gradients), the HF engine's log-probs of its sampled tokens = the actor's forward, and the weights
synced from an FSDP actor into the engine = the actor's, under the engine's parameter names.

- qwen3: q/k norms, head_dim 16 != hidden / heads (as Qwen3-0.6B's 128 != 1024 / 16), tied head.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from dist_utils import run_distributed

from spmd_rl.batching.batch import Batch, build_rollout_batch


def family_config(family: str):
    """A tiny config of `family`'s own class, with the shape quirks of its real models."""
    common = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2)
    if family == "qwen3":
        return Qwen3Config(**common, head_dim=16, tie_word_embeddings=True)
    raise KeyError(family)


FAMILIES = ["qwen3"]


def family_model(family: str, dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(family_config(family), dtype=dtype)


def ragged_batch(lens, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    width = max(lens)
    ids = torch.randint(1, vocab, (len(lens), width), generator=g)
    attn = torch.zeros(len(lens), width, dtype=torch.long)
    for i, n in enumerate(lens):
        attn[i, :n] = 1
    return Batch({"input_ids": ids * attn, "attention_mask": attn})


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_preset_shapes_build_their_family_config_class():
    from spmd_rl.model.loading import ARCH_PRESETS, random_model_config

    want = {"qwen3-0.6b": "Qwen3Config", "qwen3-8b": "Qwen3Config", "llama3.1-8b": "LlamaConfig",
            "llama3.2-1b": "LlamaConfig", "gemma3-1b": "Gemma3TextConfig", "qwen2-0.5b": "Qwen2Config"}
    for arch, cls in want.items():
        config = random_model_config(arch)
        assert type(config).__name__ == cls, arch
        assert config.vocab_size == ARCH_PRESETS[arch]["vocab_size"]
    assert random_model_config("qwen3-0.6b").head_dim == 128 != 1024 // 16
    assert random_model_config("llama3.1-8b").rope_parameters["rope_type"] == "llama3"
    gemma = random_model_config("gemma3-1b")
    assert gemma.layer_types[:6] == ["sliding_attention"] * 5 + ["full_attention"] and gemma.sliding_window == 512


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_equals_padded_with_gradients(family):
    """Packed rows + chunked head against padded rows + full logits (float64): log-probs, entropy,
    every parameter's gradient."""
    from spmd_rl.model.loading import prepare_policy
    from spmd_rl.train.actor import forward_logprobs

    config = family_config(family)
    mb = ragged_batch([5, 11, 2, 9, 11], config.vocab_size)
    keep = mb["attention_mask"].bool()
    keep[:, 0] = False
    out = {}
    for packed in (False, True):
        model = prepare_policy(family_model(family), remove_padding=packed, chunked_logprobs=packed)
        logp, ent = forward_logprobs(model, mb, 0.8, with_entropy=True, entropy_grad=True)
        (logp[keep].sum() + 0.1 * ent[keep].sum()).backward()
        out[packed] = (logp.detach(), ent.detach(), grads(model))
    torch.testing.assert_close(out[True][0][keep], out[False][0][keep], rtol=0, atol=1e-12)
    torch.testing.assert_close(out[True][1][keep], out[False][1][keep], rtol=0, atol=1e-12)
    assert out[True][2].keys() == out[False][2].keys()
    for n, g in out[False][2].items():
        torch.testing.assert_close(out[True][2][n], g, rtol=0, atol=1e-10, msg=n)


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_engine_logprobs_of_sampled_tokens_equal_the_actor_forward(family):
    """The engine (transformers generate, KV cache) samples; the actor (packed, chunked head) scores
    the same rows: every sampled token's log-prob agrees (float64 weights; the engine's logits are
    float32)."""
    from spmd_rl.model.loading import prepare_policy
    from spmd_rl.rollout.base import SamplingParams
    from spmd_rl.rollout.hf_engine import HFEngine
    from spmd_rl.train.actor import compute_logprobs

    engine = HFEngine(family_model(family), pad_token_id=0, eos_token_ids=[1], device=torch.device("cpu"))
    actor = prepare_policy(family_model(family), remove_padding=True)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16]]
    comps = engine.generate(prompts, SamplingParams(n=2, temperature=0.9, max_new_tokens=9, seed=3, logprobs_every=1))
    batch = build_rollout_batch(prompts, comps, pad_id=0)
    logp = compute_logprobs(actor, batch, 0.9, micro_batch_size=6, device=torch.device("cpu"))
    row, compared = 0, 0
    for p, group in zip(prompts, comps):
        for c in group:
            got = logp[row, len(p):len(p) + len(c.token_ids)]
            torch.testing.assert_close(got, torch.tensor(c.logprobs, dtype=got.dtype), rtol=0, atol=2e-5)
            compared += len(c.token_ids)
            row += 1
    assert compared >= 30  # the rows are long enough to pass a sliding window where a family has one


def _sync_families(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    from spmd_rl.model.loading import apply_fsdp
    from spmd_rl.rollout.hf_engine import HFEngine
    from spmd_rl.rollout.weight_sync import iter_weights

    mesh = init_device_mesh("cpu", (world,))
    for family in FAMILIES:
        config = family_config(family)
        actor = apply_fsdp(family_model(family, torch.float32), mesh, torch.float32)
        opt = torch.optim.AdamW(actor.parameters(), lr=1e-2)  # one step: the actor differs from the engine's copy
        x = torch.randint(0, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
        actor(input_ids=x, labels=x).loss.backward()
        opt.step()
        full = {n: p.full_tensor() for n, p in actor.named_parameters()}
        engine = HFEngine(family_model(family, torch.float32, seed=1), pad_token_id=0, eos_token_ids=[1],
                          device=torch.device("cpu"))
        engine.load_weights(iter_weights(actor, torch.float32, 1))  # KeyError for a name the engine lacks
        state = engine.model.state_dict()
        tied = config.tie_word_embeddings
        assert ("lm_head.weight" in full) == (not tied), family
        for name, value in state.items():
            if name in full:
                assert torch.equal(value, full[name]), (family, name)
            elif name == "lm_head.weight":
                assert tied and torch.equal(value, full["model.embed_tokens.weight"]), family
        assert set(full) <= set(state), family


def test_weight_sync_into_the_hf_engine_gives_the_actors_weights():
    """An FSDP actor over 2 ranks (uneven shards), trained a step, streamed through weight_sync into
    the HF engine: every engine tensor is the actor's (the head, tied or not, too)."""
    run_distributed(_sync_families, 2)
