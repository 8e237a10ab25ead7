"""Ulysses sequence parallelism (DeepSpeed-Ulysses; verl's ulysses_sequence_parallel_size):
`trainer.ulysses_size` consecutive ranks share each packed micro-batch, every rank holding one
slice of its tokens, so one sequence's activations no longer have to fit on one GPU.

What changes, and where:

- groups (`sp_groups.make_groups`): the ranks form world / size SP groups of `size` consecutive ranks and,
  across them, `size` data-parallel groups (one rank of every SP group each). Data parallelism is
  over the SP groups: world / size of them (`SPGroups.dp_size`).
- rows (`share_rows`): rollout stays per rank (every rank generates for its own prompts); then the
  ranks of an SP group exchange their rows so that each holds all of the group's rows, in the
  same order. Every global mini-batch keeps the rows it has without sequence parallelism (rows
  are interleaved in the blocks rank_balance keeps), so the update is the same.
- inputs (`SlicedLayout`): the packed row (spmd_rl.batching.packing) is right-padded to a multiple of
  `size` and cut into `size` equal slices of consecutive tokens; a rank's model input is its
  slice of input ids and position ids (the global positions, for the rotary embedding), and its
  targets are its slice of the targets shifted on the whole row. The sequence boundaries
  (cu_seq_lens) stay the whole row's, the padding one sequence more.
- attention (`ulysses_attention_forward`, a transformers attention backend): q, k, v go from
  [tokens / size, heads] to [tokens, heads / size] by one all-to-all each, the variable-length
  attention of spmd_rl.model.varlen_attention runs on whole sequences for a share of the heads, and one
  all-to-all takes the output back. Everything else in a layer works per token on the slice.
  KV heads fewer than `size` (but dividing it) are replicated first, as verl does.
- outputs (`SlicedLayout.to_columns`): the per-token outputs of the slices (log-probs and entropy
  of the log-prob head, the critic's values) are all-gathered, unpadded and scattered to columns
  as for an unsliced packed row. Every rank of the group then holds the whole micro-batch's
  outputs and computes the same loss on it.

Gradients. The loss of every rank counts (FSDP averages the gradients of all ranks), so an SP
group's objective is the sum of its ranks' identical losses, and the backward of the gather is
its true adjoint: the gradients of a rank's slice summed over the group (`_GatherSequence`), here
an all-reduce of the [tokens] gradient, then the slice. The loss denominator counts each rank's
(shared) rows, as without sequence parallelism (update.global_denominator): with `size` copies of
every row in the count and `size` identical losses per group, ulysses_size = 2 gives the gradients
of ulysses_size = 1 (tests/batching/test_sequence_parallel.py).
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.distributed as dist
import torch.nn.functional as F

from spmd_rl.batching import packing
from spmd_rl.batching.packing import PackedLayout
from spmd_rl.batching.shared_prompts import SharedPromptLayout
from spmd_rl.runtime.sp_groups import SPGroups, head_problem, kv_replication, sp_group_ranks

log = logging.getLogger(__name__)

NAME = "spmd_ulysses"


# --------------------------------------------------------------------------- rows


def share_rows(batch, block_rows: int, pad_id: int, sp: SPGroups):
    """Collective over all ranks: every rank of an SP group gets all the group's rows, in one
    order: for each block of `block_rows` rows, the group's ranks' rows of that block in rank
    order (rank_balance.mini_batch_block_rows: a global mini-batch is then the rows it is without
    sequence parallelism). Group ids are made distinct across the ranks first. Identity when
    sequence parallelism is off."""
    if not sp.enabled:
        return batch
    from spmd_rl.batching.batch import Batch
    from spmd_rl.batching.rank_balance import exchange_rows

    world, me = dist.get_world_size(), dist.get_rank()
    ids = batch["group_ids"] if "group_ids" in batch else torch.arange(len(batch))
    info: list = [None] * world
    dist.all_gather_object(info, (len(batch), batch.seq_len, int(ids.max()) + 1 if len(ids) else 0))
    rows, width, span = info[me][0], max(i[1] for i in info), max(i[2] for i in info)
    if any(i[0] != rows for i in info):
        raise ValueError(f"share_rows: the ranks hold different numbers of rows ({[i[0] for i in info]})")
    batch = Batch({**batch.tensors, "group_ids": ids + me * span}, batch.meta)
    sp_ranks, _ = sp_group_ranks(world, sp.size)
    placement = [[] for _ in range(world)]
    for members in sp_ranks:
        order = [(src, row) for start in range(0, rows, block_rows) for src in members
                 for row in range(start, min(start + block_rows, rows))]
        for r in members:
            placement[r] = order
    return exchange_rows(batch, placement, width, pad_id)


# --------------------------------------------------------------------------- collectives


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """x [size, ...]: chunk j goes to rank j of `group`; returns [size, ...], chunk i from rank i."""
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """_all_to_all with its adjoint (the same exchange) as backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_to_all(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.group), None


