"""The packed path on a GPU, at a real size (Qwen2-0.5B and 1.5B shapes, random weights): PyTorch's
varlen FlashAttention kernel + chunked log-probs against the padded sdpa + full-logits path, and
both against a float32 padded reference. bf16 cannot be compared bit for bit, so the packed path
must be as close to the float32 reference as the padded bf16 path is."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def ragged_batch(lens, vocab, device, seed=0):
    """Rows of the given lengths (random ids, padded on the right) on `device` (also test_fused_gpu's)."""
    g = torch.Generator().manual_seed(seed)
    L = max(lens)
    ids = torch.randint(0, vocab, (len(lens), L), generator=g)
    attn = torch.zeros(len(lens), L, dtype=torch.long)
    for i, n in enumerate(lens):
        attn[i, :n] = 1
    from spmd_rl.batching.batch import Batch

    return Batch({"input_ids": (ids * attn).to(device), "attention_mask": attn.to(device)})


@pytest.mark.parametrize("arch", ["qwen2-0.5b", "qwen2-1.5b"])
def test_packed_varlen_matches_padded_on_gpu(arch):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from transformers import AutoModelForCausalLM

    from spmd_rl.model.loading import prepare_policy, random_model_config
    from spmd_rl.train.actor import forward_logprobs

    dev = torch.device("cuda")
    config = random_model_config(arch)
    torch.manual_seed(0)
    with dev:  # random init on the GPU: seconds instead of a minute on the CPU for 1.5B
        ref = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    state = ref.state_dict()
    mb = ragged_batch([130, 517, 64, 300, 611, 12, 450, 233], config.vocab_size, dev)
    keep = mb["attention_mask"].bool()
    keep[:, 0] = False
    prepare_policy(ref, remove_padding=False, chunked_logprobs=False)
    with torch.no_grad():
        want, want_ent = forward_logprobs(ref, mb, 1.0, with_entropy=True)
    del ref
    results, grads = {}, {}
    for name, packed, chunked in (("padded", False, False), ("packed", True, True)):
        with dev:
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
        model.load_state_dict(state)
        model = prepare_policy(model, remove_padding=packed, chunked_logprobs=chunked)
        logp, ent = forward_logprobs(model, mb, 1.0, with_entropy=True)
        logp[keep].sum().backward()
        results[name] = ((logp - want)[keep].abs(), (ent - want_ent)[keep].abs())
        grads[name] = torch.cat([p.grad.float().flatten() for p in model.parameters()])
        del model
        torch.cuda.empty_cache()
    for name, (d, de) in results.items():
        print(f"{arch} {name}: |logp - fp32| mean {d.mean():.4f} max {d.max():.3f}; |entropy - fp32| mean {de.mean():.4f}")
    pad, pack = results["padded"][0], results["packed"][0]
    assert pack.mean() < 1.5 * pad.mean() + 1e-3, (pack.mean(), pad.mean())
    assert pack.max() < 2 * pad.max() + 0.05
    assert results["packed"][1].mean() < 1.5 * results["padded"][1].mean() + 1e-3
    cos = torch.nn.functional.cosine_similarity(grads["packed"], grads["padded"], dim=0)
    rel = (grads["packed"].norm() / grads["padded"].norm()).item()
    print(f"{arch} gradient cosine packed vs padded {cos:.5f}, norm ratio {rel:.4f}")
    assert cos > 0.99 and abs(rel - 1) < 0.02


def test_varlen_kernel_applies_sliding_windows_as_the_cpu_reference():
    """Gemma 3's sliding-window layers on CUDA: torch's varlen kernel given window_size = (W - 1, 0)
    against the CPU path's per-sequence attention with transformers' window mask (the CPU tests'
    reference: tests/model/test_model_families.py), float32 inputs in bf16 compute."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from spmd_rl.model import varlen_attention

    if not varlen_attention.kernel_takes_windows():
        pytest.skip(f"torch {torch.__version__}'s varlen_attn takes no window_size: such models are refused")
    varlen_attention.register()
    g = torch.Generator().manual_seed(0)
    lens = [700, 64, 513, 1030]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    q, k, v = (torch.randn(sum(lens), h, 64, generator=g).to(torch.bfloat16) for h in (8, 2, 2))
    for window in (512, 4096):  # shorter and longer than the rows
        got = varlen_attention._cuda_varlen(q.cuda(), k.cuda(), v.cuda(), cu.cuda(), max(lens), 0.125, window)
        want = varlen_attention._sdpa_per_sequence(q.float(), k.float(), v.float(), cu, 0.125, window)
        err = (got.float().cpu() - want).abs()
        print(f"window {window}: |varlen - reference| mean {err.mean():.2e} max {err.max():.2e}")
        assert err.max() < 2e-2, window
