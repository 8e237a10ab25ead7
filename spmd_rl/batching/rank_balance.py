"""Sequence-length balancing across data-parallel ranks (verl's `balance_batch`, done SPMD).

Each rank generates rollouts for its own prompts, so a rank that drew long responses holds more
tokens than the others; FSDP's collectives run in every forward and backward, so all ranks wait
for it in every log-prob pass and every update micro-batch. `balance_ranks` moves rows between
ranks so that every rank holds (nearly) the same number of real tokens, before the passes that
dominate a step's training time (old / reference log-probs, values, critic and actor updates).

What it keeps, so that nothing downstream changes but the speed:
- every row exactly once, with every tensor and meta field; each rank keeps its row count;
- prompt groups (rows sharing `group_ids`) on one rank: GRPO / RLOO compare a group's samples
  on the rank that holds them, and the advantages are computed after this (they need the
  log-probs and values). Group ids are renumbered to stay distinct on the rank they land on;
- each mini-batch's rows: the update cuts every rank's rows into consecutive mini-batches, and a
  global mini-batch is the union of one slice per rank. Rows are only exchanged within a "block"
  (the same slice on every rank, as large as the actor's and critic's mini-batch slices both
  divide), so every optimizer step sees the same rows as without balancing, and the update is
  the same (losses are normalised by global counts, `update.global_denominator`). A block grows
  past that size only where a prompt group would otherwise be cut (rollout.n sequences per prompt
  not fitting a rank's mini-batch share), and then mini-batches mix the rows of those blocks.

The assignment is computed on every rank from all-gathered row lengths and groups, so all ranks
agree on it without further communication.
"""

from __future__ import annotations

import bisect
import heapq
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from spmd_rl.batching.batch import Batch
from spmd_rl.config.run_config import Config
from spmd_rl.model import routing

Placement = list[list[tuple[int, int]]]
"""placement[r] = the (source rank, source row) of every row rank r holds, in order."""


# --------------------------------------------------------------------------- partition


def karmarkar_karp(weights: list[int], k: int) -> list[list[int]]:
    """Indices of `weights` split into `k` parts of len(weights) / k items each, with sums as
    equal as the largest differencing method (Karmarkar-Karp) makes them. Deterministic.

    Items sorted by weight are dealt in consecutive chunks of k, one item per part, so every part
    gets the same count; then the two partial solutions with the largest spread are merged, the
    heaviest part of one with the lightest of the other, until one solution is left."""
    n = len(weights)
    if n % k:
        raise ValueError(f"{n} items do not split into {k} parts of equal count")
    order = sorted(range(n), key=lambda i: (weights[i], i))
    heap: list[tuple[int, int, list[tuple[int, list[int]]]]] = []
    for c in range(0, n, k):
        _push(heap, [(weights[i], [i]) for i in order[c:c + k]])
    while len(heap) > 1:
        a, b = heapq.heappop(heap)[2], heapq.heappop(heap)[2]
        heavy_first = sorted(a, key=lambda p: (-p[0], p[1]))
        light_first = sorted(b, key=lambda p: (p[0], p[1]))
        _push(heap, [(sa + sb, ia + ib) for (sa, ia), (sb, ib) in zip(heavy_first, light_first)])
    parts = [items for _, items in heap[0][2]] if heap else [[] for _ in range(k)]
    return sorted(sorted(p) for p in _refine_by_swaps(parts, weights))


def _refine_by_swaps(parts: list[list[int]], weights: list[int]) -> list[list[int]]:
    """Karmarkar-Karp's last merges can leave one part a large item heavier than the rest (a
    heavy-tailed length distribution does); swapping one item of the heaviest part for a lighter
    one of another part, by a difference close to half their gap, evens it out. Each swap lowers
    the sum of squared part sums, so this ends; counts stay equal."""
    parts = [list(p) for p in parts]
    sums = [sum(weights[i] for i in p) for p in parts]
    for _ in range(len(weights)):  # a cap on the rounds; each round costs O(n log n)
        heavy = max(range(len(parts)), key=lambda p: (sums[p], -p))
        for light in sorted(range(len(parts)), key=lambda p: (sums[p], p)):
            swap = _best_swap(parts[heavy], parts[light], sums[heavy] - sums[light], weights)
            if swap is not None:
                break
        else:
            return parts
        a, b = swap
        parts[heavy][parts[heavy].index(a)], parts[light][parts[light].index(b)] = b, a
        sums[heavy] += weights[b] - weights[a]
        sums[light] += weights[a] - weights[b]
    return parts


