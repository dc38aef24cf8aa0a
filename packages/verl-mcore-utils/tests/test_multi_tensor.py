"""verl_mcore_utils.multi_tensor against megatron-core's own fallbacks and torch's clip_grad_norm_.

megatron-core's fallbacks and ``get_grad_norm_fp32`` / ``clip_grad_by_total_norm_fp32`` put their scratch
tensors on ``device="cuda"`` (0.14 to 0.19). On a machine without a GPU the tests run them unchanged under
``_CudaFactoriesOnCPU``, a TorchFunctionMode that only turns an explicit ``device="cuda"`` of a tensor factory
into the CPU (megatron's code and ours run as they are; nothing is mocked). The ``.grad`` path of
``clip_grad_by_total_norm_fp32`` asserts ``torch.cuda.FloatTensor``, so on the CPU the clipping goes through its
``decoupled_grad`` path (the same multi-tensor scale call). On a GPU (``-m gpu``) everything runs on CUDA and the
replacements are checked to make no host synchronisation (``torch.cuda.set_sync_debug_mode("error")``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from megatron.core import utils as mcore_utils
from megatron.core.optimizer import clip_grads
from megatron.core.optimizer import optimizer as mcore_optimizer
from torch.overrides import TorchFunctionMode

from verl_mcore_utils.multi_tensor import (
    multi_tensor_l2_norm,
    multi_tensor_scale,
    restore_multi_tensor_fallbacks,
    use_sync_free_multi_tensor_fallbacks,
)
from verl_mcore_utils.testing import free_port

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]

# This environment has neither Apex nor Transformer Engine: megatron-core chose its local fallbacks.
pytestmark = pytest.mark.skipif(
    clip_grads.l2_norm_impl is not mcore_utils.local_multi_tensor_l2_norm
    and clip_grads.l2_norm_impl is not multi_tensor_l2_norm,
    reason="megatron-core uses Apex / Transformer Engine kernels here",
)


class _CudaFactoriesOnCPU(TorchFunctionMode):
    """An explicit ``device="cuda"`` of a tensor factory means the CPU (megatron hard-codes CUDA scratch tensors)."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


def _on(device: str) -> contextlib.AbstractContextManager[Any]:
    return contextlib.nullcontext() if device == "cuda" else _CudaFactoriesOnCPU()


@pytest.fixture
def pristine() -> Iterator[None]:
    """megatron-core's own fallbacks before and after the test (make_megatron_optimizer elsewhere installs ours)."""
    restore_multi_tensor_fallbacks()
    assert clip_grads.l2_norm_impl is mcore_utils.local_multi_tensor_l2_norm
    try:
        yield
    finally:
        restore_multi_tensor_fallbacks()
        assert clip_grads.l2_norm_impl is mcore_utils.local_multi_tensor_l2_norm
        assert clip_grads.multi_tensor_scale_impl is mcore_utils.local_multi_tensor_scale
        assert mcore_optimizer.multi_tensor_scale_impl is mcore_utils.local_multi_tensor_scale


