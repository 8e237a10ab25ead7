"""The bucketed gather gives every rank the actor's full weights bit for bit, and a rollout
copy fed through it is identical to the actor."""

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from tests.helpers.dist_utils import run_distributed


def tiny(tie: bool, vocab: int = 67):
    # odd vocab and one KV head: uneven dim-0 shards over 2 or 3 ranks
    return Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=tie)


def _sync_body(rank, world, tie):
    from torch.distributed.device_mesh import init_device_mesh

    from spmd_rl.model.loading import apply_fsdp
    from spmd_rl.rollout.hf_engine import HFEngine
    from spmd_rl.rollout.weight_sync import iter_weight_buckets, iter_weights

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    plain = Qwen2ForCausalLM(tiny(tie))
    actor = Qwen2ForCausalLM(tiny(tie))
    actor.load_state_dict(plain.state_dict())
    apply_fsdp(actor, mesh, torch.float32)
    # train one step so the weights differ from the engine's initial copy
    opt = torch.optim.AdamW(actor.parameters(), lr=1e-2)
    x = torch.randint(0, 67, (2, 9))
    actor(input_ids=x, labels=x).loss.backward()
    opt.step()
    full = {n: p.full_tensor() for n, p in actor.named_parameters()}
    for bucket_mb in (0, 1, 1024):  # one tensor per bucket, a few, everything in one
        got = dict(iter_weights(actor, torch.float32, bucket_mb))
        assert list(got) == list(full)
        for n in full:
            assert torch.equal(got[n], full[n]), (bucket_mb, n)
    assert len(list(iter_weight_buckets(actor, torch.float32, 0))) == len(full)
    # bf16 cast before the gather == cast after
    for n, t in iter_weights(actor, torch.bfloat16, 1):
        assert torch.equal(t, full[n].to(torch.bfloat16)), n
    engine = HFEngine(plain, pad_token_id=0, eos_token_ids=[1], device=torch.device("cpu"))
    engine.load_weights(iter_weights(actor, torch.float32, 1))
    for name, value in engine.model.state_dict().items():  # lm_head too (tied or not)
        ref = full.get(name, full.get("model.embed_tokens.weight") if name == "lm_head.weight" else None)
        assert torch.equal(value, ref), name
    if tie:
        assert engine.model.lm_head.weight.data_ptr() == engine.model.model.embed_tokens.weight.data_ptr()


def _both(rank, world):
    _sync_body(rank, world, True)
    _sync_body(rank, world, False)


def test_sync_tied_and_untied_3_ranks():
    # one process group for both cases: spawning processes dominates this test's time
    run_distributed(_both, 3)


def _reshard_body(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from spmd_rl.model.loading import apply_fsdp, reshard

    model = apply_fsdp(Qwen2ForCausalLM(tiny(True)), init_device_mesh("cpu", (world,)), torch.float32)
    with torch.no_grad():
        model(input_ids=torch.randint(0, 67, (2, 9)))
    # FSDP2 keeps the root unit's parameters (embeddings, norm) unsharded after a forward
    assert any(not isinstance(p, DTensor) for p in model.parameters())
    reshard(model)
    assert all(isinstance(p, DTensor) for p in model.parameters())


def test_reshard_after_no_grad_forward_frees_unsharded_parameters():
    run_distributed(_reshard_body, 2)

