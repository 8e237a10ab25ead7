"""Ulysses sequence parallelism (trainer.ulysses_size, spmd_rl/batching/sequence_parallel.py) on gloo ranks.

The reference is the same update without sequence parallelism (ulysses_size = 1) on the same
ranks and rows: that path is itself checked against float64 single-process references written
with plain torch (tests/train/test_update.py, tests/train/test_hsdp.py). Compared: the no-grad passes (old
and reference log-probs, values) row by row, the loss and gradient norm of the update, and every
parameter after two optimizer steps (two mini-batches; SGD with momentum, clipping that binds).

- 2 ranks as one SP group of 2 (data parallel 1), and 4 ranks as 2 SP groups of 2 (data parallel
  2) inside the shard groups of hybrid sharding (trainer.fsdp_size = 2); the SP runs use
  gradient checkpointing.
- Every row has an odd number of tokens, so packed micro-batches of one row (and of any odd
  number of rows) do not split in two: the padding to a multiple of the group is exercised.
- The actor alone (token-mean); the actor with the KL loss against a reference model and an
  entropy bonus (seq-mean-token-mean, token-budget micro-batches); the critic (values, the clipped
  value loss, then GAE advantages whitened over the data-parallel ranks).

Tolerance. The models are float64 (parameters and activations), but FSDP reduces gradients in
float32 (models.apply_fsdp) and the no-grad passes return float32 columns (actor.per_token_outputs):
both sides round there at float32's 6e-8, after sums in different orders (a rank's matmuls run
over a slice of a packed row instead of the whole row; a parameter's gradient is summed over the
slices' ranks by the all-to-alls' backward and FSDP's reduce-scatter for sp=2, over the rows'
ranks for sp=1). Seen: at most 4e-7 of the compared tensor's scale (its largest magnitude) for
values and whitened advantages, 3e-7 for the parameters' moves, 1e-7 relative for losses and
gradient norms; the bound is 2e-6. Float64 parameters keep the comparison of how much each
parameter moved free of the cancellation in float32's after - before. A wrong gradient scale (the
SP factor 2 missing or doubled), targets shifted after the row is cut, a mini-batch with other
rows or a lost micro-batch are off by orders of magnitude more.
"""

from __future__ import annotations

import functools

import pytest
import torch

from spmd_rl import preflight
from tests.helpers.dist_utils import full, run_distributed
from tests.train.test_update import tiny_config

ROWS = 4  # rows per rank: two mini-batches of MINI rows (two optimizer steps)
MINI = 2
LR, MOMENTUM = 0.5, 0.9
TOL = 2e-6  # relative to each compared tensor's largest magnitude (see the module doc)
CPU = torch.device("cpu")


