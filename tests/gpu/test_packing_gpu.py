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
    from spmd_rl.model.loading import random_model_config

    dev = torch.device("cuda")
    config = random_model_config(arch)
    mb = ragged_batch([130, 517, 64, 300, 611, 12, 450, 233], config.vocab_size, dev)
    keep = mb["attention_mask"].bool()
    keep[:, 0] = False
    close_to_fp32_as_padded(config, mb, keep, arch, dict(remove_padding=True, chunked_logprobs=True))


def close_to_fp32_as_padded(config, mb, keep, label: str, variant: dict) -> None:
    """Log-probs and entropy of a bf16 model prepared with `variant` (prepare_policy's arguments) as close
    to a float32 padded reference as the bf16 padded path's, and the same gradients (cosine, norm)."""
    from transformers import AutoModelForCausalLM

    from spmd_rl.model.loading import prepare_policy
    from spmd_rl.train.actor import forward_logprobs

    dev = torch.device("cuda")
    torch.manual_seed(0)
    with dev:  # random init on the GPU: seconds instead of a minute on the CPU for 1.5B
        ref = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    state = ref.state_dict()
    prepare_policy(ref, remove_padding=False, chunked_logprobs=False)
    with torch.no_grad():
        want, want_ent = forward_logprobs(ref, mb, 1.0, with_entropy=True)
    del ref
    results, grads = {}, {}
    for name, kwargs in (("padded", dict(remove_padding=False, chunked_logprobs=False)), ("variant", variant)):
        with dev:
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
        model.load_state_dict(state)
        model = prepare_policy(model, **kwargs)
        logp, ent = forward_logprobs(model, mb, 1.0, with_entropy=True)
        logp[keep].sum().backward()
        results[name] = ((logp - want)[keep].abs(), (ent - want_ent)[keep].abs())
        grads[name] = torch.cat([p.grad.float().flatten() for p in model.parameters()])
        del model
        torch.cuda.empty_cache()
    for name, (d, de) in results.items():
        print(f"{label} {name}: |logp - fp32| mean {d.mean():.4f} max {d.max():.3f}; |entropy - fp32| mean {de.mean():.4f}")
    pad, got = results["padded"][0], results["variant"][0]
    assert got.mean() < 1.5 * pad.mean() + 1e-3, (got.mean(), pad.mean())
    assert got.max() < 2 * pad.max() + 0.05
    assert results["variant"][1].mean() < 1.5 * results["padded"][1].mean() + 1e-3
    cos = torch.nn.functional.cosine_similarity(grads["variant"], grads["padded"], dim=0)
    rel = (grads["variant"].norm() / grads["padded"].norm()).item()
    print(f"{label} gradient cosine against padded {cos:.5f}, norm ratio {rel:.4f}")
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


def test_varlen_kernel_with_more_keys_than_queries_aligns_them_at_the_bottom_right():
    """Shared prompts (spmd_rl.batching.shared_prompts) give a response's queries its prompt's keys and its own:
    torch's varlen kernel with cu_seq_lens_k != cu_seq_lens_q, forward and backward, against the CPU
    path's per-sequence attention with its explicit bottom-right causal mask (float32), with and
    without a sliding window that reaches back into the prompt."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from spmd_rl.model import varlen_attention

    varlen_attention.register()
    g = torch.Generator().manual_seed(0)
    q_lens, k_lens = [300, 517, 64, 300, 12], [300, 817, 364, 300, 312]  # a prompt of 300, then responses
    cu_q, cu_k = (torch.tensor([0] + torch.tensor(x).cumsum(0).tolist(), dtype=torch.int32) for x in (q_lens, k_lens))
    q = torch.randn(sum(q_lens), 8, 64, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(sum(k_lens), 2, 64, generator=g).to(torch.bfloat16) for _ in range(2))
    w = torch.randn(sum(q_lens), 8, 64, generator=g)
    windows = (None, 256) if varlen_attention.kernel_takes_windows() else (None,)
    for window in windows:
        xs = [x.cuda().requires_grad_() for x in (q, k, v)]
        got = varlen_attention._cuda_varlen(*xs, cu_q.cuda(), max(q_lens), 0.125, window, cu_k.cuda(), max(k_lens))
        got_grads = torch.autograd.grad((got.float() * w.cuda()).sum(), xs)
        ref = [x.float().requires_grad_() for x in (q, k, v)]
        want = varlen_attention._sdpa_per_sequence(*ref, cu_q, 0.125, window, cu_k)
        want_grads = torch.autograd.grad((want * w).sum(), ref)
        err = (got.float().cpu() - want).abs()
        print(f"window {window}: |varlen - reference| mean {err.mean():.2e} max {err.max():.2e}")
        assert err.max() < 2e-2, window
        for name, a, b in zip("qkv", got_grads, want_grads):
            rel = ((a.float().cpu() - b).norm() / b.norm()).item()
            print(f"window {window}: d{name} relative error {rel:.2e}")
            assert rel < 2e-2, (window, name)


@pytest.mark.parametrize("fused", ["none", "compile"])
def test_shared_prompts_match_the_padded_path_on_gpu(fused):
    """model.share_prompts at the Qwen2-0.5B shape (random weights), 3 prompts x 8 responses: log-probs
    and entropy as close to a float32 padded reference as the padded bf16 path, the same gradients
    (cosine, norm), eager and with compiled decoder layers."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from spmd_rl.batching.batch import Batch
    from spmd_rl.model.loading import random_model_config

    dev = torch.device("cuda")
    config = random_model_config("qwen2-0.5b")
    g = torch.Generator().manual_seed(0)
    rows, prompt_lens = [], []
    for p in (120, 300, 57):
        prompt = torch.randint(0, config.vocab_size, (p,), generator=g)
        for n in torch.randint(1, 500, (8,), generator=g).tolist():
            rows.append(torch.cat([prompt, torch.randint(0, config.vocab_size, (n,), generator=g)]))
            prompt_lens.append(p)
    L = max(len(r) for r in rows)
    ids, attn, resp = (torch.zeros(len(rows), L, dtype=t) for t in (torch.long, torch.long, torch.float32))
    for i, (r, p) in enumerate(zip(rows, prompt_lens)):
        ids[i, :len(r)], attn[i, :len(r)], resp[i, p:len(r)] = r, 1, 1.0
    mb = Batch({"input_ids": ids, "attention_mask": attn, "response_mask": resp,
                "prompt_lens": torch.tensor(prompt_lens)}).to(dev)
    close_to_fp32_as_padded(config, mb, mb["response_mask"].bool(), f"shared prompts, {fused}",
                            dict(remove_padding=True, chunked_logprobs=True, share_prompts=True, fused_kernels=fused))
