"""verl_mfsdp: Megatron-FSDP as a training backend (DDP settings, wrapping, param sync, offload, checkpoints).

The package is part of the workspace layout; its API is not implemented yet and nothing is exported.
"""

__version__ = "0.1.0.dev0"

__all__: list[str] = []
