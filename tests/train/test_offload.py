"""rollout.offload_train_states' mechanics (spmd_rl/train/offload.py), on 2 gloo ranks of FSDP2:

- while offloaded, every storage behind the actor's and the critic-like second model's parameters,
  buffers and AdamW moments holds zero bytes (the memory is free), and the bytes reported moved
  are the state's;
- after the reload, training goes on bitwise as a twin that was never offloaded (parameters and
  moments), and the optimizer still holds the model's own parameter objects;
- every offload after the first copies into the host buffers of the first (no new allocation);
  a storage replaced since gets a fresh buffer, and the replaced one's buffer is let go;
- an asynchronous checkpoint's host staging keeps its buffers across an offload, since the tensors
  are never replaced (moving them with `module.to` made every save after an offload stage afresh);
- a second offload before the reload is refused.

The device copies are the same calls on a GPU with pinned buffers (tests/gpu/test_offload_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.dist_utils import run_distributed
from tests.model.test_sharded_init import local
from tests.train.test_update import tiny_config

STEPS = 3


def _build(seed: int = 0):
    from transformers import AutoModelForCausalLM

    from spmd_rl.model.loading import apply_fsdp
    from spmd_rl.runtime.distributed import fsdp_mesh
    from spmd_rl.train.optim import make_optimizer

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(), dtype=torch.float32)
    model = apply_fsdp(model, fsdp_mesh("cpu", torch.distributed.get_world_size(), 0), torch.float32)
    return model, make_optimizer(model, lr=1e-2, weight_decay=0.01)


def _train_step(model, opt, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 50, (2, 10), generator=g)
    logits = model(input_ids=ids).logits.float()
    torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _full_state(model, opt) -> dict[str, torch.Tensor]:
    out = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, s in opt.state.items():
        for k in ("exp_avg", "exp_avg_sq"):
            out[f"{names[id(p)]}.{k}"] = s[k].full_tensor().clone()
    return out


def _state_bytes(models, opts) -> int:
    from spmd_rl.train.offload import state_storages

    return sum(st.nbytes() for st in state_storages(models, opts, torch.device("cpu")).values())


def _body(rank, world):
    from spmd_rl.train.offload import TrainStateOffload, state_storages

    cpu = torch.device("cpu")
    actor, actor_opt = _build(0)
    critic, critic_opt = _build(1)
    twin, twin_opt = _build(0)
    models, opts = [actor, critic], [actor_opt, critic_opt]
    offload = TrainStateOffload(cpu)
    _train_step(actor, actor_opt, 0), _train_step(critic, critic_opt, 0), _train_step(twin, twin_opt, 0)
    buffers = None
    for step in range(1, STEPS + 1):
        want_bytes = _state_bytes(models, opts)
        assert offload.offload(models, opts) == want_bytes > 0
        with pytest.raises(RuntimeError, match="already offloaded"):
            offload.offload(models, opts)
        held = [n for m in models for n, t in (*m.named_parameters(), *m.named_buffers()) if local(t).untyped_storage().nbytes()]
        held += [k for o in opts for s in o.state.values() for k, v in s.items() if k != "step" and local(v).untyped_storage().nbytes()]
        assert not held, f"offloaded storages still hold their bytes: {held}"
        assert not state_storages(models, opts, cpu)
        if buffers is None:
            buffers = {k: b.data_ptr() for k, b in offload._host.items()}
        else:  # the first offload's host buffers, reused
            assert {k: b.data_ptr() for k, b in offload._host.items()} == buffers
        offload.reload()
        assert _state_bytes(models, opts) == want_bytes
        assert {id(p) for g in actor_opt.param_groups for p in g["params"]} == {id(p) for p in actor.parameters()}
        _train_step(actor, actor_opt, step), _train_step(critic, critic_opt, step), _train_step(twin, twin_opt, step)
    got, want = _full_state(actor, actor_opt), _full_state(twin, twin_opt)
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), f"rank {rank}: {k} differs from the never-offloaded twin"

    # a moment replaced since the last offload: a fresh buffer for it, the old one let go
    p = next(iter(actor_opt.state))
    old = actor_opt.state[p]["exp_avg"].to_local().untyped_storage()._cdata
    actor_opt.state[p]["exp_avg"] = actor_opt.state[p]["exp_avg"].clone()
    new = actor_opt.state[p]["exp_avg"].to_local().untyped_storage()._cdata
    held = offload.host_bytes
    offload.offload(models, opts)
    assert new in offload._host and old not in offload._host and offload.host_bytes == held
    offload.reload()


def test_offload_frees_the_state_and_training_after_reload_is_unchanged():
    run_distributed(_body, 2)


def _staging_body(rank, world, root):
    from spmd_rl.checkpoint.checkpointer import Checkpointer, ModelAndOptimizer
    from spmd_rl.checkpoint.staging import HostStager
    from spmd_rl.train.offload import TrainStateOffload

    staged = []
    stage = HostStager.stage

    def recording_stage(self, state_dict):
        out = stage(self, state_dict)
        staged.append({k: local(v).data_ptr() for k, v in out["actor"]["model"].items()})
        return out

    HostStager.stage = recording_stage
    try:
        model, opt = _build(0)
        offload = TrainStateOffload(torch.device("cpu"))
        ck = Checkpointer(root, keep_last=1, async_save=True)
        for step in (1, 2):
            _train_step(model, opt, step)
            ck.save(step, {"actor": ModelAndOptimizer(model, opt)}, {"step": step})
            ck.wait()
            offload.offload([model], [opt])
            offload.reload()
        ck.close()
    finally:
        HostStager.stage = stage
    assert len(staged) == 2 and staged[0] == staged[1], "the save after an offload staged into new buffers"


def test_async_save_staging_keeps_its_buffers_across_an_offload(tmp_path):
    run_distributed(_staging_body, 2, str(tmp_path))


def test_ppo_with_offload_trains_as_without(tmp_path):
    """The trainer with rollout.offload_train_states (actor, critic, reference and both optimizers
    leave and come back around every generation; on CPU the same copies into host buffers and the
    same zero-byte storages as on a GPU): two PPO steps give the very numbers of the same run without
    it."""
    import os

    from spmd_rl.ppo import main
    from tests.helpers.cpu_runs import TINY, read_metrics

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(k, None)
    runs = {}
    for offload in ("false", "true"):
        run_dir = tmp_path / f"offload_{offload}"
        rc = main(["--config", TINY, f"trainer.run_dir={run_dir}", "trainer.total_steps=2", "trainer.val_every=0",
                   "trainer.save_every=-1", "data.train_batch_size=4", "data.synthetic_size=64",
                   "trainer.tensorboard=false", "rollout.n=4", "actor.micro_batch_size_per_gpu=8",
                   'algorithm.adv_estimator="gae"', "critic.ppo_mini_batch_size=4", "actor.use_kl_loss=true",
                   f"rollout.offload_train_states={offload}"])
        assert rc == 0
        runs[offload] = read_metrics(run_dir)
    on, off = runs["true"], runs["false"]
    assert "time/offload" in on[2] and "time/reload" in on[2] and "time/offload" not in off[2]
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/kl_loss", "critic/vf_loss", "critic/grad_norm",
                "critic/values_mean", "reward/mean"):
        assert on[2][key] == off[2][key], (key, on[2][key], off[2][key])
