"""The layout of one step's data on one rank.

Every sequence is one row: prompt tokens, then response tokens, then right padding.
Every per-token tensor (log-probs, values, advantages, ...) is [B, L] and aligned with
`input_ids`: column t belongs to token t (the log-prob of token t given tokens < t). Only
`response_mask` (1.0 on response tokens) decides which columns count.

Because rows are left-aligned and self-describing (`attention_mask`), token-budget micro-batches
(`plan_micro_batches`) and the packed layout (rows concatenated without padding, see
spmd_rl.batching.packing) only change how micro-batches are cut and how models are called; the trainer
and the loss functions see [b, L] micro-batches either way.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Iterator

import torch

from spmd_rl.batching import shared_prompts
from spmd_rl.model import routing
from spmd_rl.rollout.base import Completion
from spmd_rl.runtime.distributed import all_reduce_max_int
from spmd_rl.runtime.transfer import to_device


class HostColumns:
    """A [B, L] float32 CPU tensor filled with rows of device outputs, [b, l] at a time. The copies
    are queued without waiting (into pinned memory); `result()` waits for them once. Reading each
    copy at once would make the host wait for the GPU at every micro-batch and leave the GPU idle
    while the next one is launched."""

    def __init__(self, shape: torch.Size):
        self.out = torch.zeros(shape, dtype=torch.float32)
        self.pending: list[tuple[list[int] | torch.Tensor, torch.Tensor]] = []
        self.queued_on: set[torch.device] = set()  # devices with copies still in flight

    def put(self, rows: list[int] | torch.Tensor, values: torch.Tensor) -> None:
        values = values.detach()
        if values.device.type == "cuda":
            host = torch.empty(values.shape, dtype=torch.float32, pin_memory=True)
            self.pending.append((rows, host.copy_(values, non_blocking=True)))
            self.queued_on.add(values.device)
        else:
            self.pending.append((rows, values.to(torch.float32)))

    def result(self) -> torch.Tensor:
        for device in self.queued_on:
            torch.cuda.synchronize(device)  # every queued copy has landed
        for rows, values in self.pending:
            self.out[rows, :values.shape[1]] = values
        self.pending, self.queued_on = [], set()
        return self.out


@dataclass
class Batch:
    tensors: dict[str, torch.Tensor]
    """[B, ...] tensors; `input_ids`, `attention_mask`, `response_mask` always present."""
    meta: dict[str, list] = field(default_factory=dict)
    """Per-row Python values (data_source, ground_truth, ...)."""
    host: "Batch | None" = field(default=None, repr=False, compare=False)
    """On a batch made by `to(device)`: the CPU batch it was copied from, whose values the host can
    read without waiting for the device (the packed layout's boundaries, the rows' indices)."""

    def __len__(self) -> int:
        return self.tensors["input_ids"].shape[0]

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.tensors[key]

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        assert value.shape[0] == len(self), f"{key}: {value.shape[0]} rows, batch has {len(self)}"
        self.tensors[key] = value

    def __contains__(self, key: str) -> bool:
        return key in self.tensors

    def select(self, idx: torch.Tensor | list[int] | slice) -> "Batch":
        if isinstance(idx, slice):
            rows = list(range(len(self)))[idx]
        else:
            rows = [int(i) for i in idx]
        index = torch.tensor(rows, dtype=torch.long)
        return Batch({k: v[index.to(v.device)] for k, v in self.tensors.items()},
                     {k: [v[i] for i in rows] for k, v in self.meta.items()})

    def split(self, size: int) -> list["Batch"]:
        return [self.select(slice(i, i + size)) for i in range(0, len(self), size)]

    def to(self, device: torch.device) -> "Batch":
        """A copy on `device`, queued without waiting for the device (`to_device`); `host` keeps this
        batch, when it is on the CPU."""
        return Batch({k: to_device(v, device) for k, v in self.tensors.items()}, self.meta,
                     host=self if all(v.device.type == "cpu" for v in self.tensors.values()) else None)

    def trimmed(self) -> "Batch":
        """Drop columns that are padding in every row (micro-batches are shorter than the batch)."""
        length = int(self.tensors["attention_mask"].sum(-1).max())
        return Batch({k: v[:, :length] if v.dim() >= 2 and v.shape[1] == self.seq_len else v
                      for k, v in self.tensors.items()}, self.meta)

    @property
    def seq_len(self) -> int:
        return self.tensors["input_ids"].shape[1]

    @property
    def num_response_tokens(self) -> int:
        return int(self.tensors["response_mask"].sum())


def build_rollout_batch(prompts: list[list[int]], completions: list[list[Completion]], pad_id: int,
                        meta: dict[str, list] | None = None) -> Batch:
    """Rows for every (prompt, completion) pair: the n completions of a prompt are consecutive
    and share `group_id` (the prompt's position here). `meta` lists are per prompt and get
    repeated per completion.

    `response_lens` counts the whole response region (prompt_lens + response_lens = the row's
    tokens); `response_mask` marks the model's sampled tokens in it: all of them for a single-turn
    response, only the model's turns of a multi-turn trajectory (`Completion.mask`: the tool and
    environment tokens between turns are attended to, with mask 0 and rollout log-prob 0). A
    trajectory always ends on a model token, so the last masked column is the response's end.
    Environment rewards (`Completion.reward`) go to meta["env_reward"] (None where none was given), a
    trajectory's messages (`Completion.messages`) to meta["messages"].
    `has_rollout_logprobs` marks the rows whose completion came with the engine's log-probs
    (SamplingParams.logprobs_every); `rollout_logprobs` is 0 on the others. When any completion
    carries the engine's routing (`Completion.routes`), `routes` holds every row's
    (routing.rows_of_routes)."""
    rows, logps, masks, groups, finished = [], [], [], [], []
    for g, (p, comps) in enumerate(zip(prompts, completions)):
        for c in comps:
            rows.append((p, c.token_ids))
            logps.append(c.logprobs)
            masks.append(c.mask)
            groups.append(g)
            finished.append(c.finish_reason == "stop")
    length = max(len(p) + len(r) for p, r in rows)
    b = len(rows)
    input_ids = torch.full((b, length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros(b, length, dtype=torch.long)
    response_mask = torch.zeros(b, length, dtype=torch.float32)
    rollout_logprobs = torch.zeros(b, length, dtype=torch.float32)
    prompt_lens = torch.zeros(b, dtype=torch.long)
    for i, ((p, r), lp, m) in enumerate(zip(rows, logps, masks)):
        n = len(p) + len(r)
        input_ids[i, :n] = torch.tensor(p + r, dtype=torch.long)
        attention_mask[i, :n] = 1
        response_mask[i, len(p):n] = 1.0 if m is None else torch.tensor(m, dtype=torch.float32)
        if lp is not None:
            rollout_logprobs[i, len(p):n] = torch.tensor(lp, dtype=torch.float32)
        prompt_lens[i] = len(p)
    counts = [len(c) for c in completions]
    row_meta = {k: [v for v, c in zip(vals, counts) for _ in range(c)] for k, vals in (meta or {}).items()}
    if any(c.reward is not None for comps in completions for c in comps):
        row_meta["env_reward"] = [c.reward for comps in completions for c in comps]
    if any(c.messages is not None for comps in completions for c in comps):
        row_meta["messages"] = [c.messages for comps in completions for c in comps]
    tensors = dict(input_ids=input_ids, attention_mask=attention_mask, response_mask=response_mask,
                   rollout_logprobs=rollout_logprobs, has_rollout_logprobs=torch.tensor([lp is not None for lp in logps]),
                   prompt_lens=prompt_lens, response_lens=torch.tensor([len(r) for _, r in rows], dtype=torch.long),
                   group_ids=torch.tensor(groups, dtype=torch.long),
                   finished=torch.tensor(finished, dtype=torch.bool))
    routes = [c.routes for comps in completions for c in comps]
    if any(r is not None for r in routes):
        tensors[routing.BATCH_KEY] = routing.rows_of_routes(routes, length)
    return Batch(tensors, row_meta)


def response_token_ids(batch: Batch, i: int) -> list[int]:
    """The response region of row i: every token after the prompt (a multi-turn trajectory's tool
    and environment messages included), without padding."""
    start = int(batch["prompt_lens"][i])
    return batch["input_ids"][i, start:start + int(batch["response_lens"][i])].tolist()


def plan_micro_batches(lengths: list[int], micro_batch_size: int, max_tokens: int = 0,
                       prompts: tuple[list[int], list[list[int]]] | None = None) -> list[list[int]]:
    """Row indices of each micro-batch of a (mini-)batch whose rows have `lengths` real tokens.

    - `max_tokens <= 0`: consecutive rows, `micro_batch_size` per micro-batch.
    - `max_tokens > 0` (token budget, for packed rows): as few micro-batches as keep each within
      `max_tokens` real tokens, with the rows balanced by tokens across them (longest row first
      into the lightest micro-batch). Every rank ends up with the same number of micro-batches
      (the largest any rank needs): FSDP runs collectives in every forward, so ranks must make
      the same number of calls. A row longer than the budget gets a micro-batch of its own.
    - `prompts` (shared prompts: the rows' prompt lengths, and the rows grouped by prompt,
      shared_prompts.prompt_sets): with a budget, a prompt's rows go to one micro-batch where the
      budget allows, and the prompt counts once (shared_prompts.units).
    """
    n = len(lengths)
    if max_tokens <= 0:
        return [list(range(i, min(i + micro_batch_size, n))) for i in range(0, n, micro_batch_size)]
    if prompts is None:
        units, costs = [[i] for i in range(n)], list(lengths)
    else:
        units, costs = shared_prompts.units(lengths, prompts[0], prompts[1], max_tokens)
    k = max(1, -(-sum(costs) // max_tokens))
    while k < len(units) and max(sum(costs[i] for i in b) for b in balanced_partition(costs, k)) > max_tokens:
        k += 1
    k = min(all_reduce_max_int(k), -all_reduce_max_int(-n))  # agreed; never more than any rank's rows
    if len(units) < k:  # another rank needs more micro-batches: cut this rank's prompts' units
        units, costs = shared_prompts.split_until(units, costs, k, lengths, prompts[0])
    return [sorted(r for u in part for r in units[u]) for part in balanced_partition(costs, k)]


def balanced_partition(lengths: list[int], k: int) -> list[list[int]]:
    """Split row indices into `k` non-empty groups of similar total length (greedy: longest first,
    into the group with the fewest tokens so far). Each group lists its rows in batch order."""
    k = max(1, min(k, len(lengths)))
    groups: list[list[int]] = [[] for _ in range(k)]
    heap = [(0, g) for g in range(k)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        total, g = heapq.heappop(heap)
        groups[g].append(i)
        heapq.heappush(heap, (total + lengths[i], g))
    return [sorted(g) for g in groups]


def iter_micro_batches(batch: Batch, micro_batch_size: int, max_tokens: int = 0,
                       share_prompts: bool = False) -> Iterator[tuple[list[int], Batch]]:
    """(row indices, micro-batch trimmed to its longest row) per `plan_micro_batches`; with
    `share_prompts` (a model that takes shared prompts, spmd_rl.batching.shared_prompts), a prompt's rows
    kept together. `batch` is on the CPU."""
    lengths = batch["attention_mask"].sum(-1).tolist()
    prompts = None
    if share_prompts and "prompt_lens" in batch:
        prompt_lens = batch["prompt_lens"].tolist()
        prompts = (prompt_lens, shared_prompts.prompt_sets(batch["input_ids"], lengths, prompt_lens))
    for rows in plan_micro_batches(lengths, micro_batch_size, max_tokens, prompts):
        yield rows, batch.select(rows).trimmed()