@pytest.fixture(scope="module")
def process_group() -> Iterator[None]:
    """A one-rank gloo group: get_grad_norm_fp32 all-reduces over the default group."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _tensors(device: str, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = [(7, 13), (1,), (), (0,), (3, 0, 2), (4, 5, 6), (1000,), (2, 1)]
    return [(3 * torch.randn(shape, generator=g)).to(device=device, dtype=dtype) for shape in shapes]


@pytest.mark.parametrize("device", DEVICES)
def test_l2_norm_matches_megatron(device: str) -> None:
    tensors = _tensors(device)
    flag = torch.zeros(1, dtype=torch.int, device=device)
    for lists in ([tensors], [tensors[:4], tensors[4:]], [[]], [[torch.empty(0, device=device)]]):
        ours, ours_per_tensor = multi_tensor_l2_norm(2048 * 32, flag, lists, False)
        with _on(device):
            ref, ref_per_tensor = mcore_utils.local_multi_tensor_l2_norm(2048 * 32, flag, lists, False)
        assert ours_per_tensor is None and ref_per_tensor is None
        assert ours.shape == ref.shape == (1,)
        assert ours.dtype == ref.dtype == torch.float32
        assert ours.device.type == device
        torch.testing.assert_close(ours, ref, rtol=1e-6, atol=0.0)
    # megatron's applier calls it the same way
    ours, _ = mcore_utils.local_multi_tensor_applier(multi_tensor_l2_norm, flag, [tensors], False)
    expected = torch.linalg.vector_norm(torch.cat([t.flatten() for t in tensors]).double())
    torch.testing.assert_close(ours.double(), expected.reshape(1), rtol=1e-6, atol=0.0)


@pytest.mark.parametrize("device", DEVICES)
def test_l2_norm_of_mixed_dtypes_accumulates_in_fp32(device: str) -> None:
    fp32 = _tensors(device)
    bf16 = _tensors(device, torch.bfloat16)
    ours, _ = multi_tensor_l2_norm(2048 * 32, None, [[*fp32, *bf16]], False)
    expected = torch.linalg.vector_norm(torch.cat([t.flatten().double() for t in [*fp32, *bf16]]))
    torch.testing.assert_close(ours.double(), expected.reshape(1), rtol=1e-6, atol=0.0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scale", [0.37, 1.0, 4.0])
@pytest.mark.parametrize("dst_dtype", [torch.float32, torch.bfloat16])
def test_scale_matches_megatron(device: str, scale: float, dst_dtype: torch.dtype) -> None:
    srcs = _tensors(device)
    flag = torch.zeros(1, dtype=torch.int, device=device)
    ours = [torch.full_like(s, 9.0, dtype=dst_dtype) for s in srcs]
    ref = [torch.full_like(s, 9.0, dtype=dst_dtype) for s in srcs]
    mcore_utils.local_multi_tensor_applier(multi_tensor_scale, flag, [srcs, ours], scale)
    mcore_utils.local_multi_tensor_applier(mcore_utils.local_multi_tensor_scale, flag, [srcs, ref], scale)
    for a, b in zip(ours, ref, strict=True):
        assert a.dtype == dst_dtype
        torch.testing.assert_close(a, b, rtol=0.0, atol=0.0)  # same arithmetic: bit for bit
    assert flag.item() == 0  # megatron's fallback leaves the overflow flag alone; so do we

    # in place, as clip_grad_by_total_norm_fp32 calls it ([grads, grads])
    ours, ref = _tensors(device), _tensors(device)
    multi_tensor_scale(2048 * 32, flag, [ours, ours], scale)
    mcore_utils.local_multi_tensor_scale(2048 * 32, flag, [ref, ref], scale)
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=0.0, atol=0.0)


def _grads(device: str, seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    params = []
    for shape in [(16, 8), (8,), (3, 4, 5), (1,), (64,)]:
        p = torch.nn.Parameter(torch.zeros(shape, device=device))
        p.grad = torch.randn(shape, generator=g).to(device)
        params.append(p)
    return params


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("max_norm", [0.5, 1e6])  # clipped, and left alone (clip_coeff >= 1)
def test_megatron_grad_norm_and_clipping_use_the_replacements(
    device: str, max_norm: float, pristine: None, process_group: None
) -> None:
    assert use_sync_free_multi_tensor_fallbacks()
    assert clip_grads.l2_norm_impl is multi_tensor_l2_norm
    assert clip_grads.multi_tensor_scale_impl is multi_tensor_scale
    assert mcore_optimizer.multi_tensor_scale_impl is multi_tensor_scale

    params, ref_params = _grads(device, seed=1), _grads(device, seed=1)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref_params, max_norm)
    decoupled = device == "cpu"  # the .grad path asserts torch.cuda.FloatTensor
    if decoupled:
        for p in params:
            p.decoupled_grad = p.grad
    with _on(device):
        norm = clip_grads.get_grad_norm_fp32([p.grad for p in params])
        clip_grads.clip_grad_by_total_norm_fp32(params, max_norm, norm, use_decoupled_grad=decoupled)
    assert isinstance(norm, float)  # megatron's contract without TE: a Python float
    assert norm == pytest.approx(ref_norm.item(), rel=1e-6)
    for p, r in zip(params, ref_params, strict=True):
        # torch clips with max_norm / (norm + 1e-6) like megatron, in fp32 on the device
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-6, atol=1e-7)


def test_install_is_idempotent_and_restorable(pristine: None) -> None:
    assert use_sync_free_multi_tensor_fallbacks() is True
    installed = (
        clip_grads.l2_norm_impl,
        clip_grads.multi_tensor_scale_impl,
        mcore_optimizer.multi_tensor_scale_impl,
    )
    assert installed == (multi_tensor_l2_norm, multi_tensor_scale, multi_tensor_scale)
    # megatron's names for its fallbacks themselves are left pointing at them
    assert clip_grads.local_multi_tensor_l2_norm is mcore_utils.local_multi_tensor_l2_norm
    assert use_sync_free_multi_tensor_fallbacks() is False  # already in place: nothing to do, nothing changes
    assert (
        clip_grads.l2_norm_impl,
        clip_grads.multi_tensor_scale_impl,
        mcore_optimizer.multi_tensor_scale_impl,
    ) == installed
    assert restore_multi_tensor_fallbacks() == 3
    assert clip_grads.l2_norm_impl is mcore_utils.local_multi_tensor_l2_norm
    assert restore_multi_tensor_fallbacks() == 0
    assert use_sync_free_multi_tensor_fallbacks() is True  # and again after a restore


def test_kernels_that_are_not_megatrons_fallbacks_are_left_alone(pristine: None) -> None:
    """Where megatron picked Apex / TE kernels (here: any other function), nothing is replaced."""

    def kernel(*args: Any) -> None:
        raise AssertionError("not called")

    saved = clip_grads.l2_norm_impl
    clip_grads.l2_norm_impl = kernel
    try:
        use_sync_free_multi_tensor_fallbacks()
        assert clip_grads.l2_norm_impl is kernel
        assert clip_grads.multi_tensor_scale_impl is multi_tensor_scale  # still megatron's fallback: replaced
    finally:
        clip_grads.l2_norm_impl = saved


@pytest.mark.gpu
def test_no_host_synchronisation_on_cuda() -> None:
    tensors = _tensors("cuda")
    flag = torch.zeros(1, dtype=torch.int, device="cuda")
    dsts = [torch.empty_like(t) for t in tensors]
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        norm, _ = multi_tensor_l2_norm(2048 * 32, flag, [tensors], False)
        multi_tensor_scale(2048 * 32, flag, [tensors, dsts], 0.5)
        multi_tensor_scale(2048 * 32, flag, [dsts, dsts], 2.0)
        multi_tensor_scale(2048 * 32, flag, [tensors, dsts], 1.0)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    assert norm.is_cuda
    with pytest.raises(RuntimeError):  # megatron's fallback synchronises once per tensor
        torch.cuda.set_sync_debug_mode("error")
        try:
            mcore_utils.local_multi_tensor_l2_norm(2048 * 32, flag, [tensors], False)
        finally:
            torch.cuda.set_sync_debug_mode(previous)
