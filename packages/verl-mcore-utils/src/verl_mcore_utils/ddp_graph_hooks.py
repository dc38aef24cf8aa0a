"""megatron-core DDP's gradient hooks moved from autograd nodes onto the parameters, so a CUDA graph can capture
a backward through a DDP-wrapped module.

Why: DDP (every release 0.14 to 0.19) registers its per-parameter backward hook on the parameter's
``AccumulateGrad`` node and keeps those nodes alive in ``ddp.grad_accs``. The nodes were made when the model was
wrapped, on the legacy default stream; a graph capture whose backward reaches them (on the capture's side stream)
then fails with ``cudaErrorStreamCaptureImplicit`` (measured: verl-engine's DDP-wrapped decoder on 1 x H200,
docs/benchmarks.md). torch's ``Tensor.register_post_accumulate_grad_hook`` runs at the same point of the
backward (after the gradient is accumulated into ``.grad``) but is stored on the tensor, so once the node list is
dropped autograd makes each node when a backward needs it, on that backward's stream.

The hook is DDP's own (``ddp._make_backward_post_hook(param)``): the same ``main_grad`` accumulation, the same
bucket readiness for overlapped reduction. Only its place changes. Call this between steps (no forward whose
backward is still due): a node still referenced by a pending autograd graph would keep its old hook.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["ddp_hook_is_on_parameter", "ddp_hooks_on_parameters", "run_ddp_hook"]

_MOVED = "_verl_ddp_hook_on_parameter"  # on the DDP wrapper: its hooks were moved
_HOOK = "_verl_ddp_post_hook"  # on a parameter: DDP's hook, moved onto it


def ddp_hooks_on_parameters(ddp: Any) -> int:
    """Move every gradient hook of megatron-core DDP ``ddp`` onto its parameter; returns how many moved.

    Idempotent (a second call moves nothing). Raises ValueError, naming the setting, for a DDP whose hooks are
    not one per parameter on its ``AccumulateGrad`` node (``delay_wgrad_compute`` or GTP weight
    rematerialisation put some elsewhere), and TypeError for an object that is not megatron-core DDP.
    """
    if getattr(ddp, _MOVED, False):
        return 0
    accs = getattr(ddp, "grad_accs", None)
    if not isinstance(accs, list) or not hasattr(ddp, "_make_backward_post_hook"):
        raise TypeError(
            f"ddp_hooks_on_parameters needs megatron-core's DistributedDataParallel (with grad_accs and"
            f" _make_backward_post_hook), got {type(ddp).__name__}"
        )
    params = [p for p in ddp.module.parameters() if p.requires_grad]
    if len(accs) != len(params):
        raise ValueError(
            f"DDP holds {len(accs)} AccumulateGrad hooks for {len(params)} trainable parameters: some hooks live"
            " elsewhere (ddp_config.delay_wgrad_compute or GTP weight rematerialisation), which this move does not"
            " cover; turn those off to capture the backward in a CUDA graph"
        )
    accs.clear()  # the nodes (and the hooks on them) go with their last reference
    for param in params:
        hook = ddp._make_backward_post_hook(param)
        param.register_post_accumulate_grad_hook(_on_parameter(hook))
        setattr(param, _HOOK, hook)  # kept for run_ddp_hook; its presence is what "moved" means
    setattr(ddp, _MOVED, True)
    return len(params)


def ddp_hook_is_on_parameter(param: torch.Tensor) -> bool:
    """Whether ``param``'s DDP hook was moved by :func:`ddp_hooks_on_parameters`."""
    return getattr(param, _HOOK, None) is not None


def run_ddp_hook(param: torch.Tensor) -> None:
    """Run DDP's gradient hook of ``param`` as a backward would after accumulating a gradient into it.

    Why: a CUDA graph of the backward that adds a weight's gradient into ``main_grad`` itself (megatron-core's
    fused weight-gradient path) need not return that weight's gradient at all: returned, it is a placeholder the
    size of the weight held by the graph for good, and copied by ``AccumulateGrad`` on every backward. Not
    returned, no hook runs, so the graph's owner runs it here: a zero-stride zero gradient stands in (DDP asserts a
    gradient under overlapped reduction; it adds nothing once ``grad_added_to_main_grad`` is set, and zeros where
    ``zero_out_wgrad`` asks for the add), DDP clears it and marks the parameter ready for its bucket's reduction.
    Raises ValueError for a parameter whose hook :func:`ddp_hooks_on_parameters` did not move.
    """
    hook = getattr(param, _HOOK, None)
    if hook is None:
        raise ValueError(
            "run_ddp_hook: this parameter's DDP hook was not moved onto it; call ddp_hooks_on_parameters(ddp) first"
        )
    param.grad = torch.zeros((), dtype=param.dtype, device=param.device).expand_as(param)
    hook()


def _on_parameter(hook: Any) -> Any:
    def post_accumulate_grad(param: torch.Tensor) -> None:
        hook()  # DDP's hook takes *unused arguments and reads the parameter it was made for

    return post_accumulate_grad
