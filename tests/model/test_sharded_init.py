"""Models built without a full copy per rank (models.build_sharded) equal the per-rank
from_pretrained models they replace: every parameter and buffer bitwise (the rotary inv_freq,
which no state dict holds, included), tied embeddings still one Parameter, the same log-probs.
Only rank 0 reads weights on a fresh start, no rank on a resume; the trainer builds that way."""

from __future__ import annotations

import functools
import os

import pytest
import torch
from torch.distributed.fsdp import FSDPModule
from transformers import AutoModelForCausalLM, Qwen2Config

from tests.helpers import ROOT
from tests.helpers.dist_utils import run_distributed


def tiny_config(tied: bool) -> Qwen2Config:
    # the untied one also has a non-default rope, whose inv_freq differs from the plain formula's
    rope = {} if tied else {"rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 5000.0}}
    return Qwen2Config(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, tie_word_embeddings=tied, **rope)


def count_weight_loads() -> list[str]:
    """Record every from_pretrained that reads weights, in this process (Auto classes end there)."""
    from transformers import PreTrainedModel

    calls: list[str] = []
    original = PreTrainedModel.from_pretrained.__func__

    def counting(cls, *args, **kwargs):
        calls.append(cls.__name__)
        return original(cls, *args, **kwargs)

    PreTrainedModel.from_pretrained = classmethod(counting)
    return calls


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def assert_same_model(got, want, what: str) -> None:
    """Parameters and buffers (non-persistent ones too) bitwise, tying and train/eval flags."""
    got_p, want_p = dict(got.named_parameters()), dict(want.named_parameters())
    assert got_p.keys() == want_p.keys(), what
    for name, p in want_p.items():
        assert got_p[name].dtype == p.dtype, (what, name)
        assert torch.equal(local(got_p[name]), local(p)), (what, name)
    got_b, want_b = dict(got.named_buffers()), dict(want.named_buffers())
    assert got_b.keys() == want_b.keys() and want_b, what
    for name, b in want_b.items():
        assert torch.equal(got_b[name], b), (what, name)
    for model in (got, want):
        if model.config.tie_word_embeddings and hasattr(model, "lm_head"):
            assert model.lm_head.weight is model.model.embed_tokens.weight, what
    assert [m.training for m in got.modules()] == [m.training for m in want.modules()], what


def ragged_batch():
    from spmd_rl.batching.batch import Batch

    lens = [5, 11, 3, 8]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 97, (len(lens), max(lens)), generator=g)
    attn = (torch.arange(max(lens))[None] < torch.tensor(lens)[:, None]).long()
    return Batch({"input_ids": ids * attn, "attention_mask": attn})


def forward(model, value: bool) -> torch.Tensor:
    """The critic's values, or the policy's token log-probs at temperature 0.7."""
    from spmd_rl.train.actor import forward_logprobs
    from spmd_rl.train.critic import forward_values

    return forward_values(model, ragged_batch()) if value else forward_logprobs(model, ragged_batch(), 0.7)[0]


def outputs(model, value: bool) -> torch.Tensor:
    with torch.no_grad():
        out = forward(model, value)
    if isinstance(model, FSDPModule):
        model.reshard()  # FSDP keeps the root's parameters gathered after a forward without backward
    return out


def train_once(model, value: bool):
    """One AdamW step, so the checkpoint differs from the model directory and holds Adam moments."""
    from spmd_rl.train.optim import make_optimizer

    opt = make_optimizer(model, 1e-2, 0.0)
    forward(model, value).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    return opt


def _build_paths(rank, world, dirs, ckpt_root):
    from torch.distributed.device_mesh import init_device_mesh

    from spmd_rl.checkpoint.checkpointer import Checkpointer, ModelAndOptimizer
    from spmd_rl.model.loading import apply_fsdp, build_sharded, load_causal_lm, load_value_model
    from spmd_rl.train.optim import make_optimizer

    mesh = init_device_mesh("cpu", (world,))
    calls = count_weight_loads()
    cases = [(f"actor tied={tied}", functools.partial(load_causal_lm, d, torch.float32), False)
             for tied, d in dirs.items()]
    cases += [("reference bf16", functools.partial(load_causal_lm, dirs[True], torch.bfloat16, remove_padding=True), False),
              ("critic", functools.partial(load_value_model, dirs[False], torch.float32), True)]
    for i, (what, load, value) in enumerate(cases):
        per_rank = apply_fsdp(load(), mesh, torch.float32)  # what every rank did before
        reads = [calls[-1]] if rank == 0 else []  # the class from_pretrained built, once, on rank 0
        del calls[:]
        fresh = build_sharded(load, mesh, torch.float32, from_checkpoint=False)
        assert calls == reads, (what, rank, calls)
        assert_same_model(fresh, per_rank, what + ", rank 0's weights broadcast")
        assert torch.equal(outputs(fresh, value), outputs(per_rank, value)), what
        if what == "reference bf16":
            continue  # never checkpointed

        opt = train_once(per_rank, value)
        ck = Checkpointer(os.path.join(ckpt_root, str(i)), keep_last=1)
        path = ck.save(1, {"m": ModelAndOptimizer(per_rank, opt)}, {"step": 1})
        resumed = build_sharded(load, mesh, torch.float32, from_checkpoint=True)
        assert calls == reads, (what, rank, calls)  # none more
        resumed_opt = make_optimizer(resumed, 1e-2, 0.0)
        assert ck.load(path, {"m": ModelAndOptimizer(resumed, resumed_opt)}) == {"step": 1}
        assert_same_model(resumed, per_rank, what + ", resumed from its checkpoint")
        assert torch.equal(outputs(resumed, value), outputs(per_rank, value)), what
        for p, q in zip(resumed.parameters(), per_rank.parameters()):
            for k, v in opt.state[q].items():
                assert torch.equal(local(resumed_opt.state[p][k]), local(v)), (what, k)


