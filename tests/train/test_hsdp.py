"""Hybrid sharding (trainer.fsdp_size). On 4 gloo ranks, shard groups of 4 (plain FSDP, 1-D mesh),
2 (2 replicas x 2) and 1 (4 replicas x 1):

- build_sharded's fresh start (rank 0's from_pretrained weights broadcast into the shards) equals
  every rank's own from_pretrained model, on the 2-D mesh too;
- the first two optimizer steps of the PPO update (2 mini-batches of 2 micro-batches per rank,
  gradient clipping that binds) give the parameters, loss and gradient norm of a float64
  single-process reference written with plain torch, with each micro-batch's gradients
  reduce-scattered before the next (no rank holds the whole model's unsharded gradients);
- the weight sync gathers within the shard group only and gives the full weights;
- a checkpoint saved under one fsdp_size loads under every other with parameters and AdamW state
  bitwise equal to what was saved (test_e2e's HSDP run resumes on another world size, too).
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

from tests.helpers.dist_utils import full, run_distributed
from tests.model.test_sharded_init import assert_same_model
from tests.train.test_update import make_batch, reference_loss, tiny_config

WORLD = 4
LAYOUTS = (0, 2, 1)  # fsdp_size: meshes (4,), (2, 2), (4, 1)
ROWS = 4  # rows per rank; 2 mini-batches of MINI rows, each in micro-batches of one row
MINI = 2
LR, MOMENTUM, CLIP = 0.5, 0.9, 0.05  # CLIP binds at both steps (asserted): the clipping is exercised
# fp32 forward/backward on the ranks (reduction order set by the layout: a reduce-scatter over 4, or
# over 2 then an all-reduce over 2, or an all-reduce over 4) against float64: relative errors of a few
# 1e-7 per gradient element, the same bound test_update uses for one step; a wrong average (over a
# shard group or the replicas instead of all ranks: x2 or x4), a lost micro-batch or replicas that
# drift apart are off by orders of magnitude more.
RTOL, ATOL = 1e-4, 1e-6


def full_state(model, opt) -> dict[str, torch.Tensor]:
    """Every parameter and optimizer state tensor, unsharded, by name."""
    state = {f"param/{n}": full(p.detach()).clone() for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        state.update({f"optim/{n}/{k}": full(v).clone() for k, v in opt.state[p].items()})
    return state


def assert_bitwise(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), (what, k)


def mini_batch_rows(k: int) -> list[int]:
    """The rows of the k-th global mini-batch: each rank's k-th slice of MINI rows."""
    return [r * ROWS + k * MINI + i for r in range(WORLD) for i in range(MINI)]


def reference_steps(model_dir: str, batch) -> tuple[dict[str, torch.Tensor], list[float], list[float]]:
    """Two optimizer steps of one float64 process on the whole mini-batches, plain torch (clip,
    SGD with momentum): the parameters after them, the losses and the gradient norms (before
    clipping, as update.clip_grad_norm reports them)."""
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    losses, norms = [], []
    for k in range(2):
        opt.zero_grad()
        loss = reference_loss(model, batch.select(mini_batch_rows(k)), "token-mean")
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        losses.append(loss.item())
        opt.step()
    return {n: p.detach() for n, p in model.named_parameters()}, losses, norms


def unsharded_grads_held(model) -> bool:
    """Whether any FSDP2 parameter holds an unsharded gradient: what a deferred reduce-scatter
    (set_requires_gradient_sync(False)) keeps between micro-batches, a gradient of the whole
    parameter on every rank. (FSDPParam's fields: torch has no public view of them.)"""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        group = module._get_fsdp_state()._fsdp_param_group if isinstance(module, FSDPModule) else None
        for fp in group.fsdp_params if group else ():
            unsharded = getattr(fp, "_unsharded_param", None)
            if fp.unsharded_accumulated_grad is not None or (unsharded is not None and unsharded.grad is not None):
                return True
    return False


def grads_at_each_micro_batch(model, loss_fn):
    """(calls, loss_fn wrapped): each call appends whether an unsharded gradient was held when the
    micro-batch started."""
    calls = []

    def spy(mb, denom):
        calls.append(unsharded_grads_held(model))
        return loss_fn(mb, denom)

    return calls, spy