def _best_swap(heavy: list[int], light: list[int], gap: int, weights: list[int]) -> tuple[int, int] | None:
    """(item of `heavy`, item of `light`) whose weight difference d is closest to gap / 2 with
    0 < d < gap (the larger of the two sums then drops), or None."""
    by_weight = sorted(light, key=lambda i: (weights[i], i))
    light_w = [weights[i] for i in by_weight]
    best, best_score = None, None
    for a in sorted(heavy):
        pos = bisect.bisect_left(light_w, weights[a] - gap / 2)
        for j in (pos - 1, pos):
            if 0 <= j < len(by_weight):
                d = weights[a] - light_w[j]
                if 0 < d < gap and (best_score is None or abs(2 * d - gap) < best_score):
                    best, best_score = (a, by_weight[j]), abs(2 * d - gap)
    return best


def _push(heap: list, parts: list[tuple[int, list[int]]]) -> None:
    sums = [s for s, _ in parts]
    # the counter (smallest item) breaks ties between equal spreads deterministically
    heapq.heappush(heap, (-(max(sums) - min(sums)), min(min(i) for _, i in parts), parts))


# --------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class Unit:
    """Rows that must stay together (one prompt group within one block) on their source rank."""
    rank: int
    rows: tuple[int, ...]
    tokens: int


def block_bounds(groups: list[list[int]], block_rows: int) -> list[tuple[int, int]]:
    """[start, end) row ranges of the blocks: every `block_rows` rows, except that no boundary
    cuts a group on any rank. Every rank has the same number of rows."""
    n = len(groups[0])
    cut_ok = [True] * (n + 1)
    for ids in groups:
        last_row: dict[int, int] = {}
        for row, g in enumerate(ids):
            for t in range(last_row.get(g, row) + 1, row + 1):  # no cut between two rows of g
                cut_ok[t] = False
            last_row[g] = row
    cuts = [t for t in range(block_rows, n, block_rows) if cut_ok[t]]
    edges = [0, *cuts, n]
    return list(zip(edges[:-1], edges[1:]))


def block_units(lengths: list[list[int]], groups: list[list[int]], start: int, end: int) -> list[Unit]:
    units = []
    for rank, (lens, ids) in enumerate(zip(lengths, groups)):
        rows_of: dict[int, list[int]] = {}
        for row in range(start, end):
            rows_of.setdefault(ids[row], []).append(row)
        units += [Unit(rank, tuple(rows), sum(lens[r] for r in rows)) for rows in rows_of.values()]
    return units


def assign_block(units: list[Unit], world: int) -> list[list[Unit]]:
    """Units of one block per destination rank. Balanced when the units can be dealt evenly
    (as many of the same size per rank: the trainer's case, every group has rollout.n rows) and
    that lowers the busiest rank's tokens; otherwise every unit stays where it is (no traffic,
    each rank keeps its row count)."""
    stay = [[u for u in units if u.rank == r] for r in range(world)]
    if len({len(u.rows) for u in units}) > 1 or len(units) % world:
        return stay
    parts = [[units[i] for i in part] for part in karmarkar_karp([u.tokens for u in units], world)]
    if _busiest(parts) >= _busiest(stay):
        return stay
    return _fewest_moves(parts, world)


def _busiest(parts: list[list[Unit]]) -> int:
    return max(sum(u.tokens for u in part) for part in parts)


def _fewest_moves(parts: list[list[Unit]], world: int) -> list[list[Unit]]:
    """Give each part to a rank that already holds many of its rows (greedy on overlap), so
    fewer rows travel; any assignment is equally balanced."""
    overlap = sorted(((-sum(len(u.rows) for u in part if u.rank == r), p, r)
                      for p, part in enumerate(parts) for r in range(world)))
    owner: dict[int, int] = {}
    taken: set[int] = set()
    for _, p, r in overlap:
        if p not in owner and r not in taken:
            owner[p] = r
            taken.add(r)
    by_rank = {r: parts[p] for p, r in owner.items()}
    return [by_rank[r] for r in range(world)]


