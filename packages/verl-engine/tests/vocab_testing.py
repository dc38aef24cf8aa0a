"""What test_logprobs.py and test_fused_head.py share: seeded labels, the tolerance check, the gradients of
the two outputs, a probe of the largest tensor an op creates, and the TP worker (gloo on CPU)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

IGNORE = -100


def seeded_labels(gen: torch.Generator, *, lead: tuple[int, ...], vocab: int) -> torch.Tensor:
    """Labels in ``[0, vocab)`` with about a fifth set to ``IGNORE`` and the last just past the vocabulary
    (ignored too)."""
    labels = torch.randint(0, vocab, lead, generator=gen)
    flat = labels.view(-1)
    flat[torch.randperm(flat.numel(), generator=gen)[: max(1, flat.numel() // 5)]] = IGNORE
    flat[-1] = vocab
    return labels


def close(
    actual: torch.Tensor, expected: torch.Tensor, *, rtol: float = 1e-5, elementwise: float = 0.0
) -> None:
    """Within ``rtol`` of the largest expected magnitude (plus ``elementwise`` of each element)."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    atol = rtol * float(expected.abs().max())
    torch.testing.assert_close(actual.double(), expected.double(), rtol=elementwise, atol=atol)


def output_grads(
    case: dict[str, torch.Tensor],
    log_probs: torch.Tensor,
    entropy: torch.Tensor | None,
    *,
    inputs: Sequence[torch.Tensor],
) -> tuple[torch.Tensor, ...]:
    """The gradients of ``inputs`` for the case's upstream gradients of log-probs and (if computed) entropy."""
    outputs, grads = [log_probs], [case["grad_log_probs"]]
    if entropy is not None:
        outputs.append(entropy)
        grads.append(case["grad_entropy"])
    return torch.autograd.grad(outputs, tuple(inputs), grads)


def vocab_shard(tensor: torch.Tensor, *, dim: int, rank: int, world_size: int) -> torch.Tensor:
    """This rank's contiguous slice of the vocabulary dimension ``dim``."""
    local = tensor.shape[dim] // world_size
    return tensor.narrow(dim, rank * local, local).contiguous()


def tp_worker(rank: int, world_size: int, cases: list[Any], run_case: Callable[..., Any]) -> list[Any]:
    """On every rank: ``run_case(case, rank=, world_size=, tp_group=)`` for each case over one fresh TP group."""
    group = dist.new_group(list(range(world_size)))
    return [run_case(case, rank=rank, world_size=world_size, tp_group=group) for case in cases]


class LargestTensor(TorchDispatchMode):
    """Records the element count of the largest tensor any op produces (of ``dtype`` only, if given)."""

    def __init__(self, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.dtype = dtype
        self.largest = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor) and self.dtype in (None, tensor.dtype):
                self.largest = max(self.largest, tensor.numel())
        return out
