"""LoRA on the FSDP2 actor (spmd_rl/model/lora.py): the forward is PEFT's own, gradients and
optimizer state are the adapter's alone, the base stays frozen in its dtype, rank 1 works, and
the reference is the actor with its adapter disabled."""

import functools

import pytest
import torch

from tests.helpers.dist_utils import full, run_distributed

pytest.importorskip("peft")

WORLD = 2


def tiny_dir(tmp_path):
    from spmd_rl.model.loading import materialize_random_model, random_model_config

    return materialize_random_model(str(tmp_path / "tiny"), random_model_config("tiny"), 0, torch.float32)


def sharded_lora(path, rank, base_dtype, compute_dtype, targets=()):
    """The actor as build.build_models makes it with LoRA: rank 0 reads the base, the adapter is drawn
    there and broadcast."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from spmd_rl.model.loading import build_sharded, load_causal_lm
    from spmd_rl.model.lora import LoraSettings

    settings = LoraSettings(rank, 16.0, tuple(targets), torch.float32)
    load = functools.partial(load_causal_lm, path, base_dtype, lora=settings)
    return build_sharded(load, init_device_mesh("cpu", (dist.get_world_size(),)), compute_dtype, False), settings


def logprobs(model, ids):
    return model(input_ids=ids, logprob_targets=torch.roll(ids, -1, 1), temperature=1.0)[0]


def peft_twin(path, settings, seed):
    """PEFT's own model of the same base, its B drawn non-zero (every rank the same)."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from spmd_rl.model.lora import lora_config

    twin = get_peft_model(base := AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                          lora_config(settings, base))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in twin.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return twin.eval()