def plan_placement(lengths: list[list[int]], groups: list[list[int]], block_rows: int) -> Placement:
    """Where every row goes: `lengths[r][i]` / `groups[r][i]` are the real tokens and group id of
    row i of rank r. Within each block a rank's rows are ordered by (source rank, source row)."""
    world = len(lengths)
    placement: Placement = [[] for _ in range(world)]
    for start, end in block_bounds(groups, block_rows):
        for rank, units in enumerate(assign_block(block_units(lengths, groups, start, end), world)):
            placement[rank] += sorted((u.rank, row) for u in units for row in u.rows)
    return placement


def max_over_mean(lengths: list[list[int]], placement: Placement, bounds: list[tuple[int, int]]) -> float:
    """Tokens of the busiest rank over the mean, summed over the blocks (each mini-batch of the
    update waits for its busiest rank)."""
    busiest = mean = 0.0
    for start, end in bounds:
        per_rank = [sum(lengths[s][i] for s, i in rows[start:end]) for rows in placement]
        busiest += max(per_rank)
        mean += sum(per_rank) / len(per_rank)
    return busiest / mean if mean else 1.0


def identity_placement(lengths: list[list[int]]) -> Placement:
    return [[(r, i) for i in range(len(lens))] for r, lens in enumerate(lengths)]


# --------------------------------------------------------------------------- the exchange


def exchange_rows(batch: Batch, placement: Placement, width: int, pad_id: int) -> Batch:
    """Collective: this rank's rows of `placement`, every tensor and meta field, per-token tensors
    right-padded to `width` columns (input_ids with `pad_id`, the others with 0 or `_PAD`'s value) before they travel.

    Tensors go by all_to_all_single (gloo and NCCL), one field at a time: beyond its batch a rank
    holds one field's send copy and its received rows (about twice that field), not the world's
    rows as an all_gather would. Meta (Python values) goes by all_gather_object: every rank
    briefly holds all ranks' meta, small next to the tensors."""
    me, world = dist.get_rank(), dist.get_world_size()
    mine = placement[me]
    send = [row for dest in placement for src, row in dest if src == me]  # grouped by destination
    send_counts = [sum(src == me for src, _ in dest) for dest in placement]
    recv_counts = [sum(src == s for src, _ in mine) for s in range(world)]
    # rows arrive grouped by source rank, each source's rows in the order `mine` lists them
    arrival = [i for s in range(world) for i, (src, _) in enumerate(mine) if src == s]
    to_mine = torch.argsort(torch.tensor(arrival, dtype=torch.long))
    index = torch.tensor(send, dtype=torch.long)
    tensors = {}
    for key, value in batch.tensors.items():
        if _per_token(value, batch):
            value = _pad_columns(value, width, _PAD.get(key, 0) if key != "input_ids" else pad_id)
        received = _all_to_all_rows(value[index.to(value.device)], send_counts, recv_counts)
        tensors[key] = received[to_mine.to(received.device)]
    metas: list = [None] * world
    dist.all_gather_object(metas, batch.meta)
    meta = {k: [metas[s][k][i] for s, i in mine] for k in batch.meta}
    return Batch(tensors, meta).trimmed()  # rows from a wider rank may have left columns of padding only


_PAD = {routing.BATCH_KEY: routing.NO_ROUTE}
"""Per-token fields whose padding is not 0 (input_ids': the pad token)."""


def _per_token(t: torch.Tensor, batch: Batch) -> bool:
    return t.dim() >= 2 and t.shape[1] == batch.seq_len


def _pad_columns(t: torch.Tensor, width: int, value: int) -> torch.Tensor:
    pad = [0, 0] * (t.dim() - 2) + [0, width - t.shape[1]]
    return torch.nn.functional.pad(t, pad, value=value)


