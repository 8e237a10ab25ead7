"""The fused-kernel switches on a GPU, at the Qwen2-0.5B shape (random weights): each of
model.fused_kernels = "liger" / "compile" and model.fused_logprob_head = "compile" (and liger with
the compiled head, with gradient checkpointing as the 1.5B and 7B presets run) against the
unfused path, all on packed ragged rows through the varlen attention kernel, on an FSDP2 actor as
the trainer builds it (fp32 masters, bf16 compute, a world of one). bf16 cannot be compared bit for bit, so, as in test_packing_gpu.py, every path is
compared with a float32 reference: a fused path must be as close to it as the unfused bf16 path
is; gradients (log-probs plus an entropy bonus) must point the same way (cosine > 0.99) with the
same norm (within 2%). The compiled variants also run a second batch of other lengths and must
not compile again. liger-kernel must be importable here (the GPU check installs the wheel):
without it the test fails, it does not skip."""

from __future__ import annotations

import time

import pytest
import torch
from test_packing_gpu import ragged_batch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

VARIANTS = [("liger", "none", False), ("compile", "none", False), ("none", "compile", False), ("liger", "compile", True)]


def _grads(model) -> torch.Tensor:
    return torch.cat([(p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).float().flatten()
                      for p in model.parameters()])


def test_fused_kernels_match_the_unfused_path_on_gpu(env):
    import liger_kernel  # noqa: F401  -- must be installed on a GPU machine: an ImportError fails the test
    from transformers import AutoModelForCausalLM

    from spmd_rl.model import fused_kernels
    from spmd_rl.model.loading import apply_fsdp, prepare_policy, random_model_config
    from spmd_rl.train.actor import forward_logprobs

    dev = env.device
    config = random_model_config("qwen2-0.5b")
    torch.manual_seed(0)
    with dev:
        ref = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    state = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    mb = ragged_batch([130, 517, 64, 300, 611, 12, 450, 233], config.vocab_size, dev)
    other = ragged_batch([401, 77, 250, 19, 333, 129, 500], config.vocab_size, dev, seed=1)  # other lengths, other count
    keep = mb["attention_mask"].bool()
    keep[:, 0] = False
    prepare_policy(ref, remove_padding=False, chunked_logprobs=False)
    with torch.no_grad():
        want, want_ent = forward_logprobs(ref, mb, 0.7, with_entropy=True)
    del ref
    torch.cuda.empty_cache()

    def loss(model, batch):
        logp, ent = forward_logprobs(model, batch, 0.7, with_entropy=True, entropy_grad=True)
        return logp, ent, logp[keep].sum() + 0.1 * ent[keep].sum() if batch is mb else logp.sum() + 0.1 * ent.sum()

    results, grads, recompiles, seconds = {}, {}, {}, {}
    for kernels, head, gc_on in [("none", "none", False)] + VARIANTS:
        name = f"kernels={kernels},head={head}" + (",checkpointing" if gc_on else "")
        with dev:
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
        model.load_state_dict(state)
        model = prepare_policy(model, remove_padding=True, chunked_logprobs=True, fused_kernels=kernels,
                               fused_logprob_head=head)
        assert fused_kernels.active_mode(model) == kernels, f"{name}: fell back to {fused_kernels.active_mode(model)}"
        # as the trainer: fused kernels applied before sharding
        model = apply_fsdp(model, env.mesh, torch.bfloat16, gradient_checkpointing=gc_on)
        t = time.perf_counter()
        logp, ent, total = loss(model, mb)
        total.backward()
        torch.cuda.synchronize()
        seconds[name] = time.perf_counter() - t
        results[name] = ((logp.detach() - want)[keep].abs(), (ent.detach() - want_ent)[keep].abs())
        grads[name] = _grads(model)
        if "compile" in (kernels, head):  # a micro-batch of other lengths: the graphs are reused
            graphs = fused_kernels.compiled_graphs()
            model.zero_grad(set_to_none=True)
            loss(model, other)[2].backward()
            recompiles[name] = fused_kernels.compiled_graphs() - graphs
        del model
        torch.cuda.empty_cache()

    base_name = "kernels=none,head=none"
    base_d, base_de = results[base_name]
    for name, (d, de) in results.items():
        print(f"{name}: |logp - fp32| mean {d.mean():.4f} max {d.max():.3f}; |entropy - fp32| mean {de.mean():.4f}; "
              f"first forward+backward {seconds[name]:.1f} s")
    for name, (d, de) in results.items():
        if name == base_name:
            continue
        cos = torch.nn.functional.cosine_similarity(grads[name], grads[base_name], dim=0).item()
        rel = (grads[name].norm() / grads[base_name].norm()).item()
        print(f"{name}: gradient cosine vs unfused {cos:.5f}, norm ratio {rel:.4f}, "
              f"graphs compiled for a second batch {recompiles.get(name, 0)}")
        assert d.mean() < 1.5 * base_d.mean() + 1e-3, (name, d.mean(), base_d.mean())
        assert d.max() < 2 * base_d.max() + 0.05, (name, d.max(), base_d.max())
        assert de.mean() < 1.5 * base_de.mean() + 1e-3, (name, de.mean(), base_de.mean())
        assert cos > 0.99 and abs(rel - 1) < 0.02, (name, cos, rel)
    assert not any(recompiles.values()), f"compiled again for a batch of other lengths: {recompiles}"


def test_head_weight_gradient_accumulates_in_one_float32_addmm_per_chunk_on_gpu():
    """On CUDA the head adds each chunk's weight gradient into its float32 buffer with one addmm
    (`out_dtype` float32: spmd_rl.model.logprob_head._accumulate), eager and compiled head alike, and
    the gradient is as close to the float64 formula as the CPU's matmul-and-add path gets
    (tests/batching/test_packing.py)."""
    from spmd_rl.model import logprob_head
    from tests.batching.test_packing import head_weight_grad_error

    for fused in ("none", "compile"):
        err = head_weight_grad_error("cuda", fused)
        print(f"head={fused}: weight gradient vs float64, relative error {err:.5f}")
        assert err < 1.5e-2, (fused, err)
    assert logprob_head._FUSED_ACCUMULATE == {(torch.device("cuda", 0), torch.bfloat16, torch.float32): True}, \
        logprob_head._FUSED_ACCUMULATE