def _forward_body(rank, world, path):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from spmd_rl.model.lora import adapter_disabled

    model, settings = sharded_lora(path, 4, torch.float32, torch.float32)
    twin = peft_twin(path, settings, seed=1)
    adapter = {n.removeprefix("base_model.model."): p.detach() for n, p in twin.named_parameters() if "lora_" in n}
    set_model_state_dict(model, adapter, options=StateDictOptions(full_state_dict=True, strict=False))
    ids = torch.randint(0, 60, (3, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours = logprobs(model, ids)
        theirs = torch.log_softmax(twin(input_ids=ids).logits.float(), -1).gather(-1, torch.roll(ids, -1, 1)[..., None])[..., 0]
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
        with adapter_disabled(model) as ref, twin.disable_adapter():
            base_ours = logprobs(ref, ids)
            base_theirs = torch.log_softmax(twin(input_ids=ids).logits.float(), -1).gather(
                -1, torch.roll(ids, -1, 1)[..., None])[..., 0]
        torch.testing.assert_close(base_ours, base_theirs, atol=1e-5, rtol=1e-5)
        assert (ours - base_ours).abs().max() > 1e-2  # the adapter does change the policy
        torch.testing.assert_close(logprobs(model, ids), ours)  # and is on again after the reference pass


def test_lora_forward_equals_peft_and_reference_is_the_adapter_disabled(tmp_path):
    run_distributed(_forward_body, WORLD, tiny_dir(tmp_path))


def adapter_and_base(model):
    """The LoRA actor's parameters by name: the adapter's, and the frozen base's."""
    params = dict(model.named_parameters())
    return ({n: p for n, p in params.items() if ".lora_" in n}, {n: p for n, p in params.items() if ".lora_" not in n})


def _two_adapter_steps(model, rank):
    """A step's reference pass (the adapter disabled), then two AdamW steps: only the adapter gets gradients
    (B at each step; A from the second, as B starts at 0) and the frozen base stays as it was. Returns the
    optimizer, the input ids and the reference pass's log-probs."""
    from spmd_rl.model.lora import adapter_disabled
    from spmd_rl.train.optim import make_optimizer

    adapter, base = adapter_and_base(model)
    before = {n: full(p).clone() for n, p in base.items()}
    opt = make_optimizer(model, 1e-2, 0.0)
    ids = torch.randint(0, 60, (2, 9), generator=torch.Generator().manual_seed(rank))
    with torch.no_grad(), adapter_disabled(model) as ref:  # a step's reference pass comes before its update
        reference = logprobs(ref, ids)
    for _ in range(2):
        logprobs(model, ids).mean().backward()
        assert all(p.grad is None for p in base.values())
        assert all(p.grad is not None for n, p in adapter.items() if "lora_B" in n)
        opt.step()
        opt.zero_grad()
    assert all(p.grad is None for p in base.values())
    assert all(torch.equal(before[n], full(p)) for n, p in base.items())
    return opt, ids, reference


def _train_body(rank, world, path, lora_rank, base_dtype, compute_dtype):
    model, _ = sharded_lora(path, lora_rank, base_dtype, compute_dtype)
    adapter, base = adapter_and_base(model)
    assert len(adapter) == 2 * 7 * 2  # A and B of 7 linear layers in each of 2 decoder layers
    assert all(p.requires_grad and p.dtype == torch.float32 for p in adapter.values())
    assert all(not p.requires_grad and p.dtype == base_dtype for p in base.values())
    assert {p.shape[0] for n, p in adapter.items() if "lora_A" in n} == {lora_rank}
    # FSDP2 shards the adapter; on one rank the frozen base in the compute dtype stays out of it, a plain
    # tensor (frozen_kept_whole), and one in another dtype in it (FSDP2 casts it at each unshard)
    assert all(hasattr(p, "full_tensor") for p in adapter.values())
    assert all(hasattr(p, "full_tensor") == (world > 1 or base_dtype != compute_dtype) for p in base.values())
    opt, _, _ = _two_adapter_steps(model, rank)
    moved = [n for n, p in adapter.items() if "lora_A" in n and p.full_tensor().abs().sum() > 0]
    assert len(moved) == len(adapter) // 2
    state = [s for p in opt.state.values() for s in (p["exp_avg"], p["exp_avg_sq"])]
    assert sum(s.numel() for s in state) == 2 * sum(p.numel() for p in adapter.values())  # full sizes
    assert all(s.dtype == torch.float32 for s in state)
    assert set(opt.state) == set(adapter.values())


def _train_cases(rank, world, path):
    _train_body(rank, world, path, 8, torch.bfloat16, torch.bfloat16)  # GPU-like: base bf16 (no fp32 copy), adapter fp32
    _train_body(rank, world, path, 1, torch.float32, torch.float32)  # CPU-like, and rank 1


@pytest.mark.parametrize("world", [1, WORLD])
def test_lora_trains_the_adapter_alone(tmp_path, world):
    run_distributed(_train_cases, world, tiny_dir(tmp_path))


def _mixture_train_body(rank, world, path):
    """LoRA on a mixture of experts in bf16 (the GPU's dtypes): its attention adapted, the fused experts and
    router frozen with the rest of the base; on one rank all of the base stays out of FSDP2."""
    model, _ = sharded_lora(path, 4, torch.bfloat16, torch.bfloat16)
    adapter, base = adapter_and_base(model)
    assert {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in adapter} == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert any(".mlp.experts." in n for n in base) and not any(".mlp." in n for n in adapter)
    assert all(hasattr(p, "full_tensor") == (world > 1) for p in base.values())
    _, ids, reference = _two_adapter_steps(model, rank)
    assert all(full(p).abs().sum() > 0 for n, p in adapter.items() if "lora_A" in n)
    with torch.no_grad():
        assert (logprobs(model, ids) - reference).abs().max() > 1e-3  # the trained adapter moves the policy


@pytest.mark.parametrize("world", [1, WORLD])
def test_lora_on_a_mixture_of_experts_trains_its_attention_adapter(tmp_path, world):
    from spmd_rl.model.loading import materialize_random_model, random_model_config

    path = materialize_random_model(str(tmp_path / "moe"), random_model_config("qwen3-moe-tiny"), 0, torch.float32)
    run_distributed(_mixture_train_body, world, path)


def _save_body(rank, world, path, ckpt_root, out_file, compute_dtype):
    """Train the adapter a step on `world` ranks and checkpoint it; rank 0 writes the full adapter and
    optimizer moments it saved."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from spmd_rl.checkpoint.checkpointer import Checkpointer, ModelAndOptimizer
    from spmd_rl.train.optim import make_optimizer

    torch.manual_seed(0)
    model, _ = sharded_lora(path, 4, torch.bfloat16, compute_dtype)
    opt = make_optimizer(model, 1e-2, 0.0)
    for _ in range(2):
        logprobs(model, torch.randint(0, 60, (2, 9), generator=torch.Generator().manual_seed(rank))).mean().backward()
        opt.step()
        opt.zero_grad()
    ck = Checkpointer(ckpt_root, keep_last=1, async_save=False)
    ck.save(2, {"actor": ModelAndOptimizer(model, opt, trainable_only=True)}, {"step": 2})
    ck.wait()
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    moments = {n: opt.state[p]["exp_avg"].full_tensor() for n, p in model.named_parameters() if p.requires_grad}
    if rank == 0:
        torch.save({"model": full, "exp_avg": moments}, out_file)


def _resume_body(rank, world, path, ckpt_root, saved_file, compute_dtype):
    """A fresh actor (base from the files, another random adapter) on `world` ranks resumes the adapter
    and its optimizer; the checkpoint holds no base tensor."""
    import torch.distributed.checkpoint as dcp

    from spmd_rl.checkpoint.checkpointer import Checkpointer, ModelAndOptimizer
    from spmd_rl.train.optim import make_optimizer

    torch.manual_seed(123)  # another adapter A than the saved run's
    model, _ = sharded_lora(path, 4, torch.bfloat16, compute_dtype)
    opt = make_optimizer(model, 1e-2, 0.0)
    ck = Checkpointer(ckpt_root, keep_last=1, async_save=False)
    assert ck.load(ck.find_resume("auto"), {"actor": ModelAndOptimizer(model, opt, trainable_only=True)}) == {"step": 2}
    saved = torch.load(saved_file)
    for name, p in model.named_parameters():
        assert torch.equal(full(p), saved["model"][name]), name  # base from the files, adapter resumed
        if p.requires_grad:
            assert torch.equal(opt.state[p]["exp_avg"].full_tensor(), saved["exp_avg"][name]), name
    keys = dcp.FileSystemReader(ck.latest()).read_metadata().state_dict_metadata
    model_keys = [k for k in keys if k.startswith("actor.model.")]
    assert model_keys and all(".lora_" in k for k in model_keys), model_keys


@pytest.mark.parametrize("saved_on,resumed_on,compute_dtype", [(2, 3, torch.float32), (1, 2, torch.bfloat16),
                                                                (2, 1, torch.bfloat16)])
def test_lora_checkpoint_holds_the_adapter_and_resumes_on_another_world_size(tmp_path, saved_on, resumed_on,
                                                                              compute_dtype):
    """One rank keeps a frozen base in the compute dtype out of FSDP2 (plain tensors), more ranks shard
    it: the adapter travels between them either way."""
    path = tiny_dir(tmp_path)
    root, saved = str(tmp_path / "ckpt"), str(tmp_path / "saved.pt")
    run_distributed(_save_body, saved_on, path, root, saved, compute_dtype)
    run_distributed(_resume_body, resumed_on, path, root, saved, compute_dtype)


@pytest.mark.parametrize("lora", [False, True])
def test_update_flops_per_token_counts_what_torch_counts(lora):
    """perf/mfu_update_actor's FLOPs (model.loading.update_flops_per_token: 6N in full, 4N + 2 x the adapter
    with LoRA, whose frozen base gets no weight gradient) against torch's FlopCounterMode over a forward and
    backward of linear layers, PEFT's LoRA on each (the input requires grad, as a decoder layer's does)."""
    from peft import LoraConfig, inject_adapter_in_model
    from torch.utils.flop_counter import FlopCounterMode

    from spmd_rl.model.loading import count_parameters, update_flops_per_token

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 48 if i % 2 == 0 else 64, bias=False) if i % 2 == 0 else
                                  torch.nn.Linear(48, 64, bias=False) for i in range(4)])
    if lora:
        inject_adapter_in_model(LoraConfig(r=4, target_modules=["0", "1", "2", "3"]), model)
        for name, p in model.named_parameters():
            p.requires_grad_(".lora_" in name)
    tokens = 10
    x = torch.randn(tokens, 64, requires_grad=True)
    with FlopCounterMode(display=False) as counter:
        model(x).sum().backward()
    n, trained = count_parameters(model), count_parameters(model, trained_only=True)
    assert (trained < n) == lora
    assert counter.get_total_flops() == update_flops_per_token(n, trained) * tokens
