"""Spread the sequences of a micro-batch over equal CP groups: greedy LPT, then a local search.

Integer arithmetic and fixed tie-breaking, so every rank computes the same assignment from the lengths alone.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, insort
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["balance_groups"]

# how many of the least loaded groups the local search tries as partners of the busiest one per step
_REFINE_TARGETS = 8


def balance_groups(
    costs: Sequence[int],
    *,
    num_groups: int,
    tokens: Sequence[int],
    limit: int | None = None,
    refine: bool = True,
) -> tuple[list[list[int]], list[int]]:
    """Each group's sequence indices and total cost.

    LPT: each sequence, largest cost first (ties: lower index), goes to the group whose load is then
    smallest (ties: fewer sequences, so zero-cost ties still spread; then lower group index). ``refine``
    then runs the local search of :meth:`_Groups.refine`.

    Memory: with ``limit`` (tokens per group) a sequence goes only to groups it leaves within the limit; if
    none has room (bin packing can be infeasible), to the group with the fewest tokens after it, so the
    overshoot is as small as this greedy order allows.
    """
    groups = _Groups(costs=costs, tokens=tokens, limit=limit, num_groups=num_groups)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        groups.place(i)
    if refine:
        groups.refine()
    return groups.members, groups.loads


@dataclass
class _Groups:
    """The groups' members, loads (cost) and held tokens while they are filled and refined."""

    costs: Sequence[int]
    tokens: Sequence[int]
    limit: int | None
    num_groups: int
    members: list[list[int]] = field(init=False)
    loads: list[int] = field(init=False)
    held: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.members = [[] for _ in range(self.num_groups)]
        self.loads = [0] * self.num_groups
        self.held = [0] * self.num_groups

    def place(self, i: int) -> None:
        """LPT step: sequence ``i`` onto the least loaded group with room for its tokens."""
        fits: Sequence[int] = range(self.num_groups)
        n = self.tokens[i]
        if self.limit is not None:
            room = [j for j in fits if self.held[j] + n <= self.limit]
            fits = room or [min(fits, key=lambda j: (self.held[j] + n, j))]
        j = min(fits, key=lambda j: (self.loads[j] + self.costs[i], len(self.members[j]), j))
        self.members[j].append(i)
        self.loads[j] += self.costs[i]
        self.held[j] += n

    def room(self, j: int, extra: int) -> bool:
        """Group ``j`` may take ``extra`` more tokens (negative: fewer) under the limit."""
        if self.limit is None or extra <= 0:
            return True
        return self.held[j] + extra <= max(self.limit, self.held[j])

    def refine(self) -> None:
        """Lower the busiest group's load by moving one of its sequences to another group or swapping it for a
        cheaper one there, best improvement first, until no move or swap helps.

        Why: LPT places each sequence once and never revisits it; with few sequences per rank its busiest
        group can sit a large fraction of one sequence's cost above the mean, and that group sets the
        micro-batch's time. A step is taken only if both groups end strictly below the current peak, so the
        sorted load vector decreases and the search ends; the LPT bound (peak <= mean + largest cost) holds.
        A group is never emptied, and under the token limit no group ends above it unless it already was,
        and then it does not grow. Partners come from the ``_REFINE_TARGETS`` least loaded groups, found by
        bisection on their sorted costs, so a step stays cheap on hundreds of ranks.
        """
        if self.num_groups < 2:
            return
        ordered = [sorted((self.costs[i], i) for i in m) for m in self.members]
        for _ in range(4 * len(self.costs) + 4):  # bound; every step strictly lowers the sorted load vector
            p = max(range(self.num_groups), key=lambda j: (self.loads[j], -j))
            best = self._best_step(p, ordered)
            if best is None:
                return
            self._apply(p, best, ordered)

    def _best_step(
        self, p: int, ordered: list[list[tuple[int, int]]]
    ) -> tuple[int, int, int | None, int] | None:
        """The move or swap out of the busiest group ``p`` that leaves the lower pair peak: (i, j, i2, d)."""
        if len(self.members[p]) == 1:
            return None  # moving or swapping the only sequence just moves the peak (or empties the group)
        loads, peak = self.loads, self.loads[p]
        # partners among the least loaded groups only: a move or swap lands a group at or above its current
        # load, so these hold the best improvements
        targets = heapq.nsmallest(
            _REFINE_TARGETS, (j for j in range(self.num_groups) if j != p), key=lambda j: (loads[j], j)
        )
        best: tuple | None = None
        for i in self.members[p]:
            for j in targets:
                for c2, i2 in self._partners(i, j, peak - loads[j], ordered[j]):
                    d = self.costs[i] - c2
                    if d <= 0:
                        continue
                    moved = self.tokens[i] - (0 if i2 is None else self.tokens[i2])
                    if not (self.room(j, moved) and self.room(p, -moved)):
                        continue
                    top = max(loads[p] - d, loads[j] + d)
                    key = (top, i, j, -1 if i2 is None else i2)
                    if top < peak and (best is None or key < best[0]):
                        best = (key, i, j, i2, d)
        return None if best is None else best[1:]

    def _partners(
        self, i: int, j: int, gap: int, ordered_j: list[tuple[int, int]]
    ) -> list[tuple[int, int | None]]:
        """(cost, index) of the candidates in group ``j`` to swap ``i`` with; ``(0, None)`` is a plain move.

        The ideal transfer is half the load gap; the two members whose costs bracket ``cost(i) - gap / 2``
        are the only swaps worth trying."""
        candidates: list[tuple[int, int | None]] = [(0, None)]
        at = bisect_left(ordered_j, (self.costs[i] - gap // 2, -1))
        candidates.extend(ordered_j[k] for k in (at - 1, at) if 0 <= k < len(ordered_j))
        return candidates

    def _apply(
        self, p: int, step: tuple[int, int, int | None, int], ordered: list[list[tuple[int, int]]]
    ) -> None:
        i, j, i2, d = step
        self._move(i, p, j, ordered)
        if i2 is not None:
            self._move(i2, j, p, ordered)
        self.loads[p] -= d
        self.loads[j] += d

    def _move(self, i: int, src: int, dst: int, ordered: list[list[tuple[int, int]]]) -> None:
        self.members[src].remove(i)
        self.members[dst].append(i)
        ordered[src].remove((self.costs[i], i))
        insort(ordered[dst], (self.costs[i], i))
        self.held[src] -= self.tokens[i]
        self.held[dst] += self.tokens[i]
