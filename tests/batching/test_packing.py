"""Packed sequences, chunked log-probs and token-budget micro-batches give the numbers of the plain
padded path: log-probs, entropy, values and gradients (float64, so equality is to ~1e-12)."""

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

from spmd_rl import preflight
from spmd_rl.batching.batch import Batch, balanced_partition, plan_micro_batches
from tests.helpers.dist_utils import run_distributed


def tiny_config(**kw):
    return Qwen2Config(**{**dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True), **kw})


def ragged_batch(lens, vocab=97, seed=0):
    g = torch.Generator().manual_seed(seed)
    L = max(lens)
    ids = torch.randint(1, vocab, (len(lens), L), generator=g)
    attn = torch.zeros(len(lens), L, dtype=torch.long)
    for i, n in enumerate(lens):
        attn[i, :n] = 1
    return Batch({"input_ids": ids * attn, "attention_mask": attn})


# --------------------------------------------------------------------------- log-prob head


def plain_logprobs_entropy(hidden, weight, targets, temperature):
    """The textbook formula in float64: full logits, log-softmax, gather; entropy = -sum p log p."""
    logp_all = torch.log_softmax(hidden.double() @ weight.double().t() / temperature, -1)
    return logp_all.gather(-1, targets[..., None])[..., 0], -(logp_all.exp() * logp_all).sum(-1)


@pytest.mark.parametrize("entropy_grad", [False, True])
def test_chunked_logprobs_and_entropy_match_full_formula_with_gradients(entropy_grad):
    from spmd_rl.model.logprob_head import token_logprobs

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 13, 8, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(50, 8, dtype=torch.float64, generator=g, requires_grad=True)
    targets = torch.randint(0, 50, (2, 13), generator=g)
    w_logp, w_ent = torch.randn(2, 13, dtype=torch.float64, generator=g), torch.randn(2, 13, dtype=torch.float64, generator=g)

    logp, ent = token_logprobs(hidden, weight, targets, 0.7, with_entropy=True, entropy_grad=entropy_grad, chunk=5)
    ref_logp, ref_ent = plain_logprobs_entropy(hidden, weight, targets, 0.7)
    torch.testing.assert_close(logp, ref_logp, rtol=0, atol=1e-12)
    torch.testing.assert_close(ent, ref_ent.detach(), rtol=0, atol=1e-12)
    assert ent.requires_grad == entropy_grad

    got = torch.autograd.grad((logp * w_logp).sum() + (ent * w_ent).sum() if entropy_grad else (logp * w_logp).sum(),
                              (hidden, weight))
    ref_loss = (ref_logp * w_logp).sum() + ((ref_ent * w_ent).sum() if entropy_grad else 0)
    want = torch.autograd.grad(ref_loss, (hidden, weight))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)

    with torch.no_grad():  # the no-graph path gives the same numbers
        nl, ne = token_logprobs(hidden, weight, targets, 0.7, with_entropy=True, chunk=3)
    torch.testing.assert_close(nl, ref_logp.detach(), rtol=0, atol=1e-12)
    torch.testing.assert_close(ne, ref_ent.detach(), rtol=0, atol=1e-12)


def head_weight_grad_error(device: str, fused: str = "none", chunks: int = 30) -> float:
    """Relative error (Frobenius) of the chunked head's weight gradient in bf16, as an FSDP actor's
    bf16 compute weight gets it, against the float64 formula: log-probs and an entropy bonus over
    `chunks` chunks, so the float32 accumulation over chunks (`logprob_head._accumulate`) is what
    is tested. Shared with tests/gpu/test_fused_gpu.py (CUDA: one addmm per chunk)."""
    from spmd_rl.model.logprob_head import token_logprobs

    g = torch.Generator().manual_seed(0)
    n, vocab, width, chunk = 40 * chunks, 1000, 64, 40
    hidden = torch.randn(n, width, generator=g).to(device, torch.bfloat16)
    weight = (0.2 * torch.randn(vocab, width, generator=g)).to(device, torch.bfloat16).requires_grad_()
    targets = torch.randint(0, vocab, (n,), generator=g).to(device)
    w_logp, w_ent = (torch.randn(n, generator=g, dtype=torch.float64).to(device) for _ in range(2))
    logp, ent = token_logprobs(hidden, weight, targets, 0.7, with_entropy=True, entropy_grad=True,
                               chunk=chunk, fused=fused)
    (got,) = torch.autograd.grad((logp.double() * w_logp).sum() + (ent.double() * w_ent).sum(), weight)
    w64 = weight.detach().double().requires_grad_()
    ref_logp, ref_ent = plain_logprobs_entropy(hidden.double(), w64, targets, 0.7)
    (want,) = torch.autograd.grad((ref_logp * w_logp).sum() + (ref_ent * w_ent).sum(), w64)
    return ((got.double() - want).norm() / want.norm()).item()


