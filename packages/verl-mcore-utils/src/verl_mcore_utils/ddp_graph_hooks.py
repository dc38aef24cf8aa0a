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

The hooks are kept on the DDP wrapper; what sits on a parameter reaches them through a weak reference. Why: a
tensor's hooks are held from its C++ side, where Python's garbage collector does not look, so a hook closing over
DDP (which holds the module, which holds the parameter) would keep the whole model and its optimizer state alive
after its last user let go (measured: 11.3 GiB per closed verl-engine of the 1b preset on 1 x H200).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

__all__ = ["ddp_hook_is_on_parameter", "ddp_hooks_on_parameters", "run_ddp_hook"]

_HOOKS = "_verl_ddp_post_hooks"  # on the DDP wrapper: id(param) -> DDP's hook of that parameter, once moved
_OWNER = "_verl_ddp_owner"  # on a parameter: a weak reference to the DDP wrapper whose hook was moved onto it


def ddp_hooks_on_parameters(ddp: Any) -> int:
    """Move every gradient hook of megatron-core DDP ``ddp`` onto its parameter; returns how many moved.

    Idempotent (a second call moves nothing). Raises ValueError, naming the setting, for a DDP whose hooks are
    not one per parameter on its ``AccumulateGrad`` node (``delay_wgrad_compute`` or GTP weight
    rematerialisation put some elsewhere), and TypeError for an object that is not megatron-core DDP.
    """
    if getattr(ddp, _HOOKS, None) is not None:
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
    hooks = {id(param): ddp._make_backward_post_hook(param) for param in params}
    setattr(ddp, _HOOKS, hooks)  # DDP -> its hooks -> DDP: a cycle the garbage collector sees whole
    owner = weakref.ref(ddp)
    for param in params:
        param.register_post_accumulate_grad_hook(_on_parameter(owner))
        setattr(param, _OWNER, owner)
    return len(params)


def ddp_hook_is_on_parameter(param: torch.Tensor) -> bool:
    """Whether ``param``'s DDP hook was moved by :func:`ddp_hooks_on_parameters`."""
    return _moved_hook(param) is not None


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
    hook = _moved_hook(param)
    if hook is None:
        raise ValueError(
            "run_ddp_hook: this parameter's DDP hook was not moved onto it; call ddp_hooks_on_parameters(ddp) first"
        )
    param.grad = _zero(param.dtype, param.device).expand_as(param)
    hook()


_ZEROS: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _zero(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One zero scalar per dtype and device, the stand-in gradients' storage.

    Why cached: :func:`run_ddp_hook` runs for every fused weight after every graphed backward (48 per micro-batch
    at 12 layers), and a fresh scalar is an allocation and a fill kernel each. Sharing is safe: the stand-in is a
    zero-stride view, which torch refuses to write in place, and DDP's hook only reads it before dropping it.
    """
    zero = _ZEROS.get((dtype, device))
    if zero is None:
        zero = _ZEROS[(dtype, device)] = torch.zeros((), dtype=dtype, device=device)
    return zero


def _moved_hook(param: torch.Tensor) -> Any:
    owner = getattr(param, _OWNER, None)
    ddp = owner() if owner is not None else None
    return None if ddp is None else getattr(ddp, _HOOKS).get(id(param))


def _on_parameter(owner: weakref.ref) -> Any:
    def post_accumulate_grad(param: torch.Tensor) -> None:
        ddp = owner()
        if ddp is None:  # its main_grad and buckets went with it: the gradient would be lost
            raise RuntimeError(
                "a backward reached a parameter whose megatron-core DDP wrapper was garbage-collected (its DDP hook"
                " had been moved onto the parameter by ddp_hooks_on_parameters): keep the DDP wrapper while"
                " training its module"
            )
        getattr(ddp, _HOOKS)[id(param)]()  # DDP's hook takes *unused arguments and reads its own parameter

    return post_accumulate_grad
