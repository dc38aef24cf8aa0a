"""verl_dyncp: context parallelism for packed (THD) sequences on megatron-core, static and dynamic.

The package is part of the workspace layout; its API (core attention for THD + CP, the THD pre/post
processing, CP groups and the dynamic-CP planner) is not implemented yet and nothing is exported.
"""

__version__ = "0.1.0.dev0"

__all__: list[str] = []
