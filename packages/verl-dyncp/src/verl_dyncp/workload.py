"""The workload model the planner balances: the modelled cost of one sequence from its length."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["GEMM_ROOFLINE_TOKENS", "MEASURED_ATTENTION_COST_FACTOR", "WorkloadModel"]

# How much slower a FLOP of causal attention runs than a FLOP of the dense layers (forward + backward) with
# verl-dyncp's CP-1 kernels, as measured by benchmarks/dyncp_plan_sim_gpu.py (docs/benchmarks.md); the
# engine's planner uses it.
MEASURED_ATTENTION_COST_FACTOR = 3.0

# Below about this many tokens per rank a bf16 matmul reads its weights for longer than it computes: the
# roofline's ridge, peak FLOP/s over memory bytes/s, is ~295 FLOP/byte on an H100 (989 TFLOP/s, 3.35 TB/s)
# and ~206 on an H200 (4.8 TB/s), and a [T, h] x [h, f] matmul does T FLOPs per weight byte. A rank with fewer
# tokens takes about as long as one with this many, so splitting a short micro-batch over more ranks gains
# nothing and adds CP's collectives.
GEMM_ROOFLINE_TOKENS = 256


@dataclass(frozen=True)
class WorkloadModel:
    """Cost of one sequence of ``L`` tokens: ``quadratic * L**2 + linear * L`` (integers, so plans are exact).

    The quadratic term is attention; the linear term is everything per token (projections, MLP). For a
    dense transformer of hidden size ``h`` the ratio is about ``12 * h`` (:meth:`for_transformer`).
    ``min_rank_tokens``: the least dense work a rank does, whatever it holds (:attr:`rank_floor`): below
    about :data:`GEMM_ROOFLINE_TOKENS` tokens the matmuls are bound by reading the weights, not by tokens.
    """

    quadratic: int = 1
    linear: int = 0
    min_rank_tokens: int = 0

    def __post_init__(self) -> None:
        for name in ("quadratic", "linear", "min_rank_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"WorkloadModel.{name} must be an int >= 0, got {v!r}")
        if self.quadratic == 0 and self.linear == 0:
            raise ValueError("WorkloadModel needs a non-zero quadratic or linear coefficient")

    @classmethod
    def for_transformer(
        cls,
        *,
        hidden_size: int,
        ffn_hidden_size: int | None = None,
        gated_linear_unit: bool = False,
        num_attention_heads: int | None = None,
        num_query_groups: int | None = None,
        kv_channels: int | None = None,
        num_layers: int | None = None,
        vocab_size: int | None = None,
        attention_cost_factor: float = 1.0,
        min_rank_tokens: int = GEMM_ROOFLINE_TOKENS,
    ) -> WorkloadModel:
        """The workload model from the FLOPs of one layer: dense work per token vs causal attention per token.

        Forward FLOPs per token of one layer: QKV ``2 h (a + 2 g d)``, output projection ``2 a h``, MLP
        ``2 h f (2 if gated else 1) + 2 f h`` (``a = heads x d``, ``g`` query groups, ``d`` = kv_channels,
        ``f`` = ffn_hidden_size), plus the LM head ``2 h V`` spread over ``num_layers`` when both are given;
        causal attention over a sequence of ``L`` tokens: ``2 L a`` per token (scores and values over ``L/2``
        keys on average). So ``cost(L) ~ quadratic * L^2 + linear * L`` with ``linear / quadratic = dense /
        (2 a x attention_cost_factor)``; ``attention_cost_factor`` is how much slower a FLOP of the attention
        kernel runs than a FLOP of the matmuls (measured by ``benchmarks/dyncp_plan_sim_gpu.py``). With only
        ``hidden_size`` (``f = 4 h``, no GQA, no head) the ratio is ``12 h``, the classic estimate.
        ``min_rank_tokens``: see the class (0: no floor).
        """
        h = check_pos_int("hidden_size", hidden_size)
        heads = num_attention_heads
        d = kv_channels if kv_channels is not None else (h // heads if heads else None)
        a = heads * d if heads and d else h
        groups = num_query_groups if num_query_groups is not None else (heads or 1)
        kv = groups * d if d else h
        f = ffn_hidden_size if ffn_hidden_size is not None else 4 * h
        if not attention_cost_factor > 0:
            raise ValueError(f"attention_cost_factor must be > 0, got {attention_cost_factor!r}")
        dense: float = (
            2 * h * (a + 2 * kv) + 2 * a * h + 2 * h * f * (2 if gated_linear_unit else 1) + 2 * f * h
        )
        if num_layers and vocab_size:
            dense += 2 * h * vocab_size / num_layers
        linear = max(1, round(dense / (2 * a * attention_cost_factor)))
        return cls(quadratic=1, linear=linear, min_rank_tokens=min_rank_tokens)

    @classmethod
    def from_transformer_config(
        cls,
        config: Any,
        *,
        vocab_size: int | None = None,
        attention_cost_factor: float = 1.0,
        min_rank_tokens: int = GEMM_ROOFLINE_TOKENS,
    ) -> WorkloadModel:
        """:meth:`for_transformer` with the shape of a megatron-core ``TransformerConfig`` (hidden and FFN
        sizes, gated MLP, heads, query groups, kv_channels, layers) and the LM head's ``vocab_size``."""
        return cls.for_transformer(
            hidden_size=config.hidden_size,
            ffn_hidden_size=config.ffn_hidden_size,
            gated_linear_unit=bool(config.gated_linear_unit),
            num_attention_heads=config.num_attention_heads,
            num_query_groups=config.num_query_groups,
            kv_channels=config.kv_channels,
            num_layers=config.num_layers,
            vocab_size=vocab_size,
            attention_cost_factor=attention_cost_factor,
            min_rank_tokens=min_rank_tokens,
        )

    @property
    def rank_floor(self) -> int:
        """The least a rank's share of a micro-batch costs: the dense work of ``min_rank_tokens`` tokens."""
        return self.linear * self.min_rank_tokens

    def cost(self, length: int) -> int:
        return self.quadratic * length * length + self.linear * length


def check_pos_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value
