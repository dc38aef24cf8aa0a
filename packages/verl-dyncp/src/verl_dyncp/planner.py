"""Dynamic (and static) context-parallel planning of packed micro-batches: the public names in one place.

The workload model (:mod:`verl_dyncp.workload`), the plan (:mod:`verl_dyncp.plan`: CP size search, with the
LPT + local search of :mod:`verl_dyncp.balance`) and each rank's share of it (:mod:`verl_dyncp.microbatch`:
split, take, merge). The package README describes the design.
"""

from verl_dyncp import microbatch, plan, workload
from verl_dyncp.microbatch import *  # noqa: F403
from verl_dyncp.plan import *  # noqa: F403
from verl_dyncp.workload import *  # noqa: F403

__all__ = list(workload.__all__)
__all__ += plan.__all__
__all__ += microbatch.__all__