def _layouts_body(rank, world, model_dir, root, reference):
    import torch.distributed as dist

    from spmd_rl.checkpoint.checkpointer import Checkpointer, ModelAndOptimizer
    from spmd_rl.config.actor import ActorConfig
    from spmd_rl.model.loading import apply_fsdp, build_sharded, load_causal_lm
    from spmd_rl.runtime.distributed import all_reduce_mean, fsdp_mesh
    from spmd_rl.train.actor import actor_loss_fn
    from spmd_rl.train.optim import make_optimizer
    from spmd_rl.train.update import ppo_update

    want_params, want_losses, want_norms = reference
    load = functools.partial(load_causal_lm, model_dir, torch.float32)
    cpu = torch.device("cpu")
    batch = make_batch(seed=2, rows=ROWS * world)
    saved = {}
    for fsdp_size in LAYOUTS:
        what = f"fsdp_size={fsdp_size}"
        mesh = fsdp_mesh("cpu", world, fsdp_size)
        shard_ranks = fsdp_size or world
        first = rank - rank % shard_ranks  # a shard group is consecutive ranks: one node's, with a node per group
        assert dist.get_process_group_ranks(mesh.get_group(mesh.ndim - 1)) == list(range(first, first + shard_ranks))
        model = build_sharded(load, mesh, torch.float32, from_checkpoint=False)
        assert_same_model(model, apply_fsdp(load(), mesh, torch.float32), what + ": rank 0's weights broadcast")

        # the update: 2 optimizer steps over this rank's rows
        before = {n: full(p.detach()).double() for n, p in model.named_parameters()}
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        cfg = ActorConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, loss_agg_mode="token-mean")
        mine = batch.select(slice(rank * ROWS, (rank + 1) * ROWS))
        held, loss_fn = grads_at_each_micro_batch(model, actor_loss_fn(model, cfg, 1.0))
        metrics = ppo_update(model, opt, mine, loss_fn, mini_batch_size=MINI,
                             micro_batch_size=1, epochs=1, grad_clip=CLIP, loss_agg_mode="token-mean", device=cpu)
        # each micro-batch's gradients were reduce-scattered before the next one ran: no rank held
        # the unsharded gradients of the whole model between them (under HSDP the all-reduce across
        # replicas still waits for the last micro-batch)
        assert held == [False] * ROWS, (what, held)
        metrics = all_reduce_mean(metrics, cpu)  # per-rank shares of the loss -> the global loss, as the trainer logs
        for n, p in model.named_parameters():
            got, want = full(p.detach()).double() - before[n], want_params[n] - before[n]
            torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=f"{what} {n}")
        assert metrics["grad_norm"] == pytest.approx(sum(want_norms) / 2, rel=RTOL), what
        assert metrics["pg_loss"] == pytest.approx(sum(want_losses) / 2, rel=RTOL, abs=ATOL), what

        check_weight_sync(model, mesh, shard_ranks, what)

        # AdamW state to checkpoint: one more step
        adam = make_optimizer(model, 1e-2, 0.01)
        ppo_update(model, adam, mine.select(slice(0, MINI)), actor_loss_fn(model, cfg, 1.0), mini_batch_size=MINI,
                   micro_batch_size=MINI, epochs=1, grad_clip=1.0, loss_agg_mode="token-mean", device=cpu)
        Checkpointer(os.path.join(root, what), keep_last=1).save(1, {"actor": ModelAndOptimizer(model, adam)},
                                                                 {"step": 1})
        saved[fsdp_size] = full_state(model, adam)

    for src in LAYOUTS:
        for dst in LAYOUTS:
            if dst != src:
                got = load_checkpoint(load, fsdp_mesh("cpu", world, dst), os.path.join(root, f"fsdp_size={src}"))
                assert_bitwise(got, saved[src], f"saved with fsdp_size={src}, loaded with fsdp_size={dst}")


def check_weight_sync(model, mesh, shard_ranks: int, what: str) -> None:
    """iter_weights gives the full weights, gathered over the shard group alone (under HSDP no
    bytes go to the other replicas: with a node per shard group, none cross nodes)."""
    import torch.distributed as dist

    from spmd_rl.rollout import weight_sync

    group_sizes = []
    gather = weight_sync.all_gather_flat

    def spy(out, inp, group=None, **kw):
        group_sizes.append(dist.get_world_size(group))
        return gather(out, inp, group=group, **kw)

    weight_sync.all_gather_flat = spy
    try:
        got = dict(weight_sync.iter_weights(model, torch.float32, 1))
    finally:
        weight_sync.all_gather_flat = gather
    want = {n: full(p.detach()) for n, p in model.named_parameters()}
    assert got.keys() == want.keys(), what
    for n, t in want.items():
        assert torch.equal(got[n], t), (what, n)
    assert set(group_sizes) == ({shard_ranks} if shard_ranks > 1 else set()), (what, group_sizes)


