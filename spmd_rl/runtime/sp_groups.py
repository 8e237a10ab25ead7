"""The sequence-parallel layout of ranks and attention heads (trainer.ulysses_size): which ranks
form the SP groups and the data-parallel groups across them, and how a model's heads divide over an
SP group. Layout only, no model code: spmd_rl.runtime.distributed builds the groups at start-up, config
checks the heads, and spmd_rl.batching.sequence_parallel does the work (slicing, all-to-all attention).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist


@dataclass(frozen=True)
class SPGroups:
    """This rank's place in the sequence-parallel layout (make_groups)."""

    size: int = 1
    """Ranks per SP group (trainer.ulysses_size)."""
    rank: int = 0
    """This rank's place in its SP group: which slice of a packed row it holds."""
    group: Any = None
    """The SP group (None when size is 1)."""
    dp_group: Any = None
    """This rank's data-parallel group: one rank of every SP group (None: all ranks)."""
    dp_size: int = 1
    """Data-parallel ranks: world / size."""

    @property
    def enabled(self) -> bool:
        return self.size > 1

    @property
    def data_group(self):
        """The group over which each row is held once (statistics of the whole batch)."""
        return self.dp_group if self.enabled else dist.group.WORLD


def sp_group_ranks(world: int, size: int) -> tuple[list[list[int]], list[list[int]]]:
    """(SP groups: `size` consecutive ranks each; data-parallel groups: one rank of each SP group)."""
    if size < 1 or world % size:  # preflight.validate names the fix for users
        raise ValueError(f"ulysses_size = {size} does not divide the world size {world}")
    return ([list(range(s, s + size)) for s in range(0, world, size)],
            [list(range(j, world, size)) for j in range(size)])


def make_groups(size: int) -> SPGroups:
    """Collective (every rank calls it): the SP and data-parallel groups of `size` (1: none)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    if size == 1:
        return SPGroups(dp_size=world)
    sp_ranks, dp_ranks = sp_group_ranks(world, size)
    sp_group, _ = dist.new_subgroups_by_enumeration(sp_ranks)
    dp_group, _ = dist.new_subgroups_by_enumeration(dp_ranks)
    return SPGroups(size, rank % size, sp_group, dp_group, world // size)


def kv_replication(num_kv_heads: int, size: int) -> int:
    """How many copies of each KV head the attention makes so that `size` ranks get whole heads:
    1 when `size` divides the KV heads; size / kv_heads when the KV heads divide `size`; 0 when
    neither (no sequence parallelism of that size for the model)."""
    if num_kv_heads % size == 0:
        return 1
    return size // num_kv_heads if size % num_kv_heads == 0 else 0


def head_problem(num_heads: int, num_kv_heads: int, size: int) -> str | None:
    """Why `size` ranks cannot split the attention heads of a model (None: they can)."""
    if num_heads % size:
        return f"its {num_heads} attention heads do not divide by {size}"
    if not kv_replication(num_kv_heads, size):
        return f"its {num_kv_heads} KV heads neither divide by {size} nor divide {size}"
    return None
