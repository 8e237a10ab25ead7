"""DAPO dynamic sampling (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System
at Scale"): prompt groups whose rewards are all equal carry no GRPO/RLOO signal (every advantage
is 0), so they are dropped and more prompts are generated until the step has its full number of
informative groups.

SPMD: every rank draws its own share of prompts each round (the next `ShardedSampler` batch, so
the data order, and a resumed run, stay deterministic) and keeps its own informative groups; the
ranks keep drawing together (generation and weight sync are collective) until every rank holds
`groups_per_rank`, so the step trains on exactly data.train_batch_size informative groups. The
surplus is discarded, as in DAPO.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch
import torch.distributed as dist

from spmd_rl.batching.batch import Batch

log = logging.getLogger("spmd_rl")


def group_rows(group_ids: torch.Tensor) -> list[list[int]]:
    """Row indices of each group, groups in order of first appearance."""
    groups: dict[int, list[int]] = {}
    for row, g in enumerate(group_ids.tolist()):
        groups.setdefault(g, []).append(row)
    return list(groups.values())


def is_informative(scores: torch.Tensor, rows: list[int]) -> bool:
    """Not all of the group's scores are equal (a group of one sample never is informative)."""
    s = scores[rows]
    return bool((s != s[0]).any())


def concat_batches(parts: list[Batch], pad_id: int) -> Batch:
    """Rows of every part, right-padded to the longest; group_ids renumbered so each part's
    groups stay distinct (parts come from different generate calls, each numbering from 0)."""
    length = max(p.seq_len for p in parts)
    tensors: dict[str, list[torch.Tensor]] = {k: [] for k in parts[0].tensors}
    offset = 0
    for p in parts:
        for k, v in p.tensors.items():
            if v.dim() >= 2 and v.shape[1] == p.seq_len and p.seq_len < length:
                pad = [0, 0] * (v.dim() - 2) + [0, length - p.seq_len]
                v = torch.nn.functional.pad(v, pad, value=pad_id if k == "input_ids" else 0)
            if k == "group_ids":
                uniq, v = torch.unique(v, return_inverse=True)
                v, n = v + offset, len(uniq)
                offset += n
            tensors[k].append(v)
    meta = {k: [x for p in parts for x in p.meta[k]] for k in parts[0].meta}
    return Batch({k: torch.cat(v) for k, v in tensors.items()}, meta)


def collect_informative_groups(draw: Callable[[int], Batch], groups_per_rank: int, max_rounds: int, pad_id: int,
                               device: torch.device) -> tuple[Batch, dict[str, float]]:
    """Call `draw(round)` (this rank's next scored rollout batch) until every rank holds
    `groups_per_rank` informative groups or `max_rounds` rounds are done; return this rank's
    training batch of exactly `groups_per_rank` groups and global metrics (sums over ranks):
    dynamic_sampling/rounds, drawn_groups, dropped_groups (uniform groups seen), train_groups,
    informative_groups (in the training batch) and padded_groups (uniform groups used to fill
    the step because max_rounds was reached)."""
    kept: list[Batch] = []
    dropped: list[Batch] = []
    drawn = rounds = 0
    while rounds < max_rounds:
        batch = draw(rounds)
        rounds += 1
        for rows in group_rows(batch["group_ids"]):
            drawn += 1
            (kept if is_informative(batch["scores"], rows) else dropped).append(batch.select(rows))
        if _global_min(len(kept), device) >= groups_per_rank:
            break
    informative = min(len(kept), groups_per_rank)
    padded = groups_per_rank - informative
    if _global_min(-padded, device) < 0:  # some rank is short: max_rounds reached
        log.warning("dynamic sampling: %d rounds gave too few informative groups; filling the step with "
                    "uniform ones (raise algorithm.dynamic_sampling_max_rounds)", rounds)
    parts = kept[:informative] + dropped[:padded]
    totals = torch.tensor([drawn, len(dropped), len(parts), informative, padded], dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(totals)
    drawn_g, dropped_g, train_g, info_g, padded_g = totals.tolist()
    metrics = {"dynamic_sampling/rounds": float(rounds), "dynamic_sampling/drawn_groups": drawn_g,
               "dynamic_sampling/dropped_groups": dropped_g, "dynamic_sampling/train_groups": train_g,
               "dynamic_sampling/informative_groups": info_g, "dynamic_sampling/padded_groups": padded_g}
    return concat_batches(parts, pad_id), metrics


def _global_min(value: int, device: torch.device) -> int:
    t = torch.tensor([value], dtype=torch.int64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())
