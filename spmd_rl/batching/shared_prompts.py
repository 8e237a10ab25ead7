"""A prompt fed once per packed micro-batch, however many of its responses the micro-batch holds
(model.share_prompts).

GRPO samples n responses per prompt, and a packed micro-batch (spmd_rl.batching.packing) holds each
of them whole, its prompt included: the model runs n times over the same prompt tokens and gets the
same numbers each time, since a prompt token attends to the prompt only. With shared prompts the
packed row holds each distinct prompt once, followed by the response regions of the rows that begin
with it:

    [prompt A][response A1][response A2] ... [prompt B][response B1] ...

- positions: a response's tokens keep their columns (its prompt's positions, continued);
- attention (spmd_rl.model.varlen_attention, KV_INDEX): a prompt attends causally to itself; a
  response to all of its prompt and causally to itself, never to another response;
- outputs (`output_rows`): column t of row r (the log-prob of token t, the critic's value before it)
  comes from the hidden state of the token before it: the response's own previous token, or, for the
  response's first token, the prompt's last (one position read by every response of the prompt). Only
  the response region's columns get one; the others are 0, as padding's are (every loss and metric
  reads the responses only);
- gradients: a shared position gets the sum of what its responses send back (row_gather: added in
  float32), as its n copies would have got between them.

Rows share a prompt when their prompt tokens are the same (a GRPO group's rows always are). With a
token budget, `units` keeps a prompt's rows in one micro-batch where the budget allows and counts the
prompt once (spmd_rl.batching.batch.plan_micro_batches).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from spmd_rl.batching.packing import empty_mask
from spmd_rl.model.varlen_attention import KV_INDEX
from spmd_rl.runtime.transfer import to_device


def prompt_sets(input_ids: torch.Tensor, lengths: list[int], prompt_lens: list[int]) -> list[list[int]]:
    """Row indices grouped by prompt (the same prompt length and tokens), each group in row order, the
    groups in order of their first row. `input_ids`: [b, L] on the CPU."""
    sets: dict[tuple[int, bytes], list[int]] = {}
    for r, (n, p) in enumerate(zip(lengths, prompt_lens)):
        p = min(p, n)
        sets.setdefault((p, input_ids[r, :p].numpy().tobytes()), []).append(r)
    return list(sets.values())


@dataclass
class HostLayout:
    """The packed row of a micro-batch with each prompt once, as CPU index tensors (`lay_out`)."""

    rows: torch.Tensor
    cols: torch.Tensor
    """[T] each packed token's row and column in the micro-batch (its column is its position)."""
    seg_q: list[int]
    """The packed row's sequences in order: a prompt's tokens, or one response's."""
    kv_index: torch.Tensor
    seg_k: list[int]
    """Each sequence's keys, by packed position: a prompt's own; a response's prompt, then its own."""
    out_rows: torch.Tensor
    out_cols: torch.Tensor
    out_at: torch.Tensor
    """[N] each response column (row, column) and the packed position that predicts it."""


def lay_out(input_ids: torch.Tensor, lengths: list[int], prompt_lens: list[int]) -> HostLayout:
    """The packed row of the module doc for a micro-batch's CPU `input_ids` [b, L]."""
    rows, cols, seg_q, kv, out_r, out_c, out_at = [], [], [], [], [], [], []
    pos = 0
    for members in prompt_sets(input_ids, lengths, prompt_lens):
        p = _prompt_len(members, lengths, prompt_lens)
        start = pos  # the prompt's first packed position
        prompt = torch.arange(start, start + p)
        if p:
            rows.append(torch.full((p,), members[0]))
            cols.append(torch.arange(p))
            seg_q.append(p)
            kv.append(prompt)
            pos += p
        for r in members:
            n = lengths[r] - p
            if n <= 0:
                continue
            rows.append(torch.full((n,), r))
            cols.append(torch.arange(p, lengths[r]))
            seg_q.append(n)
            kv.append(torch.cat([prompt, torch.arange(pos, pos + n)]))
            # column t's output is read where token t - 1 is: the prompt's last position, or the response's
            before = torch.arange(max(p, 1), lengths[r]) - 1
            out_r.append(torch.full_like(before, r))
            out_c.append(before + 1)
            out_at.append(torch.where(before < p, start + before, pos + before - p))
            pos += n
    return HostLayout(_cat_long(rows), _cat_long(cols), seg_q, _cat_long(kv), [len(x) for x in kv],
                      _cat_long(out_r), _cat_long(out_c), _cat_long(out_at))


