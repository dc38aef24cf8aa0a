"""All local experts of an MoE layer in three grouped matmuls, without Transformer Engine.

megatron-core runs experts without Transformer Engine as ``SequentialMLP``: one MLP per local expert, a
Python loop of small GEMMs (and a host sync for ``tokens_per_expert.tolist()``). Its grouped modules need
Transformer Engine (``TEGroupedMLP``) or the ``grouped_gemm`` package (legacy ``GroupedMLP``). PyTorch has
its own grouped GEMM, ``torch._grouped_mm`` (CUTLASS on Hopper for bf16, a loop of matmuls elsewhere):
:class:`GroupedExperts` computes fc1, the (gated) activation and fc2 of every local expert with it.

Same interface and the same numbers as ``SequentialMLP``: ``forward(permuted_local_hidden_states,
tokens_per_expert, permuted_probs) -> (output, None)``; the routing weights scale the activation before fc2
(``MLP.forward``'s ``per_token_scale``), or the input with ``moe_apply_probs_on_input``. The weights are
stored stacked, one plain ``nn.Parameter`` per projection (no per-step copy, a distributed optimizer sees
two parameters): ``linear_fc1_weight`` ``[E, 2F, H]`` and ``linear_fc2_weight`` ``[E, H, F]``, where slice
``e`` is exactly expert ``e``'s ``local_experts.{e}.linear_fc1.weight`` / ``linear_fc2.weight`` of
``SequentialMLP``. :func:`expert_weight_views` names those slices with SequentialMLP's names, which is how
the Hugging Face weight table (one tensor per expert) loads and exports the stacked layout unchanged.

Not supported, refused by name: expert tensor parallelism (``expert_tensor_parallel_size > 1``), biases on
the experts (``add_bias_linear``), FP8/FP4, and the 0.19 GLU variants (``glu_linear_offset``,
``activation_func_clamp_value``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from megatron.core.transformer.module import MegatronModule

__all__ = ["GroupedExperts", "expert_weight_views", "grouped_linear", "swap_in_grouped_experts"]

# SequentialMLP's per-expert parameter names for slice e of each stacked parameter
_STACKED = {"linear_fc1_weight": "linear_fc1.weight", "linear_fc2_weight": "linear_fc2.weight"}


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(a, b, offs=offs)


class _GroupedLinear(torch.autograd.Function):
    """``y[rows of e] = x[rows of e] @ w[e].T`` for every expert e, with grouped matmuls in both directions.

    Its own backward rather than relying on ``_grouped_mm``'s derivative: the input gradient and the weight
    gradient are again grouped matmuls (the latter with the token dimension as the ragged one), and an
    expanded or non-contiguous output gradient is made contiguous first (the kernels need real strides).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight, offs)
        if x.shape[0] == 0:
            return x.new_zeros(0, weight.shape[1])
        return _grouped_mm(x, weight.transpose(1, 2), offs)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        x, weight, offs = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_x = grad_w = None
        if x.shape[0] == 0:
            grad_x = torch.zeros_like(x) if ctx.needs_input_grad[0] else None
            grad_w = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
            return grad_x, grad_w, None
        if ctx.needs_input_grad[0]:
            grad_x = _grouped_mm(grad_out, weight, offs)
        if ctx.needs_input_grad[1]:
            # [E, N, K]: expert e's rows of grad_out^T times its rows of x (ragged in the token dimension);
            # an expert without tokens gets a zero gradient
            grad_w = _grouped_mm(grad_out.t(), x, offs).to(weight.dtype)
        return grad_x, grad_w, None


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Per-expert linear layers (no bias) over token rows sorted by expert.

    ``x`` ``[T, K]``, ``weight`` ``[E, N, K]`` (each slice laid out like an ``nn.Linear`` weight), ``offs``
    int32 ``[E]``: the cumulative row ends (``cumsum(tokens_per_expert)``, last = T). Returns ``[T, N]``.
    """
    return _GroupedLinear.apply(x, weight, offs)


def _refuse_unsupported(config: Any) -> None:
    etp = getattr(config, "expert_tensor_parallel_size", None) or 1
    if etp > 1:
        raise ValueError(
            f"expert_tensor_parallel_size={etp}: GroupedExperts holds whole experts (no expert tensor"
            " parallelism); use expert_tensor_parallel_size=1 or moe_grouped_gemm=False (sequential experts)"
        )
    if config.add_bias_linear:
        raise ValueError(
            "add_bias_linear=True: GroupedExperts has no expert biases; use moe_grouped_gemm=False"
        )
    if getattr(config, "fp8", None) or getattr(config, "fp4", None):
        raise ValueError("fp8/fp4 with GroupedExperts is not supported (bf16/fp16/fp32 only)")
    if getattr(config, "glu_linear_offset", 0.0) or getattr(config, "activation_func_clamp_value", None):
        raise ValueError(
            "glu_linear_offset / activation_func_clamp_value are not supported by GroupedExperts"
        )
    if getattr(config, "use_te_activation_func", False):
        raise ValueError(
            "use_te_activation_func=True needs Transformer Engine; GroupedExperts is for runs without it"
        )


class GroupedExperts(MegatronModule):
    """megatron-core's experts interface (``SequentialMLP``'s) computed with grouped matmuls.

    Built by megatron-core's MoE layer in place of ``SequentialMLP`` (see :func:`verl_mcore_utils.model.
    local_layer_spec`, chosen by ``moe_grouped_gemm``): the constructor takes what either release passes
    (``pg_collection`` on 0.19, ``model_comm_pgs`` on 0.14, ``submodules`` from a ModuleSpec) and ignores
    the groups it does not need: experts are whole on this rank (expert TP is refused).
    """

    def __init__(
        self,
        num_local_experts: int,
        config: Any,
        submodules: Any = None,
        pg_collection: Any = None,
        model_comm_pgs: Any = None,
        name: str | None = None,
    ) -> None:
        _refuse_unsupported(config)
        super().__init__(config=config)
        self.num_local_experts = num_local_experts
        hidden, ffn = config.hidden_size, config.moe_ffn_hidden_size
        fc1_rows = 2 * ffn if config.gated_linear_unit else ffn
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        self.linear_fc1_weight = torch.nn.Parameter(
            torch.empty(num_local_experts, fc1_rows, hidden, dtype=config.params_dtype, device=device)
        )
        self.linear_fc2_weight = torch.nn.Parameter(
            torch.empty(num_local_experts, hidden, ffn, dtype=config.params_dtype, device=device)
        )
        self._mark_parameters()
        if config.perform_initialization:
            with torch.no_grad():
                for e in range(
                    num_local_experts
                ):  # per expert, as each ColumnParallel/RowParallelLinear does
                    config.init_method(self.linear_fc1_weight[e])
                    config.output_layer_init_method(self.linear_fc2_weight[e])

    def _mark_parameters(self) -> None:
        """The attributes megatron-core's expert linears carry, which its DDP and gradient norm read.

        ``allreduce=False`` under EP or with ETP other than TP (megatron-core's ``use_expert_pgs``): the gradient
        is reduced over the expert-data-parallel group, not the whole data-parallel group. Tensor-parallel attributes as megatron's column / row parallel linears
        (expert TP is 1, so every rank's copy counts once in the gradient norm).
        """
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        config = self.config
        etp = getattr(config, "expert_tensor_parallel_size", None) or config.tensor_model_parallel_size
        # megatron-core's linears: expert process groups under EP or when ETP differs from TP (ETP 1 at TP 2)
        expert_groups = (getattr(config, "expert_model_parallel_size", 1) or 1) > 1 or (
            etp != config.tensor_model_parallel_size
        )
        for param, dim in ((self.linear_fc1_weight, 1), (self.linear_fc2_weight, 2)):
            param.allreduce = not expert_groups  # type: ignore[attr-defined]  # megatron's attribute
            set_tensor_model_parallel_attributes(param, is_parallel=True, dim=dim, stride=1)

    def _activation(self, fc1_out: torch.Tensor) -> torch.Tensor:
        if self.config.gated_linear_unit:
            gate, linear = torch.chunk(fc1_out, 2, dim=-1)
            return self.config.activation_func(gate) * linear
        return self.config.activation_func(fc1_out)

    def forward(
        self,
        permuted_local_hidden_states: torch.Tensor,
        tokens_per_expert: torch.Tensor,
        permuted_probs: torch.Tensor,
    ) -> tuple[torch.Tensor, None]:
        """Rows sorted by local expert (``tokens_per_expert`` of them each) -> expert outputs, same order."""
        hidden = permuted_local_hidden_states
        if self.config.moe_apply_probs_on_input:
            if self.config.moe_router_topk != 1:
                raise ValueError(
                    "moe_apply_probs_on_input only works with moe_router_topk=1 (as megatron-core)"
                )
            hidden = (permuted_probs.unsqueeze(-1) * hidden).to(permuted_local_hidden_states.dtype)
            permuted_probs = torch.ones_like(permuted_probs)
        counts = torch.as_tensor(tokens_per_expert, device=hidden.device)
        offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
        intermediate = self._activation(grouped_linear(hidden, self.linear_fc1_weight, offs))
        intermediate = (intermediate * permuted_probs.unsqueeze(-1)).to(intermediate.dtype)
        return grouped_linear(intermediate, self.linear_fc2_weight, offs), None

    def backward_dw(self) -> None:
        """Weight gradients are computed in backward (megatron-core's delayed-wgrad hook is a no-op here)."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Any = None) -> Any:
        if (getattr(self.config, "expert_model_parallel_size", 1) or 1) > 1:
            raise NotImplementedError(
                "GroupedExperts.sharded_state_dict with expert_model_parallel_size > 1: megatron-core's"
                " distributed checkpoint layout of stacked experts is not implemented (the engine's own"
                " checkpoint reads named_parameters and is unaffected)"
            )
        return super().sharded_state_dict(prefix, sharded_offsets, metadata)


def expert_weight_views(name: str, param: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]] | None:
    """The per-expert slices of a stacked GroupedExperts parameter, under SequentialMLP's names.

    ``...mlp.experts.linear_fc1_weight`` -> ``(...mlp.experts.local_experts.{e}.linear_fc1.weight,
    param[e])`` for each local expert e; ``None`` for any other parameter. The slices are views: writing one
    (weight load) writes the stacked parameter, reading one (export) reads it.
    """
    head, _, leaf = name.rpartition(".")
    if leaf not in _STACKED or not head.endswith("experts"):
        return None
    return ((f"{head}.local_experts.{e}.{_STACKED[leaf]}", param[e]) for e in range(param.shape[0]))


@torch.no_grad()
def swap_in_grouped_experts(model: torch.nn.Module) -> int:
    """Replace every ``SequentialMLP`` of a built model with a :class:`GroupedExperts` holding its weights.

    For models built elsewhere (another layer spec); the weights are copied once, at the swap. Returns the
    number of expert modules replaced.
    """
    from megatron.core.transformer.moe.experts import SequentialMLP

    count = 0
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if not isinstance(child, SequentialMLP):
                continue
            experts = child.local_experts
            config = child.config
            grouped = GroupedExperts.__new__(GroupedExperts)
            MegatronModule.__init__(grouped, config=config)
            _refuse_unsupported(config)
            grouped.num_local_experts = len(experts)
            grouped.linear_fc1_weight = torch.nn.Parameter(
                torch.stack([e.linear_fc1.weight for e in experts])
            )
            grouped.linear_fc2_weight = torch.nn.Parameter(
                torch.stack([e.linear_fc2.weight for e in experts])
            )
            grouped._mark_parameters()
            setattr(module, child_name, grouped)
            count += 1
    return count


def use_grouped_experts(layer_spec: Any) -> Any:
    """Make a local GPT layer spec's MoE layer build :class:`GroupedExperts` instead of SequentialMLP.

    megatron-core 0.19 keeps the experts as a builder called with ``(num_local_experts, config, ...)``
    (``functools.partial(SequentialMLP, submodules=...)``); 0.14 keeps a ``ModuleSpec`` that ``build_module``
    instantiates. The spec is changed in place and returned.
    """
    from functools import partial

    from megatron.core.transformer.spec_utils import ModuleSpec

    # the MoE layer: a ModuleSpec (0.14) or functools.partial(MoELayer, submodules=...) (0.19)
    mlp = layer_spec.submodules.mlp
    moe = mlp.submodules if isinstance(mlp, ModuleSpec) else mlp.keywords["submodules"]
    if isinstance(moe.experts, ModuleSpec):
        moe.experts = ModuleSpec(module=GroupedExperts, submodules=moe.experts.submodules)
    else:
        moe.experts = partial(
            GroupedExperts, submodules=getattr(moe.experts, "keywords", {}).get("submodules")
        )
    return layer_spec