def test_head_weight_gradient_in_bf16_is_accumulated_over_chunks_to_bf16_precision():
    """30 chunks of bf16 logits: the weight gradient is within bf16's rounding of the float64
    formula (0.006 here; with one chunk left out of the sum it is 0.18)."""
    assert head_weight_grad_error("cpu") < 1.5e-2


def test_chunk_size_bounds_float32_temporaries():
    from spmd_rl.model.logprob_head import CHUNK_ELEMENTS, chunk_positions

    assert chunk_positions(151936) * 151936 <= CHUNK_ELEMENTS
    assert chunk_positions(10) * 10 <= CHUNK_ELEMENTS and chunk_positions(10**9) == 1


def test_head_refuses_softcapped_models():
    from spmd_rl.model.logprob_head import install

    model = Qwen2ForCausalLM(tiny_config())
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="chunked_logprobs = false"):
        install(model, chunked=True)
    install(model, chunked=False)  # the full-logits path works for any head


# --------------------------------------------------------------------------- packed vs padded


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config()).save_pretrained(d)
    return str(d)


def param_grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_packed_chunked_actor_equals_padded_full_logits(model_dir):
    """Log-probs, entropy and every parameter's gradient: packed rows + chunked head vs the plain
    padded batch with full logits (both float64)."""
    from spmd_rl.model.loading import load_causal_lm
    from spmd_rl.train.actor import forward_logprobs

    mb = ragged_batch([5, 11, 2, 8, 11])
    keep = mb["attention_mask"].bool()
    keep[:, 0] = False  # column 0 has no log-prob
    outs = {}
    for name, packed, chunked in (("padded", False, False), ("packed", True, True)):
        model = load_causal_lm(model_dir, torch.float64, remove_padding=packed, chunked_logprobs=chunked)
        logp, ent = forward_logprobs(model, mb, 0.8, with_entropy=True, entropy_grad=True)
        (logp[keep].sum() * 0.5 + ent[keep].sum() * 0.1).backward()
        outs[name] = (logp, ent, param_grads(model))
    (lp_a, en_a, g_a), (lp_b, en_b, g_b) = outs["padded"], outs["packed"]
    torch.testing.assert_close(lp_b[keep], lp_a[keep], rtol=0, atol=1e-12)
    torch.testing.assert_close(en_b[keep], en_a[keep], rtol=0, atol=1e-12)
    assert (lp_b[~keep] == 0).all()  # padding and first columns stay 0 in the packed path
    assert g_a.keys() == g_b.keys()
    for n in g_a:
        torch.testing.assert_close(g_b[n], g_a[n], rtol=0, atol=1e-10, msg=n)


def nonzero_value_head(model) -> None:
    """A critic's zero-initialised value head set to fixed non-zero weights, so gradients reach the backbone."""
    with torch.no_grad():
        model.score.weight.copy_(torch.linspace(-1, 1, model.score.weight.numel()).view_as(model.score.weight))


def test_packed_critic_values_and_gradients_equal_padded(model_dir):
    from spmd_rl.model.loading import load_value_model
    from spmd_rl.train.critic import forward_values

    mb = ragged_batch([7, 3, 12, 1 + 1], seed=1)
    keep = mb["attention_mask"].bool()
    keep[:, 0] = False
    outs = []
    for packed in (False, True):
        torch.manual_seed(0)
        model = load_value_model(model_dir, torch.float64, remove_padding=packed)
        nonzero_value_head(model)
        v = forward_values(model, mb)
        (v[keep] ** 2).sum().backward()
        outs.append((v, param_grads(model)))
    torch.testing.assert_close(outs[1][0][keep], outs[0][0][keep], rtol=0, atol=1e-12)
    for n in outs[0][1]:
        torch.testing.assert_close(outs[1][1][n], outs[0][1][n], rtol=0, atol=1e-10, msg=n)