def load_checkpoint(load, mesh, path: str) -> dict[str, torch.Tensor]:
    """A resume: the model built on the meta device over `mesh`, filled by the checkpoint."""
    from spmd_rl.checkpoint.checkpointer import Checkpointer, ModelAndOptimizer
    from spmd_rl.model.loading import build_sharded
    from spmd_rl.train.optim import make_optimizer

    model = build_sharded(load, mesh, torch.float32, from_checkpoint=True)
    opt = make_optimizer(model, 1e-2, 0.01)
    step = os.path.join(path, "step_1")
    assert Checkpointer(path, keep_last=1).load(step, {"actor": ModelAndOptimizer(model, opt)}) == {"step": 1}
    return full_state(model, opt)


def test_fsdp_sizes_give_the_same_update_and_checkpoints_reshard_across_them(tmp_path):
    from spmd_rl.model.loading import materialize_random_model

    model_dir = materialize_random_model(str(tmp_path / "model"), tiny_config(), seed=5, dtype=torch.float32)
    reference = reference_steps(model_dir, make_batch(seed=2, rows=ROWS * WORLD))
    assert min(reference[2]) > 2 * CLIP, reference[2]  # the clipping binds: it is part of what is compared
    run_distributed(_layouts_body, WORLD, model_dir, str(tmp_path), reference)


def test_mesh_shapes():
    from spmd_rl.runtime.distributed import fsdp_mesh_shape

    assert fsdp_mesh_shape(8, 0) == fsdp_mesh_shape(8, 8) == (8,)
    assert fsdp_mesh_shape(8, 4) == (2, 4) and fsdp_mesh_shape(8, 1) == (8, 1) and fsdp_mesh_shape(1, 0) == (1,)
    for bad in (3, 16, -1):
        with pytest.raises(ValueError, match="does not divide the world size 8"):
            fsdp_mesh_shape(8, bad)


def test_hsdp_run_on_4_ranks_resumes_on_2_with_another_fsdp_size(tmp_path):
    """The trainer end to end, actor, critic and reference on the HSDP mesh (GAE with the KL loss):
    2 steps on 4 ranks as 2 replicas x shard groups of 2 (2 micro-batches per mini-batch: gradient
    accumulation with the sync on the last), then a resume of its checkpoint on 2 ranks as 2
    replicas of 1 for a third step."""
    from tests.helpers.cpu_runs import read_metrics, run, torchrun_cmd

    run_dir = tmp_path / "run"
    common = [f"trainer.run_dir={run_dir}", "data.val_files=[]",
              "data.synthetic_size=64", "trainer.val_every=0", "trainer.tensorboard=false",
              "actor.micro_batch_size_per_gpu=8", 'algorithm.adv_estimator="gae"', "actor.use_kl_loss=true"]
    out = run(torchrun_cmd(4, *common, "trainer.total_steps=2", "trainer.fsdp_size=2"))
    assert "world=4 (HSDP: 2 replicas x shard groups of 2)" in out and "= 2 micro-batches of 8 sequences" in out, out
    out = run(torchrun_cmd(2, *common, "trainer.total_steps=3", "trainer.fsdp_size=1"))
    assert "world=2 (HSDP: 2 replicas x shard groups of 1)" in out, out
    assert f"resumed from {run_dir / 'checkpoints' / 'step_2'} at step 2" in out, out
    m = read_metrics(run_dir)
    assert sorted(s for s in m if "reward/mean" in m[s]) == [1, 2, 3]
    for step in (1, 2, 3):
        # the engine samples with exactly the actor's weights (fp32 on CPU): the weight sync
        # gathered whole tensors within each shard group
        assert m[step]["rollout/logprob_diff_max"] < 1e-4, (step, m[step]["rollout/logprob_diff_max"])
        for key in ("actor/grad_norm", "critic/grad_norm"):
            assert 0 < m[step][key] < float("inf"), (step, key)
