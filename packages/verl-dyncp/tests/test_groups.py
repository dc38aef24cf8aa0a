"""CPGroups on gloo: aligned power-of-two blocks of the DP x CP ranks for every size, size 1 included."""

from __future__ import annotations

import pytest
from dyncp_workers import results

from verl_dyncp.groups import CPGroups


def test_needs_initialised_process_group() -> None:
    with pytest.raises(RuntimeError, match="needs torch.distributed to be initialised"):
        CPGroups()


@pytest.mark.parametrize("world", [2, 4])
def test_membership_lookup_and_collectives(world: int) -> None:
    sizes = [s for s in (1, 2, 4) if s <= world]
    for rank, res in enumerate(results(world)):
        g = res["groups"]
        assert g["sizes"] == sizes
        assert g["same_object"], "group(size) returns the same object every time"
        for s in sizes:
            index, in_rank, ranks = g["membership"][s]
            assert index == rank // s and in_rank == rank % s
            assert ranks == tuple(range(index * s, index * s + s))
            # all-reduce of rank+1 and all-gather of the rank over the block
            assert g["sums"][s] == sum(r + 1 for r in ranks)
            assert g["gathers"][s] == list(ranks)
        assert g["full_sum"] == world
        assert (
            g["bad_size_error"]
            == f"no CP group of size 3: the {world} DP x CP ranks have groups of sizes {sizes}"
        )


def test_tp2_layout_groups() -> None:
    """With TP = 2 the DP x CP lists are [0, 2] and [1, 3]: groups are built inside each list."""
    for rank, res in enumerate(results(4)):
        g = res["groups"]
        own = (0, 2) if rank % 2 == 0 else (1, 3)
        ranks, index, in_rank, block, reduced, single = g["tp_membership"]
        assert ranks == own and index == 0 and in_rank == own.index(rank) and block == own
        assert reduced == float(sum(own)) and single == (rank,)
        assert g["from_local_ranks"] == (own, own.index(rank))