def model_dir(tmp_path, tied: bool) -> str:
    torch.manual_seed(int(tied))
    path = str(tmp_path / f"tied{int(tied)}")
    AutoModelForCausalLM.from_config(tiny_config(tied)).save_pretrained(path)
    return path


def test_sharded_builds_equal_the_per_rank_from_pretrained_model(tmp_path):
    dirs = {tied: model_dir(tmp_path, tied) for tied in (True, False)}
    run_distributed(_build_paths, 2, dirs, str(tmp_path / "ckpt"))


@pytest.mark.parametrize("tied", [True, False])
def test_unsharded_meta_model_filled_by_a_state_dict_equals_from_pretrained(tmp_path, tied):
    """The HF rollout engine's start (no weights until the first sync): to_empty alone unties a
    plain model's embeddings and leaves inv_freq garbage."""
    from spmd_rl.model.loading import allocate_meta_model, load_causal_lm
    from spmd_rl.rollout.hf_engine import HFEngine

    path = model_dir(tmp_path, tied)
    want = load_causal_lm(path, torch.float32)
    got = allocate_meta_model(load_causal_lm(path, torch.float32, weights=False), torch.device("cpu"))
    with torch.no_grad():  # as the trainer's first sync does (tied parameters come once, by one name)
        HFEngine(got, 0, [1], torch.device("cpu")).load_weights(want.named_parameters())
    assert_same_model(got, want, f"tied={tied}")
    assert torch.equal(outputs(got, False), outputs(want, False))


def _trainer_reads_weights_on_rank_0_only(rank, world, run_dir, data_dir):
    from spmd_rl.config.run_config import load_config
    from spmd_rl.preflight import validate
    from spmd_rl.runtime.distributed import init_distributed
    from spmd_rl.runtime.preemption import StopFlag
    from spmd_rl.trainer import Trainer

    calls = count_weight_loads()
    overrides = [f"trainer.run_dir={run_dir}", "data.val_files=[]",
                 "data.synthetic_size=64", "trainer.tensorboard=false", 'algorithm.adv_estimator="gae"',
                 "actor.use_kl_loss=true", "critic.ppo_mini_batch_size=4"]
    cfg = load_config(os.path.join(ROOT, "configs", "tiny-cpu.toml"), overrides)
    assert cfg.use_reference and cfg.use_critic
    env = init_distributed("cpu")
    validate(cfg, env.world_size)  # as the entry point does: places the run's synthetic data
    # a flag without handlers: a rank that fails gets the other one killed by SIGTERM (which the
    # trainer's handlers would turn into a stop request, leaving it waiting in a collective)
    StopFlag._instance = StopFlag()
    first = Trainer(cfg, env)
    # actor, reference, critic: from the model directory on rank 0 alone
    assert calls == (["Qwen2ForCausalLM", "Qwen2ForCausalLM", "Qwen2ForTokenClassification"] if rank == 0 else []), calls
    first.step = 3
    first.save_checkpoint(wait=True)
    saved = [local(p).clone() for p in first.actor.parameters()] + [local(p).clone() for p in first.critic.parameters()]
    first.close()

    del calls[:]
    again = Trainer(cfg, env)
    assert calls == (["Qwen2ForCausalLM"] if rank == 0 else []), calls  # the reference alone: it is not checkpointed
    assert again.step == 3
    for p, q in zip(list(again.actor.parameters()) + list(again.critic.parameters()), saved):
        assert torch.equal(local(p), q)
    again.close()


def test_trainer_reads_weights_on_rank_0_only_and_none_on_resume(tmp_path):
    run_distributed(_trainer_reads_weights_on_rank_0_only, 2, str(tmp_path / "run"), str(tmp_path / "data"))


def test_random_model_dir_drawn_on_another_device_is_kept(tmp_path):
    """materialize_random_model records where the weights were drawn (a GPU draws other values for
    the seed than the CPU) but keeps a directory drawn elsewhere with the same config, seed and
    dtype: a run's reference model reads it, and must not change when the run resumes elsewhere."""
    import json

    import torch

    from spmd_rl.model.loading import materialize_random_model, random_model_config

    out = tmp_path / "m"
    materialize_random_model(str(out), random_model_config("tiny"), 3, torch.float32)
    stamp = out / "spmd_rl_init.json"
    drawn = json.loads(stamp.read_text())
    assert "device" not in drawn
    stamp.write_text(json.dumps({**drawn, "device": "cuda"}))  # as a GPU-drawn one records it
    weights = (out / "model.safetensors").stat().st_mtime_ns
    materialize_random_model(str(out), random_model_config("tiny"), 3, torch.float32)
    assert (out / "model.safetensors").stat().st_mtime_ns == weights, "redrawn though config, seed and dtype agree"
    materialize_random_model(str(out), random_model_config("tiny"), 4, torch.float32)  # another seed: redrawn
    assert json.loads(stamp.read_text())["seed"] == 4