def odd_batch(world: int, seed: int = 0, vocab: int = 50):
    """ROWS rows per rank, each with an odd number of real tokens (prompt + response), right
    padding, and the PPO / critic inputs; `row_id` follows a row wherever it travels."""
    from spmd_rl.batching.batch import Batch

    g = torch.Generator().manual_seed(seed)
    rows, width = ROWS * world, 15
    ids = torch.randint(2, vocab, (rows, width), generator=g)
    attn = torch.zeros(rows, width, dtype=torch.long)
    resp = torch.zeros(rows, width)
    for i in range(rows):
        total = 2 * int(torch.randint(2, width // 2 + 1, (1,), generator=g)) + 1  # 5..15, odd
        prompt = int(torch.randint(2, 5, (1,), generator=g))
        attn[i, :total] = 1
        resp[i, prompt:total] = 1
    return Batch(dict(input_ids=ids * attn, attention_mask=attn, response_mask=resp,
                      old_logprobs=(-torch.rand(rows, width, generator=g) * 3) * resp,
                      advantages=torch.randn(rows, width, generator=g) * resp,
                      values=torch.randn(rows, width, generator=g) * resp,
                      returns=torch.randn(rows, width, generator=g) * resp,
                      token_rewards=torch.randn(rows, width, generator=g) * resp,
                      row_id=torch.arange(rows)))


def by_row(batch, values: torch.Tensor) -> dict[int, torch.Tensor]:
    """row id -> its row of `values`, from every rank. The ranks of an SP group hold the same rows:
    their copies must be equal."""
    import torch.distributed as dist

    mine = list(zip(batch["row_id"].tolist(), values))
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    out: dict[int, torch.Tensor] = {}
    for rows in every:
        for i, v in rows:
            if i in out:
                assert torch.equal(out[i], v), f"row {i}: the ranks of an SP group disagree"
            out[i] = v
    return out


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """|got - want| <= TOL * max |want|, elementwise: relative to the tensor's scale, so that the
    float32 rounding of its largest values bounds the error of all of them."""
    scale = float(want.abs().max())
    err = float((got.double() - want.double()).abs().max())
    assert scale > 0 and err <= TOL * scale, f"{what}: max error {err:.3g}, {err / scale:.3g} of the scale {scale:.3g}"


def assert_rows_close(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    assert_close(torch.stack([got[i] for i in sorted(want)]), torch.stack([want[i] for i in sorted(want)]), what)


class Setup:
    """One layout: the SP groups (size 1 = the reference), the FSDP mesh, gradient checkpointing,
    and this rank's rows (shared within its SP group)."""

    def __init__(self, world: int, size: int, fsdp_size: int, checkpointing: bool, batch):
        from spmd_rl.batching import sequence_parallel
        from spmd_rl.runtime import sp_groups
        from spmd_rl.runtime.distributed import fsdp_mesh

        self.sp = sp_groups.make_groups(size)
        self.mesh = fsdp_mesh("cpu", world, fsdp_size)
        self.checkpointing = checkpointing
        rank = torch.distributed.get_rank()
        mine = batch.select(slice(rank * ROWS, (rank + 1) * ROWS))
        self.batch = sequence_parallel.share_rows(mine, MINI, 0, self.sp)
        self.mini = MINI * size  # a mini-batch's rows per data-parallel rank (the trainer's ppo_mini * n / dp)

    def model(self, load, trainable: bool = True):
        from spmd_rl.batching import sequence_parallel
        from spmd_rl.model.loading import build_sharded

        model = build_sharded(load, self.mesh, torch.float64, from_checkpoint=False,
                              gradient_checkpointing=self.checkpointing and trainable)
        return sequence_parallel.apply(model, self.sp)

    def update(self, model, loss_fn, mode: str, clip: float, max_tokens: int = 0, micro: int = 1):
        """Two optimizer steps; (all-rank mean of the metrics, how much each parameter moved)."""
        from spmd_rl.runtime.distributed import all_reduce_mean
        from spmd_rl.train.update import ppo_update

        before = {n: full(p.detach()).clone() for n, p in model.named_parameters()}
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        metrics = ppo_update(model, opt, self.batch, loss_fn, mini_batch_size=self.mini, micro_batch_size=micro,
                             epochs=1, grad_clip=clip, loss_agg_mode=mode, device=CPU,
                             max_tokens=max_tokens * self.sp.size)  # Config.micro_batching: a group's budget
        deltas = {n: full(p.detach()) - before[n] for n, p in model.named_parameters()}
        return all_reduce_mean(metrics, CPU), deltas


def _compare_updates(ref, got, what: str, keys=("grad_norm",)):
    (m1, p1), (m2, p2) = ref, got
    assert p1.keys() == p2.keys()
    for n in p1:
        assert_close(p2[n], p1[n], f"{what}: the update of {n}")
    for k in keys:
        assert m2[k] == pytest.approx(m1[k], rel=TOL), (what, k, m1[k], m2[k])


def _actor_body(rank, world, model_dir, size, fsdp_size):
    from spmd_rl.config.actor import ActorConfig
    from spmd_rl.model.loading import load_causal_lm
    from spmd_rl.train.actor import actor_loss_fn, compute_logprobs

    load = functools.partial(load_causal_lm, model_dir, torch.float64, remove_padding=True)
    batch = odd_batch(world, seed=1)
    ref_setup, sp_setup = Setup(world, 1, 0, False, batch), Setup(world, size, fsdp_size, True, batch)
    assert sp_setup.sp.dp_size == world // size and len(sp_setup.batch) == size * ROWS

    # 1. the actor alone, token-mean, micro-batches of one (odd) row; the clip binds at both steps
    cfg = ActorConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, loss_agg_mode="token-mean")
    results, logps = [], []
    for s in (ref_setup, sp_setup):
        actor = s.model(load)
        logps.append(by_row(s.batch, compute_logprobs(actor, s.batch, 0.7, 1, CPU, max_tokens=20 * s.sp.size)))
        results.append(s.update(actor, actor_loss_fn(actor, cfg, 0.7), "token-mean", clip=0.05))
    assert_rows_close(logps[1], logps[0], f"ulysses_size={size}: old log-probs")
    assert results[0][0]["grad_norm"] > 2 * 0.05, results[0][0]  # the clipping binds: part of what is compared
    _compare_updates(results[0], results[1], f"ulysses_size={size}, actor", keys=("grad_norm", "pg_loss", "entropy"))

    # 2. with the KL loss against a reference model and an entropy bonus, seq-mean-token-mean,
    # token-budget micro-batches (several rows, odd and even totals)
    cfg = ActorConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, loss_agg_mode="seq-mean-token-mean",
                      use_kl_loss=True, kl_loss_coef=0.5, kl_loss_type="low_var_kl", entropy_coeff=0.01)
    results, refs = [], []
    for s in (ref_setup, sp_setup):
        reference = s.model(load, trainable=False).requires_grad_(False)
        s.batch["ref_logprobs"] = compute_logprobs(reference, s.batch, 1.0, 1, CPU, max_tokens=40 * s.sp.size)
        refs.append(by_row(s.batch, s.batch["ref_logprobs"]))
        actor = s.model(load)
        results.append(s.update(actor, actor_loss_fn(actor, cfg, 1.0), "seq-mean-token-mean", clip=1.0, max_tokens=20))
    assert_rows_close(refs[1], refs[0], f"ulysses_size={size}: reference log-probs")
    assert results[0][0]["kl_loss"] != 0
    _compare_updates(results[0], results[1], f"ulysses_size={size}, actor + KL loss",
                     keys=("grad_norm", "pg_loss", "kl_loss", "entropy"))


def _critic_body(rank, world, model_dir, size, fsdp_size):
    from spmd_rl.algo import algorithms as algos
    from spmd_rl.config.critic import CriticConfig
    from spmd_rl.model.loading import load_value_model
    from spmd_rl.train.critic import compute_values, critic_loss_fn

    load = functools.partial(load_value_model, model_dir, torch.float64, remove_padding=True)
    batch = odd_batch(world, seed=2)
    cfg = CriticConfig(cliprange_value=0.5, loss_agg_mode="token-mean")
    values, advantages, results = [], [], []
    for s in (Setup(world, 1, 0, False, batch), Setup(world, size, fsdp_size, True, batch)):
        critic = s.model(load)
        results.append(s.update(critic, critic_loss_fn(critic, cfg), "token-mean", clip=1.0, micro=2))
        v = compute_values(critic, s.batch, 1, CPU, max_tokens=30 * s.sp.size)  # the trained head: not zero
        adv, _ = algos.gae_advantages(s.batch["token_rewards"], v, s.batch["response_mask"], 1.0, 0.95,
                                      whiten_group=s.sp.data_group)
        values.append(by_row(s.batch, v))
        advantages.append(by_row(s.batch, adv))
    assert_rows_close(values[1], values[0], f"ulysses_size={size}: values")
    assert max(v.abs().max() for v in values[0].values()) > 1e-3
    assert_rows_close(advantages[1], advantages[0], f"ulysses_size={size}: GAE advantages (whitened)")
    _compare_updates(results[0], results[1], f"ulysses_size={size}, critic", keys=("grad_norm", "vf_loss"))


LAYOUTS = {"2ranks-ulysses2": (2, 2, 0), "4ranks-dp2-ulysses2-hsdp": (4, 2, 2)}  # (world, ulysses_size, fsdp_size)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from spmd_rl.model.loading import materialize_random_model

    path = str(tmp_path_factory.mktemp("ulysses_model"))
    return materialize_random_model(path, tiny_config(), seed=7, dtype=torch.float32)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_actor_update_with_and_without_kl_loss_equals_ulysses_1(model_dir, layout):
    world, size, fsdp_size = LAYOUTS[layout]
    run_distributed(_actor_body, world, model_dir, size, fsdp_size)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_critic_and_gae_equal_ulysses_1(model_dir, layout):
    world, size, fsdp_size = LAYOUTS[layout]
    run_distributed(_critic_body, world, model_dir, size, fsdp_size)


def _replicated_kv_body(rank, world, model_dir):
    """One KV head, an SP group of 2: each rank gets a copy of it. Log-probs, entropy and the
    gradients of the sliced FSDP model against the same model unsliced on one rank."""
    from spmd_rl.batching import sequence_parallel
    from spmd_rl.model.loading import apply_fsdp, load_causal_lm
    from spmd_rl.runtime import sp_groups
    from spmd_rl.runtime.distributed import fsdp_mesh
    from spmd_rl.train.actor import forward_logprobs

    sp = sp_groups.make_groups(2)
    plain = load_causal_lm(model_dir, torch.float64, remove_padding=True)
    model = sequence_parallel.apply(apply_fsdp(load_causal_lm(model_dir, torch.float64, remove_padding=True),
                                               fsdp_mesh("cpu", world), torch.float64), sp)
    assert sp_groups.kv_replication(1, 2) == 2
    mb = odd_batch(1, seed=3).select([0, 1, 2])  # 3 odd rows: an odd packed row
    assert int(mb["attention_mask"].sum()) % 2 == 1
    results = []
    for m in (plain, model):
        logp, ent = forward_logprobs(m, mb, 0.7, with_entropy=True, entropy_grad=True)
        ((logp * mb["advantages"]).sum() + ent.sum()).backward()
        results.append((logp.detach(), ent.detach(), {n: full(p.grad) for n, p in m.named_parameters()}))
    (want_logp, want_ent, want_grads), (logp, ent, grads) = results
    assert_close(logp, want_logp, "log-probs")
    assert_close(ent, want_ent, "entropy")
    for n, g in want_grads.items():
        assert_close(grads[n], g, f"gradient of {n}")


def test_kv_heads_fewer_than_the_group_are_replicated(tmp_path):
    from spmd_rl.model.loading import materialize_random_model

    config = tiny_config()
    config.num_key_value_heads = 1
    run_distributed(_replicated_kv_body, 2, materialize_random_model(str(tmp_path), config, seed=4, dtype=torch.float32))


# --------------------------------------------------------------------------- config


def test_sp_groups_are_consecutive_ranks_inside_shard_groups():
    from spmd_rl.runtime.distributed import fsdp_mesh_shape
    from spmd_rl.runtime.sp_groups import sp_group_ranks

    sp, dp = sp_group_ranks(8, 2)
    assert sp == [[0, 1], [2, 3], [4, 5], [6, 7]] and dp == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert fsdp_mesh_shape(8, 4) == (2, 4)  # shard groups [0..3], [4..7]: each holds two SP groups whole
    assert sp_group_ranks(4, 4) == ([[0, 1, 2, 3]], [[0], [1], [2], [3]])
    with pytest.raises(ValueError, match="ulysses_size = 3 does not divide the world size 8"):
        sp_group_ranks(8, 3)


def valid_cfg(tmp_path, extra=()):
    from tests.config.test_config import valid_cfg as base

    return base(tmp_path, ["model.remove_padding=true", "trainer.ulysses_size=2", *extra])


@pytest.mark.parametrize("overrides, world, message", [
    ([], 3, "trainer.ulysses_size = 2 does not divide the world size 3 (it is the ranks that share each micro-batch): "
            "use one of 1, 3"),
    (["trainer.fsdp_size=2", "trainer.ulysses_size=4", "data.train_batch_size=8"], 8,
     "trainer.ulysses_size = 4 does not divide trainer.fsdp_size = 2: a sequence-parallel group must lie inside a "
     "shard group; use a divisor of 2, or a trainer.fsdp_size that 4 divides"),
    (["model.remove_padding=false"], 2, "trainer.ulysses_size = 2 splits packed rows across ranks: set "
                                        "model.remove_padding = true"),
    (["trainer.ulysses_size=0"], 2, "trainer.ulysses_size = 0 must be >= 1 (1 = no sequence parallelism)"),
    (['model.arch="qwen2-0.5b"', "trainer.ulysses_size=4", "data.train_batch_size=8"], 8,
     "trainer.ulysses_size = 4 does not fit the model (model.arch = 'qwen2-0.5b'): its 14 attention heads do not "
     "divide by 4; use one of 1, 2"),
    (["actor.max_token_len_per_gpu=300"], 2,
     "actor.max_token_len_per_gpu = 300 x trainer.ulysses_size = 2 is below the longest possible sequence "
     "(data.max_prompt_length + data.max_response_length = 768): raise it to at least 384"),
])
def test_config_refuses_in_one_line(tmp_path, overrides, world, message):
    from spmd_rl.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        preflight.validate(valid_cfg(tmp_path, overrides), world_size=world)
    assert str(e.value) == message


def test_config_refuses_kv_heads_that_neither_divide_nor_split(tmp_path):
    from spmd_rl.errors import ConfigError

    model = tmp_path / "model"
    config = tiny_config()
    config.num_attention_heads, config.num_key_value_heads, config.hidden_size = 6, 3, 48
    config.save_pretrained(model)
    cfg = valid_cfg(tmp_path, [f'model.path="{model}"', 'model.arch=""'])
    with pytest.raises(ConfigError) as e:
        preflight.validate(cfg, world_size=2)
    assert str(e.value) == (f"trainer.ulysses_size = 2 does not fit the model (model.path = '{model}'): its 3 KV "
                            "heads neither divide by 2 nor divide 2; use one of 1")
    preflight.validate(valid_cfg(tmp_path, [f'model.path="{model}"', 'model.arch=""', "trainer.ulysses_size=3",
                                 "data.train_batch_size=6", "actor.ppo_mini_batch_size=6"]), world_size=3)


def test_config_batch_sizes_count_data_parallel_ranks(tmp_path):
    # 4 ranks, SP groups of 2: 2 data-parallel ranks, each with 8 * 4 / 2 = 16 sequences per mini-batch
    cfg = valid_cfg(tmp_path, ["actor.micro_batch_size_per_gpu=16", "actor.max_token_len_per_gpu=1000",
                               "actor.logprob_max_token_len_per_gpu=1500"])
    preflight.validate(cfg, world_size=4)
    assert cfg.micro_batching("actor") == (16, 2000, 3000)  # a group's micro-batch: 2 GPUs' budgets
    layout = cfg.describe_layout(4)
    assert layout.startswith("world=4 (sequence parallel: 2 data-parallel x SP groups of 2 ranks sharing each "
                             "micro-batch) | per step: 8 prompts x n=4 = 32 sequences (8 per rank)"), layout
    assert "actor: 1 optimizer steps x 1 epochs, 16 sequences per SP group per mini-batch packed into " \
           "micro-batches of <= 2000 tokens (<= 3000 without gradients)" in layout, layout
    from spmd_rl.errors import ConfigError

    with pytest.raises(ConfigError, match=r"actor.micro_batch_size_per_gpu = 32 must divide the 16 sequences per "
                                          r"rank of a mini-batch \(actor.ppo_mini_batch_size \* rollout.n / "
                                          r"data-parallel ranks\)"):
        preflight.validate(valid_cfg(tmp_path, ["actor.micro_batch_size_per_gpu=32"]), world_size=4)


# --------------------------------------------------------------------------- the trainer


def test_trainer_with_ulysses_2_resumes_under_ulysses_1_and_continues_the_same(tmp_path):
    """The tiny preset on 2 ranks, PPO with a critic (GAE) and the KL loss (reference model), as one
    SP group of 2: 3 steps, a checkpoint at step 2. That checkpoint resumed with ulysses_size = 1
    (2 data-parallel ranks) trains step 3 on the same rollouts to the same losses and gradient norms
    (float32 on CPU: the sums' order differs, see the module doc; rel 1e-5)."""
    from tests.helpers.cpu_runs import read_metrics, run, torchrun_cmd

    common = ["data.val_files=[]", "data.synthetic_size=64",
              "trainer.val_every=0", "trainer.tensorboard=false", "trainer.total_steps=3", "model.remove_padding=true",
              'algorithm.adv_estimator="gae"', "actor.use_kl_loss=true", "actor.max_token_len_per_gpu=64"]
    straight, resumed = tmp_path / "ulysses2", tmp_path / "resumed"
    out = run(torchrun_cmd(2, *common, f"trainer.run_dir={straight}", "trainer.ulysses_size=2", "trainer.save_every=2"))
    assert "world=2 (sequence parallel: 1 data-parallel x SP groups of 2 ranks sharing each micro-batch)" in out, out
    assert "micro-batches of <= 128 tokens" in out, out  # 2 GPUs' budgets of 64
    checkpoint = straight / "checkpoints" / "step_2"
    out = run(torchrun_cmd(2, *common, f"trainer.run_dir={resumed}", "trainer.ulysses_size=1",
                           f"trainer.resume={checkpoint}"))
    assert f"resumed from {checkpoint} at step 2" in out and "sequence parallel" not in out, out
    a, b = read_metrics(straight), read_metrics(resumed)
    assert sorted(b) == [3]
    # same rollouts; reward/std from sums over the ranks with its n / (n - 1): each row counted once
    for key in ("reward/mean", "reward/std", "response/length_mean"):
        assert b[3][key] == pytest.approx(a[3][key], rel=1e-6, abs=1e-9), key
    # the same critic's values, a mean of small numbers of both signs: float32 ulps of the values
    assert b[3]["critic/values_mean"] == pytest.approx(a[3]["critic/values_mean"], abs=1e-6)
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/entropy", "critic/vf_loss",
                "critic/grad_norm"):
        assert b[3][key] == pytest.approx(a[3][key], rel=1e-5, abs=1e-8), key


