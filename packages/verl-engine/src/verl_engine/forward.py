"""One micro-batch through the model on this rank: its share of the tokens in, per-token outputs merged over
the DP x CP pool out (log-probs / entropy through the vocab-parallel or fused head, or values), plus the MTP
loss term when training with multi-token prediction."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from verl_engine.fused_head import lm_head_returns_hidden
from verl_engine.logprobs import vocab_parallel_log_probs_and_entropy
from verl_engine.moe import MoeRouting
from verl_engine.mtp import MtpSettings, MtpTracker, run_mtp
from verl_engine.packed import CPLayout, PackedBatch, PlannedMicroBatch
from verl_engine.rl_batch import RLBatch

__all__ = ["ModelForward"]


class ModelForward:
    """Mixin of :class:`~verl_engine.engine.RLEngine`: the per-micro-batch forward."""

    cp_groups: Any
    cp_layout: CPLayout
    device: torch.device
    fused_lm_head: bool
    moe: MoeRouting | None
    mtp: MtpSettings | None
    tp_group: Any
    tp_size: int
    use_remove_padding: bool
    value_model: bool

    if TYPE_CHECKING:  # a property of RLEngine

        @property
        def pool_size(self) -> int: ...

    def _output_keys(self, entropy: bool) -> list[str]:
        if self.value_model:
            return ["values"]
        return ["log_probs", "entropy"] if entropy else ["log_probs"]

    def _stage_forward(
        self, model: torch.nn.Module, mb: PlannedMicroBatch, *, packed: PackedBatch
    ) -> torch.Tensor:
        """The chunk's raw output for this rank's share: activations before the last stage (input from
        ``set_input_tensor``), logits or values on it (packed path; the padded one post-processes them)."""
        if self.use_remove_padding:
            ids = mb.split.batch.input_ids[None]
            return model(
                input_ids=ids,
                position_ids=None,
                attention_mask=None,
                packed_seq_params=mb.packed_seq_params,
                **self._routing_kwargs(mb, ids),
            )
        rows, _, lens = self._padded_rows(mb, packed=packed)
        return model(
            input_ids=rows, position_ids=None, attention_mask=None, **self._routing_kwargs(mb, rows, lens)
        )

    def _routing_kwargs(
        self, mb: PlannedMicroBatch, ids: torch.Tensor, lens: Sequence[int] | None = None
    ) -> dict[str, torch.Tensor]:
        """``padding_mask`` (True at padding, ``ids``' shape) for a mixture-of-experts model whose
        megatron-core takes it: THD alignment padding, right-padding of padded rows and an idle group's dummy
        sequence are neither routed into the load-balancing statistics nor counted (:mod:`verl_engine.moe`)."""
        if self.moe is None or not self.moe.padding_mask:
            return {}
        if mb.split.is_dummy:
            return {"padding_mask": torch.ones_like(ids, dtype=torch.bool)}
        if lens is not None:  # padded rows [n, L]
            width = torch.arange(ids.shape[1], device=ids.device)
            return {"padding_mask": width[None] >= torch.tensor(list(lens), device=ids.device)[:, None]}
        return {"padding_mask": mb.split.batch.meta.is_padding.to(ids.device)[None]}

    def _forward(
        self,
        model: torch.nn.Module,
        mb: PlannedMicroBatch,
        *,
        packed: PackedBatch,
        temperature: float,
        entropy: bool,
        tracker: MtpTracker | None = None,
        mtp_packed: PackedBatch | None = None,
        mtp_counts: Sequence[int] = (),
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
        """This rank's share through the model, per-token outputs merged over the pool (label-aligned).

        Also returns the MTP loss term (``tracker`` given: training with MTP) or None.
        """
        from verl_dyncp.planner import dynamic_cp_merge_output, dynamic_cp_merge_outputs

        local = mb.split.batch
        gpt = _unwrap(model)
        captured: list[torch.Tensor] = []
        hook = None
        if tracker is not None:  # MTP starts from the decoder's final hidden states
            hook = gpt.decoder.register_forward_hook(lambda _m, _i, out: captured.append(out))
        head = lm_head_returns_hidden(gpt) if self.fused_lm_head else contextlib.nullcontext()
        try:
            with head as capture:  # fused: ``raw`` is the head's input [tokens, H], not logits
                if self.use_remove_padding:
                    raw = self._stage_forward(model, mb, packed=packed)[0]
                    labels = local.labels
                else:
                    raw, labels = self._padded_forward(model, mb, packed=packed)
        finally:
            if hook is not None:
                hook.remove()
        mtp_term = None
        if tracker is not None:
            assert self.mtp is not None and mtp_packed is not None
            sub = mtp_packed.select(mb.indices)
            mtp_term = run_mtp(
                gpt,
                hidden=captured[0],
                micro_batch=mb.split,
                packed_ids=sub.input_ids.to(self.device),
                label_mask=None if sub.label_mask is None else sub.label_mask.to(self.device),
                packed_seq_params=mb.packed_seq_params,
                settings=self.mtp,
                tp_group=self.tp_group if self.tp_size > 1 else None,
                counts=list(mtp_counts),
                pool_size=self.pool_size,
                tracker=tracker,
                padding_mask=self._routing_kwargs(mb, local.input_ids[None]).get("padding_mask"),
            )
        merged: dict[str, torch.Tensor] = {}
        if self.value_model:
            values = raw.squeeze(-1).float()
            merged["values"] = dynamic_cp_merge_output(values, micro_batch=mb.split, groups=self.cp_groups)
            return merged, mtp_term
        tp_group = self.tp_group if self.tp_size > 1 else None
        if capture is not None:
            log_probs, ent = capture.log_probs(
                raw, labels, tp_group=tp_group, temperature=temperature, compute_entropy=entropy
            )
        else:
            log_probs, ent = vocab_parallel_log_probs_and_entropy(
                raw, labels, tp_group=tp_group, temperature=temperature, compute_entropy=entropy
            )
        per_token = {"log_probs": log_probs} if ent is None else {"log_probs": log_probs, "entropy": ent}
        # one collective over the pool for both (a merge holds every rank until the slowest arrives)
        merged.update(dynamic_cp_merge_outputs(per_token, micro_batch=mb.split, groups=self.cp_groups))
        return merged, mtp_term

    def _padded_forward(
        self, model: torch.nn.Module, mb: PlannedMicroBatch, *, packed: PackedBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """use_remove_padding=False: this rank's sequences right-padded [n, L] (BSHD, causal, no mask).

        Outputs are put back into the packed local layout, so the merge and everything after it is the
        packed path's: the two paths differ only in how attention sees the tokens (CP size is 1 here).
        """
        split = mb.split
        rows, labels, lens = self._padded_rows(mb, packed=packed)
        # [n, L, V/tp] or [n, L, 1]
        out = model(
            input_ids=rows, position_ids=None, attention_mask=None, **self._routing_kwargs(mb, rows, lens)
        )
        flat_out = torch.cat([out[r, :n] for r, n in enumerate(lens)])
        flat_labels = torch.cat([labels[r, :n] for r, n in enumerate(lens)])
        if split.is_dummy:
            return flat_out, torch.full_like(flat_labels, -100)
        meta = split.batch.meta
        return meta.take(flat_out, pad_value=0), meta.take(flat_labels, pad_value=-100)

    def _padded_rows(
        self, mb: PlannedMicroBatch, *, packed: PackedBatch
    ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """This rank's sequences right-padded ``[n, L]``, their next-token labels, and their lengths."""
        split = mb.split
        if split.is_dummy:
            seqs = [split.batch.input_ids]
        else:  # split.sequence_indices are positions in the micro-batch, mb.indices the batch's sequences
            cu = packed.cu_seqlens
            seqs = [
                packed.input_ids[cu[i] : cu[i + 1]].to(self.device)
                for i in (mb.indices[j] for j in split.sequence_indices)
            ]
        lens = [int(s.shape[0]) for s in seqs]
        rows = torch.zeros((len(seqs), max(lens)), dtype=torch.int64, device=self.device)
        labels = torch.full_like(rows, -100)
        for r, s in enumerate(seqs):
            rows[r, : lens[r]] = s
            labels[r, : lens[r] - 1] = s[1:]
        return rows, labels, lens

    def _keep_outputs(
        self,
        batch: RLBatch,
        mb: PlannedMicroBatch,
        merged: Mapping[str, torch.Tensor],
        per_seq: dict[str, list[Any]],
    ) -> None:
        """Store each sequence's merged output (label-aligned, last slot zero) for the caller, detached."""
        offset = 0
        for i in mb.indices:
            n = batch.packed.seq_lens[i]
            for key, values in merged.items():
                slots = per_seq.setdefault(key, [None] * batch.size)
                piece = values[offset : offset + n].detach().clone()
                if key != "values":
                    piece[n - 1 :].zero_()  # the last token predicts nothing (no host scalar copied over)
                slots[i] = piece
            offset += n


def _unwrap(model: torch.nn.Module) -> Any:
    """The GPTModel inside DDP / Float16Module wrappers."""
    from verl_mcore_utils.module import unwrap_model

    return unwrap_model(model)
