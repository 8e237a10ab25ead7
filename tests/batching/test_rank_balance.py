"""Balancing rows across ranks (spmd_rl.batching.rank_balance): the plan evens out tokens and keeps every
row, group and mini-batch; the exchange delivers every field intact; the update with balancing
is the update without it, for every loss aggregation mode."""

import random

import pytest
import torch

from spmd_rl.batching.rank_balance import (
    block_bounds,
    identity_placement,
    karmarkar_karp,
    max_over_mean,
    plan_placement,
)
from tests.helpers.dist_utils import run_distributed

MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")


def skewed_lengths(seed, ranks, rows):
    """Rank 0 drew long responses, the others short ones (and some long)."""
    rnd = random.Random(seed)
    return [[rnd.randint(400, 1000) if r == 0 or rnd.random() < 0.1 else rnd.randint(20, 120) for _ in range(rows)]
            for r in range(ranks)]


# --------------------------------------------------------------------------- (a) the plan


def test_karmarkar_karp_evens_out_skewed_lengths_in_equal_counts_deterministically():
    rnd = random.Random(0)
    weights = [int(rnd.lognormvariate(5, 1.2)) for _ in range(256)]
    parts = karmarkar_karp(weights, 8)
    assert sorted(i for p in parts for i in p) == list(range(256))
    assert {len(p) for p in parts} == {32}
    sums = [sum(weights[i] for i in p) for p in parts]
    consecutive = [sum(weights[i * 32:(i + 1) * 32]) for i in range(8)]
    assert max(consecutive) / (sum(weights) / 8) > 1.2  # the input really is unbalanced
    assert max(sums) / (sum(weights) / 8) < 1.01, sums
    assert karmarkar_karp(list(weights), 8) == parts