def test_varlen_backend_runs_padded_batches_like_sdpa(model_dir):
    """The backend a packed model is loaded with gives sdpa's numbers on a padded batch too."""
    from spmd_rl.model.loading import load_causal_lm

    mb = ragged_batch([4, 9, 6])
    a = load_causal_lm(model_dir, torch.float64)
    b = load_causal_lm(model_dir, torch.float64, remove_padding=True)
    with torch.no_grad():
        la = a(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits
        lb = b(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits
    keep = mb["attention_mask"].bool()
    torch.testing.assert_close(lb[keep], la[keep], rtol=0, atol=1e-12)


# --------------------------------------------------------------------------- token budgets


def test_token_budget_plan_covers_every_row_once_within_budget_and_balanced():
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(20, 640, (64,), generator=g).tolist()
    plan = plan_micro_batches(lengths, micro_batch_size=8, max_tokens=4096)
    assert sorted(i for mb in plan for i in mb) == list(range(64))
    sums = [sum(lengths[i] for i in mb) for mb in plan]
    assert max(sums) <= 4096
    assert len(plan) <= -(-sum(lengths) // 4096) + 1  # near the fewest possible
    assert max(sums) - min(sums) <= max(lengths)  # greedy balance: within one row of each other
    # fixed-size plan: consecutive rows
    assert plan_micro_batches(lengths[:10], micro_batch_size=4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_balanced_partition_groups_are_never_empty():
    assert all(balanced_partition([5, 1, 1], 3))
    assert balanced_partition([3], 4) == [[0]]


def _agree_body(rank, world):
    # rank 0 has short rows (1 micro-batch would do), rank 1 long ones (needs 3): both run 3
    lengths = [10] * 6 if rank == 0 else [90] * 6
    plan = plan_micro_batches(lengths, micro_batch_size=2, max_tokens=200)
    assert len(plan) == 3, plan
    assert sorted(i for mb in plan for i in mb) == list(range(6))


def test_token_budget_micro_batch_count_is_agreed_across_ranks():
    run_distributed(_agree_body, 2)


def test_token_budget_logprobs_equal_fixed_size_logprobs(model_dir):
    from spmd_rl.model.loading import load_causal_lm
    from spmd_rl.train.actor import compute_logprobs

    batch = ragged_batch([3, 12, 7, 9, 2, 11, 5, 6])
    batch.tensors["response_mask"] = batch["attention_mask"].double()
    model = load_causal_lm(model_dir, torch.float64, remove_padding=True)
    cpu = torch.device("cpu")
    fixed = compute_logprobs(model, batch, 1.0, micro_batch_size=3, device=cpu)
    budget = compute_logprobs(model, batch, 1.0, micro_batch_size=3, device=cpu, max_tokens=16)
    torch.testing.assert_close(budget, fixed, rtol=0, atol=1e-6)  # both stored as float32


def test_token_budget_config_needs_remove_padding_and_room_for_the_longest_sequence():
    from spmd_rl.config.run_config import config_from_dict
    from spmd_rl.errors import ConfigError

    base = {"model": {"init": "random", "arch": "tiny", "tokenizer": "char"},
            "data": {"synthetic_task": "successor", "max_prompt_length": 100,
                     "max_response_length": 200}}
    cfg = config_from_dict({**base, "actor": {"max_token_len_per_gpu": 4096}})
    with pytest.raises(ConfigError, match="model.remove_padding = true"):
        preflight.validate(cfg)
    cfg = config_from_dict({**base, "model": {**base["model"], "remove_padding": True},
                            "actor": {"max_token_len_per_gpu": 200}})
    with pytest.raises(ConfigError, match="at least 300"):
        preflight.validate(cfg)
    cfg.actor.max_token_len_per_gpu = 300
    preflight.validate(cfg)


def saved_elements(forward):
    """(elements autograd saved for backward while `forward()` ran, its result)."""
    count = 0

    def pack(t):
        nonlocal count
        count += t.numel()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    return count, out


def test_gradient_checkpointing_really_saves_activations_and_dropout_is_off(tmp_path):
    """transformers checkpoints a layer only in train() mode, so apply_fsdp must put the model there
    (the switch silently did nothing before), with every dropout zeroed so the forward stays
    deterministic. Checked by what autograd saves for backward."""
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from spmd_rl.model.loading import apply_fsdp, load_causal_lm
    from spmd_rl.runtime.distributed import free_port
    from spmd_rl.train.actor import forward_logprobs

    torch.manual_seed(0)
    model_dir = str(tmp_path)  # a model whose config asks for attention dropout
    AutoModelForCausalLM.from_config(tiny_config(attention_dropout=0.5)).save_pretrained(model_dir)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        mb = ragged_batch([40, 64])
        saved = {}
        for gc_on in (False, True):
            model = apply_fsdp(load_causal_lm(model_dir, torch.float64, remove_padding=True), mesh, torch.float64,
                               gradient_checkpointing=gc_on)
            saved[gc_on], (logp, _) = saved_elements(lambda: forward_logprobs(model, mb, 1.0))
            again, _ = forward_logprobs(model, mb, 1.0)
            torch.testing.assert_close(again, logp, rtol=0, atol=0)  # deterministic in train() mode
            assert model.training == gc_on
            assert all(layer.self_attn.attention_dropout == 0.0 for layer in model.model.layers)
        assert saved[True] < 0.5 * saved[False], saved
    finally:
        dist.destroy_process_group()


def test_a_share_of_checkpointed_layers_saves_in_proportion_with_the_same_gradients(tmp_path):
    """model.gradient_checkpointing_layers: with 2 of 4 layers checkpointed, autograd keeps half of
    what checkpointing all 4 saves over keeping every layer's activations; the log-probs and every
    gradient are those of no checkpointing (float64)."""
    from spmd_rl.model.loading import checkpointed_layers, decoder_layers, load_causal_lm, set_gradient_checkpointing
    from spmd_rl.train.actor import forward_logprobs

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config(num_hidden_layers=4)).save_pretrained(tmp_path)
    mb = ragged_batch([40, 64])
    saved, results = {}, {}
    for share in (0.0, 0.5, 1.0):
        model = load_causal_lm(str(tmp_path), torch.float64, remove_padding=True)
        set_gradient_checkpointing(model, share)
        assert [layer.gradient_checkpointing for layer in decoder_layers(model)].count(True) == int(4 * share)
        saved[share], (logp, _) = saved_elements(lambda: forward_logprobs(model, mb, 1.0))
        logp.sum().backward()
        results[share] = (logp.detach(), param_grads(model))
    assert saved[1.0] < saved[0.5] < saved[0.0], saved
    half = (saved[0.0] - saved[1.0]) / 2
    assert abs((saved[0.5] - saved[1.0]) - half) <= 0.05 * half, saved
    for share in (0.5, 1.0):
        torch.testing.assert_close(results[share][0], results[0.0][0], rtol=0, atol=0)
        for n, g in results[0.0][1].items():
            torch.testing.assert_close(results[share][1][n], g, rtol=0, atol=1e-12, msg=f"{share} {n}")
    assert checkpointed_layers(28, 0.5) == list(range(1, 28, 2))
    assert checkpointed_layers(28, 1.0) == list(range(28)) and checkpointed_layers(3, 0.01) == [1]
    assert checkpointed_layers(24, 0.25) == [2, 6, 10, 14, 18, 22]
    with pytest.raises(ValueError, match="must be in"):
        checkpointed_layers(4, 1.5)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_packed_rows_equal_padded_for_other_model_families(family):
    """The packed path hands transformers an empty 4-D mask (packing.empty_mask), which each model
    family must take as made: Llama and Qwen3 shapes give the padded path's log-probs (float64)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    from spmd_rl.model.loading import prepare_policy
    from spmd_rl.train.actor import forward_logprobs

    cls, config_cls = {"llama": (LlamaForCausalLM, LlamaConfig), "qwen3": (Qwen3ForCausalLM, Qwen3Config)}[family]
    config = config_cls(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    padded = cls(config).double()
    packed = cls(config).double()
    packed.load_state_dict(padded.state_dict())
    prepare_policy(padded, remove_padding=False, chunked_logprobs=False)
    prepare_policy(packed, remove_padding=True, chunked_logprobs=True)
    mb = ragged_batch([5, 11, 2, 8])
    keep = mb["attention_mask"].bool()
    keep[:, 0] = False
    want, _ = forward_logprobs(padded, mb, 1.0)
    got, _ = forward_logprobs(packed, mb.to("cpu"), 1.0)  # through Batch.to: the host's copy of the mask
    torch.testing.assert_close(got[keep], want[keep], rtol=0, atol=1e-12)
