"""Multi-token prediction (MTP) in the RL engine: targets per packed sequence, the loss, and its metrics.

Targets come from each sequence's own tokens before the CP split, so they never cross a sequence or a shard
border; the loss is normalised like the main loss, so its gradient does not depend on micro-batching, DP or CP.
Design notes: the package README.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from verl_mcore_utils.transfer import to_device_async

__all__ = ["MtpSettings", "MtpTracker", "mtp_metric_name", "mtp_target_counts", "run_mtp"]


def mtp_metric_name(depth: int) -> str:
    """verl's metric name of depth ``depth`` (1-based)."""
    return f"mtp_losses/mtp_{depth}_loss"


@dataclass(frozen=True)
class MtpSettings:
    """What the engine does with the model's MTP layers (from ``actor_rollout_ref.model.mtp``)."""

    num_layers: int
    scaling_factor: float = 0.1
    detach_encoder: bool = False

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ValueError(f"MtpSettings.num_layers must be >= 1, got {self.num_layers}")
        if self.scaling_factor < 0:
            raise ValueError(f"mtp_loss_scaling_factor must be >= 0, got {self.scaling_factor}")


def ahead_valid(seq_lens: tuple[int, ...], *, shift: int, device: torch.device | None = None) -> torch.Tensor:
    """Per packed token: does its sequence have a token ``shift`` positions ahead."""
    lens = torch.tensor(seq_lens, dtype=torch.int64)
    pos = torch.arange(int(lens.sum())) - torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens)
    valid = pos + shift < torch.repeat_interleave(lens, lens)
    return valid if device is None else to_device_async(valid, device)


def mtp_target_counts(packed: Any, *, num_layers: int) -> list[int]:
    """Valid targets of every depth over a whole packed batch (the loss normaliser, same on every rank)."""
    counts = []
    n = packed.input_ids.shape[0]
    for k in range(1, num_layers + 1):
        shift = k + 1
        valid = ahead_valid(packed.seq_lens, shift=shift)
        if packed.label_mask is not None:
            shifted = torch.zeros(n, dtype=torch.bool)
            if n > shift:
                shifted[: n - shift] = packed.label_mask.cpu()[shift:]
            valid &= shifted
        counts.append(int(valid.sum()))
    return counts


@dataclass
class MtpTracker:
    """Per-depth local (cross-entropy sum, target count) of one call, on a rank that runs MTP."""

    num_layers: int
    device: torch.device
    sums: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.sums = torch.zeros((self.num_layers, 2), dtype=torch.float64, device=self.device)

    def add(self, depth: int, *, loss_sum: torch.Tensor, count: torch.Tensor) -> None:
        self.sums[depth - 1, 0] += loss_sum.detach().double()
        self.sums[depth - 1, 1] += count.detach().double()

    def reduce(self, *, group: dist.ProcessGroup | None) -> dict[str, float]:
        """SUM over ``group`` (the DP x CP pool) and the per-depth mean cross-entropy, on every caller.

        Every rank of ``group`` must call this (it is a collective); zero valid targets gives 0.0.
        """
        totals = self.sums.clone()
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(totals, group=group)
        return {
            mtp_metric_name(k + 1): float(totals[k, 0] / totals[k, 1].clamp(min=1.0))
            for k in range(self.num_layers)
        }


def run_mtp(
    gpt: Any,
    *,
    hidden: torch.Tensor,
    micro_batch: Any,
    packed_ids: torch.Tensor,
    label_mask: torch.Tensor | None,
    packed_seq_params: Any,
    settings: MtpSettings,
    tp_group: dist.ProcessGroup | None,
    counts: list[int],
    pool_size: int,
    tracker: MtpTracker,
    padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The MTP layers on this rank's share; returns the term to add to the training loss.

    ``gpt`` is the unwrapped last-stage GPTModel with ``gpt.mtp`` (verl_dyncp builds it); ``hidden``
    the decoder's output for this rank's tokens ([s, 1, h]); ``packed_ids`` / ``label_mask`` the whole
    micro-batch packed (the split's source); ``counts`` the call's valid targets per depth.
    ``padding_mask``: the decoder's (``[1, s]``, True at padding) for MoE MTP layers: a position is padding at
    every depth when its own token is (a real token whose token ``t + k`` lies past its sequence end is
    routed and counted, as megatron-core's rolled mask does).
    """
    from verl_dyncp.planner import dynamic_cp_take_ahead
    from verl_engine.logprobs import vocab_parallel_log_probs_and_entropy
    from verl_mcore_utils.mtp import mtp_layer_forward

    weight = gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights else None
    if weight is None:
        weight = gpt.output_layer.weight
    weight = weight.detach()  # MTP must not train the LM head
    # the last stage's copy of the word embedding with pipeline stages, else the model's own
    embedding = getattr(gpt, "mtp_embedding", None)
    if embedding is None:
        embedding = gpt.embedding
    total = hidden.new_zeros((), dtype=torch.float32)
    h = hidden
    for k in range(1, settings.num_layers + 1):
        inputs = dynamic_cp_take_ahead(packed_ids, micro_batch=micro_batch, shift=k, fill=0)
        targets = dynamic_cp_take_ahead(packed_ids, micro_batch=micro_batch, shift=k + 1, fill=-100)
        valid = targets >= 0
        if label_mask is not None:
            valid &= dynamic_cp_take_ahead(label_mask, micro_batch=micro_batch, shift=k + 1, fill=False)
        embedded = embedding(input_ids=inputs[None], position_ids=None)
        if settings.detach_encoder:
            embedded, h = embedded.detach(), h.detach()
        h = mtp_layer_forward(
            gpt.mtp.layers[k - 1],
            hidden_states=h,
            decoder_input=embedded,
            packed_seq_params=packed_seq_params,
            padding_mask=padding_mask,
        )
        logits, _ = gpt.output_layer(h, weight=weight)
        log_probs, _ = vocab_parallel_log_probs_and_entropy(
            logits[:, 0], torch.where(valid, targets, -100), tp_group=tp_group, compute_entropy=False
        )
        loss_sum = -(log_probs * valid).sum()
        tracker.add(k, loss_sum=loss_sum, count=valid.sum())
        share = loss_sum / max(counts[k - 1], 1) * pool_size
        total = total + settings.scaling_factor / settings.num_layers * share
    return total
