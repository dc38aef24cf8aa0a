"""One optimizer step through megatron-core's own pipeline schedule, shared by the GPU test workers.

The GPU tests (construction, LoRA, offload, Megatron-FSDP) all train the same way: zero the DDP /
FSDP gradient buffers, run ``get_forward_backward_func()`` over a list of token micro-batches with the
mean token loss, step the megatron optimizer. Keeping that loop in one place means a change in how
megatron-core's schedule is called is made (and checked on a GPU) once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step reports.

    ``loss``: the mean micro-batch loss of each model, summed over models, averaged over all ranks
    (the same number on every rank). ``local_losses``: this rank's micro-batch losses, model by model.
    """

    loss: float
    local_losses: tuple[float, ...]
    grad_norm: float | None
    ok: bool


def schedule_step(
    models: Sequence[Sequence[torch.nn.Module]],
    optimizer: Any,
    micro_batches: Sequence[torch.Tensor],
    *,
    shift_labels: bool = False,
) -> StepResult:
    """One optimizer step over every model in ``models`` (each a list of chunks, its own schedule call).

    ``micro_batches``: token tensors [micro_batch, seq]. ``shift_labels``: predict token t+1 from
    tokens <= t (the tensors then hold seq + 1 tokens); otherwise the labels are the inputs themselves,
    which is all a parity test between two layouts needs. Every rank must call this (it all-reduces).
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if not micro_batches:
        raise ValueError("schedule_step needs at least one micro-batch")
    micro, width = micro_batches[0].shape
    seq = width - 1 if shift_labels else width
    device = micro_batches[0].device
    positions = torch.arange(seq, device=device).expand(micro, seq)

    def forward_step(data_iterator: Any, chunk: Any) -> tuple[torch.Tensor, Any]:
        tokens = next(data_iterator)
        if shift_labels:
            inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        else:
            inputs, labels = tokens, tokens
        per_token = chunk(input_ids=inputs, position_ids=positions, attention_mask=None, labels=labels)

        def loss_func(output: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            loss = output.float().mean()
            return loss, {"loss": loss.detach()}

        return per_token, loss_func

    for chunks in models:
        for chunk in chunks:
            chunk.zero_grad_buffer()
    optimizer.zero_grad()
    total = torch.zeros((), device=device)
    local: list[float] = []
    for chunks in models:
        result = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(micro_batches),
            model=list(chunks),
            num_microbatches=len(micro_batches),
            seq_length=seq,
            micro_batch_size=micro,
            forward_only=False,
        )
        losses = torch.stack([r["loss"] for r in result])
        local.extend(float(x) for x in losses)
        total += losses.mean()
    ok, grad_norm, _ = optimizer.step()
    torch.distributed.all_reduce(total)
    return StepResult(
        loss=float(total) / torch.distributed.get_world_size(),
        local_losses=tuple(local),
        grad_norm=None if grad_norm is None else float(grad_norm),
        ok=bool(ok),
    )