class SharedPromptLayout:
    """A micro-batch as one packed row with each prompt once (the module doc). `host`: the micro-batch's
    CPU copy (Batch.host) when it is on a GPU: the row is laid out there and the indices copied over
    without waiting for the GPU (as packing.PackedLayout does)."""

    def __init__(self, mb, host=None):
        host = mb if host is None else host
        self.shape = mb["input_ids"].shape
        plan = lay_out(host["input_ids"].cpu(), host["attention_mask"].sum(1).tolist(), host["prompt_lens"].tolist())
        device = mb["input_ids"].device
        self.rows, self.cols, out_r, out_c = (to_device(x, device) for x in (plan.rows, plan.cols, plan.out_rows,
                                                                             plan.out_cols))
        self.output_rows = to_device(plan.out_at, device)
        """[N] packed positions whose hidden states predict the N response columns (the model's logprob_rows)."""
        self.out_index = (out_r, out_c)
        cu_q, cu_k = (to_device(F.pad(torch.tensor(s, dtype=torch.int32).cumsum(0, dtype=torch.int32), (1, 0)), device)
                      for s in (plan.seg_q, plan.seg_k))
        ids = mb["input_ids"]
        self.inputs = {"input_ids": ids[self.rows, self.cols][None], "position_ids": self.cols[None],
                       "attention_mask": empty_mask(device), "cu_seq_lens_q": cu_q, "cu_seq_lens_k": cu_k,
                       "max_length_q": max(plan.seg_q, default=0), "max_length_k": max(plan.seg_k, default=0),
                       KV_INDEX: to_device(plan.kv_index, device)}
        self.targets = ids[out_r, out_c][None]
        self.num_tokens = len(plan.rows)

    def to_columns(self, out: torch.Tensor) -> torch.Tensor:
        """[1, N] outputs at `output_rows` -> [b, L] columns; columns outside the responses get 0."""
        return out.new_zeros(self.shape).index_put(self.out_index, out[0])

    def token_rows(self, x: torch.Tensor) -> torch.Tensor:
        """[b, L, ...] per-token values -> [T, ...], the packed row's tokens in order (a shared prompt's
        from the first of its rows)."""
        return x[self.rows, self.cols]


def _prompt_len(rows: list[int], lengths: list[int], prompt_lens: list[int]) -> int:
    """The prompt length of rows that share a prompt (prompt_sets): the first row's, within its length."""
    return min(prompt_lens[rows[0]], lengths[rows[0]])


def _cat_long(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(parts).long() if parts else torch.zeros(0, dtype=torch.long)


def units(lengths: list[int], prompt_lens: list[int], sets: list[list[int]], max_tokens: int
          ) -> tuple[list[list[int]], list[int]]:
    """The rows of `sets` (prompt_sets) cut into units that a token-budget micro-batch takes whole, and
    each unit's tokens with its prompt counted once: a prompt's rows in as few units as each keep within
    `max_tokens` (a row longer than the budget alone), in row order."""
    out, costs = [], []
    for rows in sets:
        p = _prompt_len(rows, lengths, prompt_lens)
        unit, cost = [], p
        for r in rows:
            extra = lengths[r] - p
            if unit and cost + extra > max_tokens:
                out.append(unit)
                costs.append(cost)
                unit, cost = [], p
            unit.append(r)
            cost += extra
        out.append(unit)
        costs.append(cost)
    return out, costs


def split_until(units_: list[list[int]], costs: list[int], count: int, lengths: list[int],
                prompt_lens: list[int]) -> tuple[list[list[int]], list[int]]:
    """Units halved, the one of most rows first, until there are `count` (at most the rows)."""
    units_, costs = list(units_), list(costs)
    while len(units_) < count:
        i = max(range(len(units_)), key=lambda j: len(units_[j]))
        rows = units_.pop(i)
        costs.pop(i)
        p = _prompt_len(rows, lengths, prompt_lens)
        for half in (rows[:len(rows) // 2], rows[len(rows) // 2:]):
            units_.append(half)
            costs.append(p + sum(lengths[r] - p for r in half))
    return units_, costs
