"""verl_mcore_utils.ddp_graph_hooks on CPU: the refusals and the shared stand-in gradient.

The hooks' behaviour on megatron-core's own DDP (which wraps chunks on GPUs only) is tested on a GPU:
``tests/test_gpu_decoder_graph.py::test_a_moved_ddp_hook_run_by_hand_keeps_main_grad_and_clears_the_stand_in``.
"""

from __future__ import annotations

import pytest
import torch

from verl_mcore_utils.ddp_graph_hooks import (
    _zero,
    ddp_hook_is_on_parameter,
    ddp_hooks_on_parameters,
    run_ddp_hook,
)


def test_the_stand_in_gradient_is_one_shared_zero_per_dtype_and_device() -> None:
    cpu = torch.device("cpu")
    first = _zero(torch.bfloat16, cpu)
    assert first is _zero(torch.bfloat16, cpu)  # no allocation per call
    assert first.dtype == torch.bfloat16 and first.dim() == 0 and first.item() == 0.0
    assert _zero(torch.float32, cpu) is not first
    assert _zero(torch.float32, cpu).dtype == torch.float32


def test_the_shared_stand_in_cannot_be_written_through_a_gradient() -> None:
    """Sharing is safe only because a zero-stride view refuses in-place writes: a hook that wrote into the
    gradient it was handed would otherwise change every later stand-in."""
    weight = torch.nn.Parameter(torch.ones(4, 3))
    weight.grad = _zero(weight.dtype, weight.device).expand_as(weight)
    with pytest.raises(RuntimeError, match="single memory location"):
        weight.grad.add_(1.0)
    assert _zero(weight.dtype, weight.device).item() == 0.0


def test_a_parameter_whose_hook_was_not_moved_is_refused_by_name_of_the_fix() -> None:
    weight = torch.nn.Parameter(torch.zeros(2))
    assert not ddp_hook_is_on_parameter(weight)
    with pytest.raises(ValueError, match=r"call ddp_hooks_on_parameters\(ddp\) first"):
        run_ddp_hook(weight)
    assert weight.grad is None  # refused before any stand-in was set


def test_moving_hooks_of_something_that_is_not_megatron_core_ddp_is_refused() -> None:
    with pytest.raises(TypeError, match="DistributedDataParallel.*got Linear"):
        ddp_hooks_on_parameters(torch.nn.Linear(2, 2))
