"""Rotary embedding that computes on the device it is told to use.

megatron-core's RotaryEmbedding moves its ``inv_freq`` to ``torch.cuda.current_device()`` on the first
forward call, which fails on a CPU-only machine. :func:`make_rope_portable` swaps the class of the
model's rotary module for this subclass, which keeps the same state and results but computes on an
explicit device. Context-parallel slicing is left to verl-dyncp.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

__all__ = ["PortableRotaryEmbedding", "make_rope_portable"]


class PortableRotaryEmbedding(RotaryEmbedding):
    """RotaryEmbedding whose frequencies live on ``self.target_device`` (set by make_rope_portable)."""

    target_device: torch.device
    inv_freq: torch.Tensor  # set by RotaryEmbedding.__init__

    def forward(  # type: ignore[override]
        self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group: Any = None, **_: Any
    ) -> torch.Tensor:
        if self.inv_freq.device != self.target_device:
            self.inv_freq = self.inv_freq.to(self.target_device)
        group = cp_group if cp_group is not None else getattr(self, "cp_group", None)
        if group is not None and group.size() > 1 and not packed_seq:
            raise ValueError(
                "context-parallel RoPE slicing needs verl_dyncp; this model was built for CP size 1"
            )
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)
        if self.rotary_interleaved:
            emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
        else:
            emb = torch.cat((freqs, freqs), dim=-1)
        return emb[:, None, None, :]  # [s, 1, 1, dim]


def make_rope_portable(model: torch.nn.Module, device: torch.device | str) -> int:
    """Turn every RotaryEmbedding inside ``model`` into a PortableRotaryEmbedding on ``device``.

    Returns the number of modules changed.
    """
    count = 0
    for module in model.modules():
        if type(module) is RotaryEmbedding:
            module.__class__ = PortableRotaryEmbedding
            count += 1
        if isinstance(module, PortableRotaryEmbedding):
            module.target_device = torch.device(device)
    return count
