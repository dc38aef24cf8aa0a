"""Power-of-two context-parallel sub-groups of the DP x CP ranks, created once and looked up by size.

Dynamic CP runs each micro-batch with a local CP size ``k`` that changes from step to step, so every
size must have a ready process group: creating groups on the fly is a collective over the whole world
and would deadlock as soon as two ranks pick different sizes. :class:`CPGroups` therefore creates, in
its constructor, the aligned contiguous blocks ``[0..k-1], [k..2k-1], ...`` of the DP x CP rank list
for every power of two ``k`` that divides that list's length (1 included: Megatron-LM's hybrid CP has
no size-1 group and raises ``KeyError``). Every rank of the world calls
``torch.distributed.new_group`` for every block of every list in the same order, which is what
``new_group`` requires. Nothing here depends on Megatron-LM's unreleased dynamic-CP API, or on
megatron-core at all.

With tensor or pipeline parallelism each TP/PP position has its own DP x CP rank list; pass all of
them (``rank_lists``) or let :meth:`CPGroups.from_local_ranks` collect them with one all-gather.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import cast

import torch.distributed as dist

__all__ = ["CPGroup", "CPGroups"]


@dataclass(frozen=True)
class CPGroup:
    """This rank's context-parallel group of one size.

    ``index`` numbers the aligned blocks of the DP x CP rank list (block ``index`` holds positions
    ``index * size .. index * size + size - 1``); ``rank`` is this rank's CP rank inside the block
    (the zigzag chunk it holds); ``ranks`` are the global ranks of the block in CP-rank order.
    """

    size: int
    index: int
    rank: int
    ranks: tuple[int, ...]
    process_group: dist.ProcessGroup

    def __post_init__(self) -> None:
        if self.size < 1 or self.size & (self.size - 1):
            raise ValueError(f"CPGroup.size must be a power of two >= 1, got {self.size}")
        if len(self.ranks) != self.size:
            raise ValueError(f"CPGroup.ranks has {len(self.ranks)} entries but size is {self.size}")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"CPGroup.rank must be in [0, {self.size}), got {self.rank}")
        if self.index < 0:
            raise ValueError(f"CPGroup.index must be >= 0, got {self.index}")


def _check_rank_lists(rank_lists: Sequence[Sequence[int]], world_size: int) -> tuple[tuple[int, ...], ...]:
    lists = tuple(tuple(int(r) for r in lst) for lst in rank_lists)
    if not lists:
        raise ValueError("rank_lists is empty: give at least one DP x CP rank list")
    seen: set[int] = set()
    for lst in lists:
        if not lst:
            raise ValueError("rank_lists contains an empty list")
        if len(lst) != len(lists[0]):
            raise ValueError(
                f"every DP x CP rank list must have the same length; got lengths {[len(x) for x in lists]}"
            )
        for r in lst:
            if not 0 <= r < world_size:
                raise ValueError(f"rank {r} in rank_lists is outside the world [0, {world_size})")
            if r in seen:
                raise ValueError(f"rank {r} appears more than once in rank_lists")
            seen.add(r)
    return lists


class CPGroups:
    """Every aligned power-of-two sub-group of the DP x CP ranks, created once.

    ``rank_lists``: one DP x CP rank list per TP/PP position, in CP-rank order within each list (for
    megatron-core's default order that is the sorted rank list of the data-parallel group with
    context parallel). Default: one list holding all ranks of the world. Every rank of the world
    must construct :class:`CPGroups` with the same ``rank_lists`` at the same point of the program.
    Sizes are the powers of two dividing the list length ``n`` (all of 1, 2, 4, ..., n when ``n`` is
    a power of two).
    """

    def __init__(
        self,
        *,
        rank_lists: Sequence[Sequence[int]] | None = None,
        backend: str | None = None,
        timeout: timedelta | None = None,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError("CPGroups needs torch.distributed to be initialised (init_process_group)")
        world = dist.get_world_size()
        me = dist.get_rank()
        lists = _check_rank_lists(rank_lists if rank_lists is not None else [range(world)], world)
        mine = [lst for lst in lists if me in lst]
        if not mine:
            raise ValueError(f"rank {me} is in none of the DP x CP rank lists {lists}")
        self._ranks: tuple[int, ...] = mine[0]
        n = len(self._ranks)
        self._sizes: tuple[int, ...] = tuple(1 << i for i in range(n.bit_length()) if n % (1 << i) == 0)
        self._groups: dict[int, CPGroup] = {}
        self._destroyed = False
        position = self._ranks.index(me)
        # The same loop order on every rank: size, then list, then block. new_group is collective
        # over the world, so any difference in order would hang or pair up the wrong groups.
        for size in self._sizes:
            for lst in lists:
                for index in range(n // size):
                    block = lst[index * size : (index + 1) * size]
                    pg = dist.new_group(ranks=list(block), backend=backend, timeout=timeout)
                    if me in block:
                        self._groups[size] = CPGroup(
                            size=size,
                            index=index,
                            rank=position - index * size,
                            ranks=block,
                            # me in block: a member's group, not new_group's NON_GROUP_MEMBER
                            process_group=cast(dist.ProcessGroup, pg),
                        )
        # A group over the whole DP x CP list for the planner's merge; it is the largest size group
        # when n is a power of two, else one more group (created in the same order everywhere).
        if n in self._groups:
            self._full_group = self._groups[n].process_group
        else:
            full = None
            for lst in lists:
                pg = dist.new_group(ranks=list(lst), backend=backend, timeout=timeout)
                if me in lst:
                    full = cast(dist.ProcessGroup, pg)  # me in lst: not NON_GROUP_MEMBER
            assert full is not None
            self._full_group = full

    def destroy(self) -> None:
        """Destroy this rank's groups (idempotent): every rank of the world calls it at the same point.

        The engines call it from ``close()``: each engine builds its own CPGroups, so a process that builds
        engines in turn would otherwise keep every earlier engine's communicators alive.
        """
        if self._destroyed:
            return
        self._destroyed = True
        mine = {id(g.process_group): g.process_group for g in self._groups.values()}
        mine.setdefault(id(self._full_group), self._full_group)
        self._groups = {}
        if dist.is_initialized():
            for group in mine.values():
                dist.destroy_process_group(group)

    @classmethod
    def from_local_ranks(
        cls,
        local_ranks: Sequence[int],
        *,
        backend: str | None = None,
        timeout: timedelta | None = None,
    ) -> CPGroups:
        """Build from this rank's own DP x CP rank list; the other lists are all-gathered.

        Convenient with megatron-core, where each rank knows only its own list
        (``torch.distributed.get_process_group_ranks(get_data_parallel_group(with_context_parallel=True))``).
        The lists are sorted by their first rank so every rank sees them in the same order.
        """
        gathered: list[list[int] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, [int(r) for r in local_ranks])
        unique = sorted({tuple(lst) for lst in gathered if lst is not None}, key=lambda lst: lst[0])
        return cls(rank_lists=unique, backend=backend, timeout=timeout)

    @property
    def ranks(self) -> tuple[int, ...]:
        """This rank's DP x CP rank list (global ranks, CP-rank order)."""
        return self._ranks

    @property
    def world_size(self) -> int:
        """``n``, the number of DP x CP ranks of this TP/PP position."""
        return len(self._ranks)

    @property
    def position(self) -> int:
        """This rank's position in :attr:`ranks` (its DP x CP rank)."""
        return self._ranks.index(dist.get_rank())

    @property
    def full_group(self) -> dist.ProcessGroup:
        """The process group of all DP x CP ranks of this TP/PP position."""
        if self._destroyed:
            raise RuntimeError("these CP groups were destroyed (destroy()); build new CPGroups")
        return self._full_group

    @property
    def sizes(self) -> tuple[int, ...]:
        """The group sizes available, ascending."""
        return self._sizes

    def num_groups(self, size: int) -> int:
        """How many blocks of ``size`` ranks the DP x CP ranks form."""
        self._check_size(size)
        return self.world_size // size

    def group(self, size: int) -> CPGroup:
        """This rank's group of ``size`` ranks (the same object on every call)."""
        if self._destroyed:
            raise RuntimeError("these CP groups were destroyed (destroy()); build new CPGroups")
        self._check_size(size)
        return self._groups[size]

    def _check_size(self, size: int) -> None:
        if size not in self._groups:
            raise ValueError(
                f"no CP group of size {size}: the {self.world_size} DP x CP ranks have groups of sizes {list(self._sizes)}"
            )