def test_long_response_preset_validates_on_2_4_and_8_gpus(tmp_path, monkeypatch):
    """configs/qwen1.5b-long.toml at its model's shape (random weights, no model directory here):
    ulysses_size 2, a group's micro-batch holds the longest prompt + response, DAPO's switches."""
    import os

    from spmd_rl.config.run_config import load_config
    from spmd_rl.errors import ConfigError
    from spmd_rl.rollout.vllm import kwargs as vllm_kwargs
    from tests.helpers import ROOT

    monkeypatch.setattr(vllm_kwargs, "vllm_import_problem", lambda: None)  # engine = "vllm" without vLLM here
    data = tmp_path / "train.parquet"
    data.write_bytes(b"")
    shape = ['model.init="random"', 'model.arch="qwen2-1.5b"', 'model.path=""', 'model.tokenizer="char"',
             f'data.train_files=["{data}"]', "data.val_files=[]"]
    cfg = load_config(os.path.join(ROOT, "configs", "qwen1.5b-long.toml"), shape)
    for world in (2, 4, 8):
        preflight.validate(cfg, world_size=world, gpus_per_node=world)
    longest = cfg.data.max_prompt_length + cfg.data.max_response_length
    assert cfg.trainer.ulysses_size == 2 and cfg.data.max_response_length == 16384
    assert cfg.actor.max_token_len_per_gpu < longest <= cfg.micro_batching("actor").update_tokens
    assert cfg.reward.overlong_buffer and cfg.algorithm.dynamic_sampling and not cfg.use_reference
    assert "(sequence parallel: 4 data-parallel x SP groups of 2" in cfg.describe_layout(8)
    with pytest.raises(ConfigError, match="trainer.ulysses_size = 2 does not divide the world size 3"):
        preflight.validate(load_config(os.path.join(ROOT, "configs", "qwen1.5b-long.toml"),
                                       [*shape, "data.train_batch_size=3", "actor.ppo_mini_batch_size=3"]), world_size=3)