def _all_to_all_rows(rows: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
    """Rows to each rank by `send_counts`, from each by `recv_counts`, on the tensor's device.
    NCCL moves CUDA tensors only (a CPU batch makes the round trip through the current GPU);
    bool travels as uint8, which every backend reduces and copies, and int16 (the routes) as its
    bytes, which neither NCCL nor gloo takes as such."""
    device, dtype = rows.device, rows.dtype
    comm = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else device
    x = rows.to(comm, torch.uint8 if dtype == torch.bool else dtype).contiguous()
    if dtype == torch.int16:
        x = x.view(torch.uint8)  # the last dimension's bytes
    out = x.new_empty((sum(recv_counts), *x.shape[1:]))
    dist.all_to_all_single(out, x, recv_counts, send_counts)
    if dtype == torch.int16:
        out = out.view(torch.int16)
    return out.to(device, dtype)


# --------------------------------------------------------------------------- the step


def mini_batch_block_rows(cfg: Config, world: int) -> int:
    """Rows per rank that every mini-batch of the update (actor, and critic if used) is a whole
    number of: rows are exchanged only within such blocks, so mini-batches keep their rows."""
    n = cfg.rollout.n
    sizes = [cfg.actor.mini_batch_rows(n, world)]
    if cfg.use_critic:
        sizes.append(cfg.critic.mini_batch_rows(n, world))
    return max(1, math.gcd(*sizes))


def balance_ranks(batch: Batch, cfg: Config, pad_id: int) -> tuple[Batch, dict[str, float]]:
    """Collective (when on): this rank's rows after balancing, and the metrics
    batch/rank_tokens_max_over_mean_before / _after. Off (trainer.balance_ranks = false) or one
    rank: the batch as it is, no metrics."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if not cfg.trainer.balance_ranks or world == 1:
        return batch, {}
    info = _gather_row_info(_with_group_ids(batch), world)
    lengths, groups = [i["lengths"] for i in info], [i["groups"] for i in info]
    block = mini_batch_block_rows(cfg, world)
    placement = plan_placement(lengths, groups, block)
    bounds = block_bounds(groups, block)
    metrics = {"batch/rank_tokens_max_over_mean_before": max_over_mean(lengths, identity_placement(lengths), bounds),
               "batch/rank_tokens_max_over_mean_after": max_over_mean(lengths, placement, bounds)}
    # group ids count from 0 on every rank: offset them by rank so groups stay apart wherever they land
    span = 1 + max(max(g, default=-1) for g in groups)
    batch = _with_group_ids(batch, offset=dist.get_rank() * span)
    return exchange_rows(batch, placement, max(i["width"] for i in info), pad_id), metrics


def _with_group_ids(batch: Batch, offset: int = 0) -> Batch:
    """The batch with `group_ids` + offset; without group ids (a batch of one row per group, as
    in tests) every row is its own group."""
    ids = batch["group_ids"] if "group_ids" in batch else torch.arange(len(batch))
    return Batch({**batch.tensors, "group_ids": ids + offset}, batch.meta)


def _gather_row_info(batch: Batch, world: int) -> list[dict]:
    """Every rank's row lengths (real tokens: prompt + response), group ids, width and tensor
    layout. Ranks whose rows or fields differ cannot be balanced into the same update: every rank
    sees the same gathered lists, so all raise together instead of hanging in the exchange."""
    mine = {"lengths": batch["attention_mask"].sum(-1).tolist(), "groups": batch["group_ids"].tolist(),
            "width": batch.seq_len, "meta": sorted(batch.meta),
            "fields": sorted((k, str(v.dtype), tuple(v.shape[2:] if _per_token(v, batch) else v.shape[1:]))
                             for k, v in batch.tensors.items())}
    info: list = [None] * world
    dist.all_gather_object(info, mine)
    if any(len(i["lengths"]) != len(info[0]["lengths"]) or i["fields"] != info[0]["fields"]
           or i["meta"] != info[0]["meta"] for i in info):
        raise ValueError("balance_ranks: the ranks hold different numbers of rows or different fields (rows per "
                         f"rank: {[len(i['lengths']) for i in info]}); they must share one layout")
    return info