def test_plan_keeps_each_row_once_groups_together_and_mini_batches_whole():
    ranks, rows, n, block = 4, 48, 4, 16
    lengths = skewed_lengths(1, ranks, rows)
    groups = [[i // n for i in range(rows)] for _ in range(ranks)]
    placement = plan_placement(lengths, groups, block)
    assert sorted(x for p in placement for x in p) == sorted((r, i) for r in range(ranks) for i in range(rows))
    assert all(len(p) == rows for p in placement)
    for p in placement:
        for start in range(0, rows, block):  # a rank's block `start` holds rows of block `start` only
            assert all(start <= i < start + block for _, i in p[start:start + block])
    where = {(s, groups[s][i]): r for r, p in enumerate(placement) for s, i in p}
    assert all(where[(s, groups[s][i])] == r for r, p in enumerate(placement) for s, i in p)  # groups stay whole
    bounds = block_bounds(groups, block)
    before = max_over_mean(lengths, identity_placement(lengths), bounds)
    after = max_over_mean(lengths, placement, bounds)
    assert before > 2.0 and after < 1.1, (before, after)
    assert plan_placement(lengths, groups, block) == placement


def test_blocks_grow_rather_than_cut_a_group():
    groups = [[i // 3 for i in range(12)], [i // 3 for i in range(12)]]
    assert block_bounds(groups, 2) == [(0, 6), (6, 12)]
    assert block_bounds(groups, 4) == [(0, 12)]
    assert block_bounds([[i for i in range(8)]] * 2, 4) == [(0, 4), (4, 8)]


def test_blocks_that_cannot_be_dealt_evenly_or_are_even_already_stay_in_place():
    lengths = [[100, 100, 5], [5, 5, 5]]
    groups = [[0, 0, 1], [0, 1, 2]]  # units of 2 and 1 rows: no equal deal keeps the row counts
    assert plan_placement(lengths, groups, 3) == identity_placement(lengths)
    even = [[10, 30, 20, 20, 7, 9], [25, 15, 5, 35, 8, 8]]  # 96 | 96: an equal split exists, but no gain in moving
    assert plan_placement(even, [list(range(6))] * 2, 6) == identity_placement(even)
    uneven = [[30, 30, 20, 20], [10, 10, 5, 35]]
    assert plan_placement(uneven, [[0, 1, 2, 3]] * 2, 2) != identity_placement(uneven)


# --------------------------------------------------------------------------- (b) the exchange


def rank_batch(rank, rows=8, pad_id=7):
    """A batch shaped like the trainer's, wider on rank 0, with a field of every kind."""
    from spmd_rl.batching.batch import Batch

    g = torch.Generator().manual_seed(rank)
    width = 14 if rank == 0 else 9
    lens = torch.randint(width // 2, width + 1, (rows,), generator=g)
    attn = (torch.arange(width)[None, :] < lens[:, None]).long()
    prompt = torch.full((rows,), 3)
    resp = (attn.bool() & (torch.arange(width)[None, :] >= prompt[:, None])).float()
    ids = torch.where(attn.bool(), torch.randint(10, 50, (rows, width), generator=g), pad_id)
    return Batch(dict(input_ids=ids, attention_mask=attn, response_mask=resp,
                      rollout_logprobs=-torch.rand(rows, width, generator=g) * resp,
                      prompt_lens=prompt, response_lens=resp.sum(-1).long(),
                      group_ids=torch.arange(rows) // 2, finished=torch.rand(rows, generator=g) > 0.5,
                      scores=torch.randn(rows, generator=g), extra=torch.randn(rows, 3, generator=g),
                      uid=torch.arange(rows) + 100 * rank),
                 {"data_source": [f"src{rank}"] * rows, "extra_info": [{"row": i, "rank": rank} for i in range(rows)]})


def balance_config(**kw):
    from spmd_rl.config.run_config import Config

    cfg = Config()
    cfg.rollout.n = 2
    cfg.data.train_batch_size = 8
    cfg.actor.ppo_mini_batch_size = 4  # on 2 ranks: 8 rows per rank in 2 mini-batches of 4
    for key, value in kw.items():
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, value)
    return cfg


def _exchange_body(rank, world):
    import torch.distributed as dist

    from spmd_rl.batching.rank_balance import balance_ranks

    pad_id = 7
    mine = rank_batch(rank, pad_id=pad_id)
    got, metrics = balance_ranks(mine, balance_config(), pad_id)
    originals, results = [None] * world, [None] * world
    dist.all_gather_object(originals, mine)
    dist.all_gather_object(results, got)

    source = {int(b["uid"][i]): (b, i) for b in originals for i in range(len(b))}
    uids = [int(u) for b in results for u in b["uid"]]
    assert sorted(uids) == sorted(source), "every row arrives exactly once"
    assert [len(b) for b in results] == [len(b) for b in originals]
    for b in results:  # each mini-batch's rows (4 per rank) stay in that mini-batch
        assert all(i // 4 == int(u) % 100 // 4 for i, u in enumerate(b["uid"])), b["uid"]
    assert any(int(u) // 100 != r for r, b in enumerate(results) for u in b["uid"]), "some rows must move"
    new_group = {}
    for b in results:
        for i in range(len(b)):
            orig, j = source[int(b["uid"][i])]
            for key, value in orig.tensors.items():
                want, have = value[j], b[key][i]
                if key == "group_ids":
                    continue
                if value.dim() >= 2 and value.shape[1] == orig.seq_len:  # per token: padding may differ in width
                    pad = pad_id if key == "input_ids" else 0
                    w = min(len(want), len(have))
                    assert torch.equal(want[:w], have[:w]), key
                    assert (want[w:] == pad).all() and (have[w:] == pad).all(), key
                else:
                    assert torch.equal(want, have), key
            for key, values in orig.meta.items():
                assert b.meta[key][i] == values[j], key
            new_group.setdefault((int(orig["uid"][j]) // 100, int(orig["group_ids"][j])), set()).add(int(b["group_ids"][i]))
    assert all(len(ids) == 1 for ids in new_group.values()), "a group keeps one id"
    assert len({next(iter(ids)) for ids in new_group.values()}) == len(new_group), "groups of different ranks stay apart"
    def max_over_mean(batches):  # per mini-batch, summed over them
        per_mini = [[int(b["attention_mask"][m:m + 4].sum()) for b in batches] for m in (0, 4)]
        return sum(max(t) for t in per_mini) / sum(sum(t) / world for t in per_mini)

    assert metrics["batch/rank_tokens_max_over_mean_after"] == pytest.approx(max_over_mean(results))
    assert metrics["batch/rank_tokens_max_over_mean_before"] == pytest.approx(max_over_mean(originals))
    assert metrics["batch/rank_tokens_max_over_mean_after"] < metrics["batch/rank_tokens_max_over_mean_before"]

    off, none = balance_ranks(mine, balance_config(**{"trainer.balance_ranks": False}), pad_id)
    assert off is mine and none == {}


def test_exchange_delivers_every_row_and_field_intact():
    run_distributed(_exchange_body, 2)


# --------------------------------------------------------------------------- (c) the update


def update_batch(rank, rows=8):
    """Rank 0's responses are long, rank 1's short; groups of 2 rows; two mini-batches."""
    from spmd_rl.batching.batch import Batch

    g = torch.Generator().manual_seed(10 + rank)
    L = 16
    ids = torch.randint(2, 50, (rows, L), generator=g)
    attn = torch.zeros(rows, L, dtype=torch.long)
    resp = torch.zeros(rows, L)
    for i in range(rows):
        p = int(torch.randint(2, 4, (1,), generator=g))
        r = int(torch.randint(8, L - p + 1, (1,), generator=g)) if rank == 0 else int(torch.randint(1, 4, (1,), generator=g))
        attn[i, :p + r] = 1
        resp[i, p:p + r] = 1
    return Batch(dict(input_ids=ids * attn, attention_mask=attn, response_mask=resp,
                      old_logprobs=(-torch.rand(rows, L, generator=g) * 3) * resp,
                      advantages=torch.randn(rows, L, generator=g) * resp,
                      group_ids=torch.arange(rows) // 2))


def _update_body(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from spmd_rl.batching.rank_balance import balance_ranks
    from spmd_rl.config.actor import ActorConfig
    from spmd_rl.model.loading import apply_fsdp, prepare_policy
    from spmd_rl.train.actor import actor_loss_fn
    from spmd_rl.train.update import ppo_update

    mesh = init_device_mesh("cpu", (world,))
    mine = update_batch(rank)
    rows = len(mine)
    cfg = balance_config(**{"data.train_batch_size": 8, "actor.ppo_mini_batch_size": 4})  # 4 rows per rank per mini
    balanced, metrics = balance_ranks(mine, cfg, 0)
    assert metrics["batch/rank_tokens_max_over_mean_after"] < metrics["batch/rank_tokens_max_over_mean_before"] - 0.2
    for mode in MODES:
        deltas = []
        for batch in (mine, balanced):
            torch.manual_seed(0)
            model = Qwen2ForCausalLM(Qwen2Config(vocab_size=50, hidden_size=32, intermediate_size=48,
                                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            apply_fsdp(prepare_policy(model, True, True), mesh, torch.float32)
            opt = torch.optim.SGD(model.parameters(), lr=1.0)  # delta = -(sum of the two steps' gradients)
            ppo_update(model, opt, batch, actor_loss_fn(model, ActorConfig(loss_agg_mode=mode), 1.0),
                       mini_batch_size=rows // 2, micro_batch_size=1, epochs=1, grad_clip=0.0, loss_agg_mode=mode,
                       device=torch.device("cpu"), max_tokens=20)
            deltas.append({n: before[n] - p.full_tensor() for n, p in model.named_parameters()})
        off, on = deltas
        assert max(float(d.abs().max()) for d in off.values()) > 1e-3  # the update really moved the weights
        for n in off:
            torch.testing.assert_close(on[n], off[n], rtol=1e-4, atol=1e-6, msg=f"{mode} {n}")


def test_balanced_update_equals_unbalanced_update_for_every_loss_mode():
    run_distributed(_update_body, 2)