class _GatherSequence(torch.autograd.Function):
    """[1, n, ...] slices of the group's ranks -> [1, size * n, ...] on every rank. Backward: the
    gradient of this rank's slice summed over the group (every rank's copy of the output feeds
    its own loss, and every loss counts); an all-reduce, which gloo and NCCL both have on any
    torch, then the slice."""

    @staticmethod
    def forward(ctx, x, group, rank: int, size: int):
        ctx.group, ctx.rank, ctx.n = group, rank, x.shape[1]
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad.narrow(1, ctx.rank * ctx.n, ctx.n), None, None, None


def gather_sequence(x: torch.Tensor, sp: SPGroups) -> torch.Tensor:
    """Every rank's [1, n, ...] slice, concatenated along dim 1 in rank order (differentiable)."""
    return _GatherSequence.apply(x, sp.group, sp.rank, sp.size)


def heads_to_sequence(x: torch.Tensor, sp: SPGroups) -> torch.Tensor:
    """[n, H, D] (this rank's tokens, all heads) -> [size * n, H / size, D] (all tokens, this
    rank's share of the heads)."""
    n, h, d = x.shape
    x = x.reshape(n, sp.size, h // sp.size, d).transpose(0, 1)
    return _AllToAll.apply(x, sp.group).reshape(sp.size * n, h // sp.size, d)


def sequence_to_heads(x: torch.Tensor, sp: SPGroups) -> torch.Tensor:
    """The inverse of heads_to_sequence: [size * n, H / size, D] -> [n, H, D]."""
    t, h, d = x.shape
    n = t // sp.size
    x = _AllToAll.apply(x.reshape(sp.size, n, h, d), sp.group)
    return x.transpose(0, 1).reshape(n, sp.size * h, d)


# --------------------------------------------------------------------------- inputs and outputs


class SlicedLayout:
    """A packed micro-batch (PackedLayout) of which this rank feeds one slice to the model: see the
    module doc. `inputs` and `targets` are this rank's; `to_columns` takes this rank's per-token
    outputs and returns the whole micro-batch's [b, L] columns."""

    def __init__(self, packed: PackedLayout, sp: SPGroups):
        self.packed, self.sp = packed, sp
        total = packed.num_tokens
        pad = -total % sp.size
        ids, pos = packed.inputs["input_ids"], packed.inputs["position_ids"]
        cu, max_len = packed.inputs["cu_seq_lens_q"], packed.inputs["max_length_q"]
        if pad:  # the padding is a sequence of its own: it attends to itself only, its outputs are dropped
            ids = F.pad(ids, (0, pad))
            pos = torch.cat([pos, torch.arange(pad, device=pos.device, dtype=pos.dtype)[None]], dim=1)
            cu = torch.cat([cu, cu[-1:] + pad])  # total + pad, without a copy from the host (it would wait)
            max_len = max(max_len, pad)
        n = (total + pad) // sp.size
        part = slice(sp.rank * n, (sp.rank + 1) * n)
        self.inputs = {"input_ids": ids[:, part], "position_ids": pos[:, part],
                       "attention_mask": packed.inputs["attention_mask"], "cu_seq_lens_q": cu,
                       "cu_seq_lens_k": cu, "max_length_q": max_len, "max_length_k": max_len}
        self.targets = F.pad(packed.targets, (0, pad))[:, part]  # shifted on the whole row, then sliced
        self.output_rows = None
        self.num_tokens, self.pad, self.part = total, pad, part

    def token_rows(self, x: torch.Tensor, fill: int = -1) -> torch.Tensor:
        """[b, L, ...] per-token values -> [n, ...] of this rank's slice (the padding gets `fill`:
        for routes, NO_ROUTE)."""
        rows = self.packed.token_rows(x)
        if self.pad:
            rows = torch.cat([rows, rows.new_full((self.pad, *rows.shape[1:]), fill)])
        return rows[self.part]

    def to_columns(self, out: torch.Tensor) -> torch.Tensor:
        """[1, n] outputs of this rank's slice -> [b, L] columns of the whole micro-batch."""
        return self.packed.to_columns(gather_sequence(out, self.sp)[:, :self.num_tokens])


def of_model(model: torch.nn.Module) -> SPGroups | None:
    """The SP groups `model` was set up for (apply), None without sequence parallelism."""
    return getattr(model, "spmd_ulysses", None)


def make_layout(mb, model: torch.nn.Module):
    """The layout of micro-batch `mb` (spmd_rl.batching.batch.Batch) for `model` (packing.make_layout, from the
    host's copy of the mask where `mb` has one), sliced for this rank when the model is set up for
    sequence parallelism (apply); each prompt once where the model shares prompts
    (spmd_rl.batching.shared_prompts; rows without prompt lengths are packed whole)."""
    from spmd_rl.model.loading import shares_prompts, uses_packing

    if shares_prompts(model) and "prompt_lens" in mb:
        return SharedPromptLayout(mb, mb.host)
    host_mask = mb.host["attention_mask"] if mb.host is not None else None
    layout = packing.make_layout(mb["input_ids"], mb["attention_mask"], uses_packing(model), host_mask)
    sp = of_model(model)
    return SlicedLayout(layout, sp) if sp is not None and sp.enabled else layout


# --------------------------------------------------------------------------- attention


@torch.compiler.disable  # collectives: eager under a compiled decoder layer (model.fused_kernels = "compile")
def ulysses_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              attention_mask: torch.Tensor | None, **kwargs):
    """query [1, Hq, n, D], key/value [1, Hkv, n, D] of this rank's slice -> ([1, n, Hq, D], None):
    heads split across the SP group by all-to-all, packed variable-length attention over the whole
    row (spmd_rl.model.varlen_attention), back by all-to-all."""
    from spmd_rl.model.varlen_attention import varlen_attention_forward

    sp: SPGroups = module.spmd_ulysses
    if kwargs.get("cu_seq_lens_q") is None:
        raise ValueError("sequence parallelism (trainer.ulysses_size > 1) takes packed rows only "
                         "(model.remove_padding = true)")
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [n, H, D]
    copies = kv_replication(k.shape[1], sp.size)
    if copies > 1:
        k, v = k.repeat_interleave(copies, dim=1), v.repeat_interleave(copies, dim=1)
    q, k, v = (heads_to_sequence(x, sp).transpose(0, 1)[None] for x in (q, k, v))  # [1, H / size, T, D]
    out, _ = varlen_attention_forward(module, q, k, v, attention_mask, **kwargs)  # [1, T, Hq / size, D]
    return sequence_to_heads(out[0], sp)[None], None


@functools.cache
def register() -> str:
    """Register the backend with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from spmd_rl.model import varlen_attention

    varlen_attention.register()
    AttentionInterface.register(NAME, ulysses_attention_forward)
    AttentionMaskInterface.register(NAME, varlen_attention._mask)
    return NAME


def apply(model: torch.nn.Module, sp: SPGroups) -> torch.nn.Module:
    """Set up a packed model (models.load_causal_lm / load_value_model with remove_padding) for
    sequence parallelism over `sp`: the Ulysses attention backend, and the groups on the model and
    its attention modules. Size 1: nothing for a model never set up, else back to the plain packed
    model (scripts/bench/bench_ulysses.py switches one model between sizes)."""
    from spmd_rl.model.loading import decoder_layers, uses_packing

    if not sp.enabled:
        if of_model(model) is not None:
            from spmd_rl.model import varlen_attention

            for layer in decoder_layers(model):
                del layer.self_attn.spmd_ulysses
            model.set_attn_implementation(varlen_attention.register())
            del model.spmd_ulysses
        return model

    if not uses_packing(model):
        raise ValueError("sequence parallelism needs a packed model (model.remove_padding = true)")
    config = model.config
    heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", config.num_attention_heads)
    problem = head_problem(heads, kv_heads, sp.size)
    if problem:
        raise ValueError(f"{type(model).__name__}: {problem} (trainer.ulysses_size = {sp.size})")
    copies = kv_replication(kv_heads, sp.size)
    if copies > 1:
        log.info("ulysses: each of the %d KV heads is replicated %dx so that each of the %d ranks of an SP group "
                 "gets one", kv_heads, copies, sp.size)
    for layer in decoder_layers(model):
        layer.self_attn.spmd_ulysses = sp
    model.set_attn_implementation(register())
    model.spmd_ulysses = sp
    return model

