"""How a micro-batch is handed to a model: padded rows, or packed into one row without padding.

A micro-batch (spmd_rl.batching.batch) is [b, L] rows, left-aligned, right-padded. A layout turns it into
model inputs and the model's per-position outputs back into [b, L] columns aligned with
`input_ids`, shifted so that column t holds what the model said *before* token t (the log-prob of
token t, the value before t; column 0 gets 0) -- the batch's convention.

- `PaddedLayout`: the rows as they are, with the attention mask.
- `PackedLayout` (`model.remove_padding`): the rows' real tokens concatenated into one [1, T] row,
  position ids restarting at 0 per sequence (a left-aligned row's column *is* the position) and
  the boundaries as `cu_seq_lens_*` for a variable-length attention backend
  (spmd_rl.model.varlen_attention). No compute or memory is spent on padding. Built from the host's copy
  of the mask (Batch.host), it never waits for the GPU.
- `shared_prompts.SharedPromptLayout` (`model.share_prompts`): a packed row with each prompt once,
  before the responses that share it.
- `sequence_parallel.SlicedLayout` (trainer.ulysses_size > 1, built by sequence_parallel.make_layout):
  a packed row of which each rank of a sequence-parallel group feeds one slice of the tokens to the model.

`targets` is the next token of every position (what its log-prob is of). Positions whose next
token belongs to another sequence or is padding get some token too; their outputs never reach a
column. `output_rows` (None here) names the positions whose outputs are the targets' when they are
not every position (shared prompts).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from spmd_rl.runtime.transfer import to_device


class PaddedLayout:
    def __init__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        self.shape = input_ids.shape
        self.inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
        self.targets = torch.roll(input_ids, -1, dims=1)
        self.output_rows = None  # every position predicts its next token

    def to_columns(self, out: torch.Tensor) -> torch.Tensor:
        """[b, L] per-position outputs -> [b, L] columns (column t = output at position t - 1)."""
        return F.pad(out[:, :-1], (1, 0))

    def token_rows(self, x: torch.Tensor) -> torch.Tensor:
        """[b, L, ...] per-token values (aligned with input_ids) -> [b * L, ...] in the order the
        model's token-wise layers see its tokens (rows flattened; routing replay's routes)."""
        return x.reshape(-1, *x.shape[2:])


class PackedLayout:
    """`host_mask`: the micro-batch's attention mask on the CPU (Batch.host), when `attention_mask`
    is on a GPU: the boundaries are counted there and copied over without waiting, so building the
    layout never waits for the GPU (it would wait for all the work queued before it, a previous
    micro-batch's backward included, and leave the GPU idle while the next forward is launched)."""

    def __init__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, host_mask: torch.Tensor | None = None):
        self.shape = input_ids.shape
        mask = attention_mask if host_mask is None else host_mask
        lens = mask.sum(1)
        rows, cols = mask.bool().nonzero(as_tuple=True)  # row by row, left to right
        cu = F.pad(lens.cumsum(0), (1, 0)).to(torch.int32)
        max_len = int(lens.max())
        self.rows, self.cols, cu = (to_device(t, input_ids.device) for t in (rows, cols, cu))
        packed = input_ids[self.rows, self.cols][None]
        self.inputs = {"input_ids": packed, "position_ids": self.cols[None], "attention_mask": empty_mask(packed.device),
                       "cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max_len, "max_length_k": max_len}
        self.targets = torch.roll(packed, -1, dims=1)
        self.output_rows = None  # every position predicts its next token
        self.num_tokens = packed.shape[1]

    def to_columns(self, out: torch.Tensor) -> torch.Tensor:
        """[1, T] per-position outputs -> [b, L] columns; a sequence's first token gets 0."""
        shifted = torch.roll(out[0], 1).masked_fill(self.cols == 0, 0)
        return shifted.new_zeros(self.shape).index_put((self.rows, self.cols), shifted)

    def token_rows(self, x: torch.Tensor) -> torch.Tensor:
        """[b, L, ...] per-token values -> [T, ...], the packed row's tokens in order."""
        return x[self.rows, self.cols]


def empty_mask(device: torch.device) -> torch.Tensor:
    """The attention mask a packed row is given: an empty 4-D mask, which the attention backend
    (spmd_rl.model.varlen_attention) ignores for the row's cu_seq_lens. transformers takes a 4-D mask as
    made already and builds none; given no mask, it would look for packed sequences in the position
    ids and read a flag back from the GPU at every forward (masking_utils.find_packed_sequence_indices)."""
    return torch.empty((1, 1, 0, 0), dtype=torch.bool, device=device)


def make_layout(input_ids: torch.Tensor, attention_mask: torch.Tensor, packed: bool,
                host_mask: torch.Tensor | None = None):
    """The layout of a micro-batch for a model loaded `packed` (model.remove_padding) or not
    (spmd_rl.batching.sequence_parallel.make_layout slices it for sequence parallelism); `host_mask`: see
    PackedLayout."""
    if not packed:
        return PaddedLayout(input_ids, attention_mask)
    return PackedLayout(input_ids, attention_mask, host_mask)
