"""The training engine: one model, its optimizer and ``train_step`` over micro-batches.

Two backends run the same megatron-core GPTModel code:

* ``megatron`` (CUDA): the model wrapped by verl_mcore_utils.make_megatron_module (Float16Module +
  megatron-core DistributedDataParallel, config from build_ddp_config) or, with
  ``megatron.use_megatron_fsdp``, by verl_mfsdp.make_megatron_fsdp_module (Megatron-FSDP);
  megatron-core's optimizer (distributed or not) and its forward-backward schedule.
* ``debug`` (CPU only, clearly labelled): gloo process group, no DDP wrapper, torch.optim.AdamW,
  float32; gradients are summed over DP with plain all-reduces. megatron-core's DDP buffers,
  optimizers and schedules hard-code CUDA, so this is how the model code is exercised without a GPU.

Both are :mod:`verl_engine.backends` objects (shared with the RL engine): the engine's methods delegate
to them instead of branching. Both compute the same objective (verl_engine.loss), so a debug run on N
gloo processes and a single-process run give the same gradients.

Two input forms: padded ``Batch`` micro-batches (``train_step``) and, when the engine is built with a
:class:`verl_engine.packed.CPLayout`, packed sequences (``train_step_packed`` / ``compute_log_probs``)
split over the DP x CP ranks by verl-dyncp with static or dynamic context parallelism.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from verl_config import SFTConfig
from verl_engine.backends import DebugBackend, MegatronBackend, debug_adamw
from verl_engine.data import Batch
from verl_engine.lifetime import Closeable
from verl_engine.loss import masked_loss_sum
from verl_engine.packed import (
    CPLayout,
    PackedBatch,
    PlannedMicroBatch,
    check_same_batch_on_every_rank,
    plan_micro_batches,
    split_packed_micro_batches,
)
from verl_engine.pipeline import PipelineLayout
from verl_mcore_utils.compat import make_megatron_optimizer
from verl_mcore_utils.ddp import WrapConfig
from verl_mcore_utils.module import GPTModelProvider, attach_training_hooks, make_megatron_module
from verl_mcore_utils.parallel import ParallelDims
from verl_mcore_utils.transformer_config import hf_get, hf_to_transformer_config
from verl_mcore_utils.wgrad_fusion import with_wgrad_fusion

if TYPE_CHECKING:
    from verl_dyncp.planner import WorkloadModel

__all__ = ["Engine", "StepMetrics", "build_engine", "lr_at_step"]


@dataclass(frozen=True)
class StepMetrics:
    """What one optimizer step reports (identical on every rank)."""

    loss: float  # mean token loss over the global batch
    grad_norm: float
    loss_tokens: int  # global number of tokens in the loss
    lr: float


def lr_at_step(
    step: int, *, total_steps: int, lr: float, min_lr: float, warmup_steps: int, style: str
) -> float:
    """Linear warm-up, then constant / linear / cosine decay to ``min_lr`` at ``total_steps``."""
    if warmup_steps > 0 and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if style == "constant" or total_steps <= warmup_steps:
        return lr
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if style == "linear":
        return min_lr + (lr - min_lr) * (1.0 - progress)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


class Engine(Closeable):
    """A built model + optimizer; ``train_step`` runs one optimizer step over micro-batches."""

    def __init__(
        self,
        *,
        model: torch.nn.Module,
        optimizer: Any,
        runner: DebugBackend | MegatronBackend,
        dims: ParallelDims,
        device: torch.device,
        cp_layout: CPLayout | None = None,
        cp_groups: Any = None,
        cp_workload: WorkloadModel | None = None,
        fused_lm_head: bool = False,
    ) -> None:
        self.model = model
        # what the backends read from any engine (verl_engine.backends): one chunk, no pipeline stages, no MTP
        self.chunks = [model]
        self.pipeline = PipelineLayout.single_stage()
        self.mtp_embedding_copy = False
        self.optimizer = optimizer
        self.runner = runner
        self.dims = dims
        self.device = device
        self.cp_layout = cp_layout
        self.cp_groups = cp_groups
        # verl_dyncp.WorkloadModel the planner balances (attention L^2 + dense layers ~ 12 h L per
        # sequence); None = attention only, which piles short sequences onto one rank.
        self.cp_workload = cp_workload
        # model.use_fused_kernels: the LM head's matmul inside the chunked loss (verl_engine.fused_head), so
        # [tokens, vocab] logits never exist; else megatron-core's output layer and cross-entropy.
        self.fused_lm_head = fused_lm_head

    @property
    def debug(self) -> bool:
        """True on the CPU debug backend (no megatron DDP / optimizer / schedule)."""
        return isinstance(self.runner, DebugBackend)

    @property
    def backend(self) -> str:
        return self.runner.describe(self.model)

    def describe(self) -> dict[str, Any]:
        """What actually runs: wrapper, optimizer classes and the DDP settings in effect."""
        info: dict[str, Any] = {"backend": self.backend, "model_wrapper": type(self.model).__name__}
        if self.cp_layout is not None:
            info["packed"] = self.cp_layout.describe()
        opt = self.optimizer
        inner = getattr(opt, "chained_optimizers", None) or [opt]
        info["optimizer"] = [type(o).__name__ for o in inner]
        ddp_config = getattr(self.model, "ddp_config", None)
        if ddp_config is not None:
            info["ddp_config"] = {
                k: getattr(ddp_config, k)
                for k in (
                    "use_distributed_optimizer",
                    "use_megatron_fsdp",
                    "data_parallel_sharding_strategy",
                    "overlap_grad_reduce",
                    "grad_reduce_in_fp32",
                    "bucket_size",
                )
                if hasattr(ddp_config, k)
            }
        return info

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def _global_count(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        if self.dims.dp > 1:
            dist.all_reduce(t, group=parallel_state.get_data_parallel_group())
        return float(t.item())

    def compute_gradients(self, micro_batches: list[Batch]) -> tuple[float, int]:
        """Forward/backward every micro-batch of this rank and reduce gradients over DP.

        Afterwards every rank holds the gradient of the global-batch token-mean loss (in ``.grad`` for
        the debug backend, in DDP's ``main_grad`` buffers for megatron). Returns (global token-mean
        loss, global loss-token count), identical on every rank.
        """
        if not micro_batches:
            raise ValueError("compute_gradients needs at least one micro-batch")
        global_tokens = self._global_count(sum(mb.num_loss_tokens for mb in micro_batches))
        if global_tokens == 0:
            raise ValueError(
                "the global batch has no loss tokens (every loss_mask is 0); nothing to train on"
            )
        micro_batches = [mb.to(self.device) for mb in micro_batches]
        loss_sum = self._backward(
            micro_batches,
            self._padded_forward,
            global_tokens=global_tokens,
        )
        return self._global_count(loss_sum) / global_tokens, int(global_tokens)

    def compute_gradients_packed(self, batch: PackedBatch) -> tuple[float, int]:
        """Like :meth:`compute_gradients` for a packed global batch split by the engine's CP layout.

        ``batch`` is the whole step's batch, identical on every rank (checked). The loss of every rank is
        its own tokens' loss sum over the GLOBAL loss-token count, so the reduced gradient is the no-CP
        gradient of the mean token loss whatever the CP sizes and micro-batches.
        """
        prepared = self._prepare_packed(batch)
        global_tokens = batch.num_loss_tokens
        if global_tokens == 0:
            raise ValueError(
                "the packed batch has no loss tokens (label_mask selects nothing); nothing to train on"
            )
        loss_sum = self._backward(
            prepared,
            self._packed_forward,
            global_tokens=float(global_tokens),
        )
        return self._global_count(loss_sum) / global_tokens, global_tokens

    @torch.no_grad()
    def compute_log_probs(self, batch: PackedBatch) -> torch.Tensor:
        """Per-token log-probabilities of a packed batch under the current weights (log-prob inference).

        Returns float32 ``[total tokens]`` on the engine's device, identical on every rank, in the
        batch's order: entry ``t`` is ``log p(x_t | x_<t)`` of its sequence, 0 for each sequence's first
        token. Runs with the same CP layout as training; every rank's local results are merged back
        into the original order (verl_dyncp.dynamic_cp_merge_output).
        """
        from verl_dyncp.planner import dynamic_cp_merge_output

        prepared = self._prepare_packed(batch)
        cu = batch.cu_seqlens
        out = torch.zeros(cu[-1], dtype=torch.float32, device=self.device)
        was_training = self.model.training
        self.model.eval()  # inference: no dropout
        try:
            for indices, mb, params in prepared:
                per_token_loss, _ = self._packed_forward(self.model, (indices, mb, params))
                merged = dynamic_cp_merge_output(
                    -per_token_loss.reshape(-1).float(), micro_batch=mb, groups=self.cp_groups
                )
                offset = 0
                for i in indices:  # merged is label-aligned: slot j predicts token j + 1 of the sequence
                    n = batch.seq_lens[i]
                    out[cu[i] + 1 : cu[i] + n] = merged[offset : offset + n - 1]
                    offset += n
        finally:
            self.model.train(was_training)
        return out

    def _prepare_packed(self, batch: PackedBatch) -> list[PlannedMicroBatch]:
        """Check the batch is the same on every rank, cut it into micro-batches and split each one."""
        if self.cp_layout is None or self.cp_groups is None:
            raise RuntimeError(
                "this engine was built without a CP layout; pass cp_layout=CPLayout(...) (or"
                " cp_layout_from_config(megatron_config)) to build_engine to train on packed batches"
            )
        check_same_batch_on_every_rank(
            batch,
            device=self.device,
            message="ranks were given different packed batches (lengths, tokens or label_mask differ); the packed"
            " path needs the whole step's batch, identical, on every rank",
        )
        if not batch.seq_lens:
            raise ValueError(
                "empty batch: the packed batch has no sequences; give every step at least one sequence"
            )
        layout = self.cp_layout
        budget = layout.token_budget_per_rank
        assert budget is not None  # CPLayout validates it
        return plan_micro_batches(
            batch,
            split_packed_micro_batches(batch.seq_lens, max_tokens=budget * self.cp_groups.world_size),
            layout=layout,
            groups=self.cp_groups,
            tp_size=self.dims.tp,
            workload=self.cp_workload,
            device=self.device,
            max_tokens_per_rank=budget,
        )

    def named_gradients(self) -> dict[str, torch.Tensor]:
        """Reduced gradients by parameter name (``main_grad`` under megatron DDP), as fp32 CPU copies."""
        out: dict[str, torch.Tensor] = {}
        for name, p in self.model.named_parameters():
            grad = self.runner.gradient(p)
            if grad is not None:
                # DDP and Float16Module each add one "module." in front of the GPTModel's names.
                out[name.removeprefix("module.").removeprefix("module.")] = (
                    grad.detach().float().cpu().clone()
                )
        return out

    def optimizer_step(self) -> float:
        """Clip, step the optimizer; return the gradient norm before clipping."""
        return self.runner.step(self)

    def train_step(self, micro_batches: list[Batch], *, lr: float) -> StepMetrics:
        """One optimizer step over this rank's micro-batches at learning rate ``lr``."""
        loss, tokens = self.compute_gradients(micro_batches)
        return self._finish_step(loss, tokens, lr=lr)

    def _finish_step(self, loss: float, tokens: int, *, lr: float) -> StepMetrics:
        """Set ``lr``, step the optimizer on the gradients just computed, report the step."""
        self.set_lr(lr)
        grad_norm = self.optimizer_step()
        return StepMetrics(loss=loss, grad_norm=grad_norm, loss_tokens=tokens, lr=lr)

    def _padded_forward(self, model: torch.nn.Module, mb: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        out = self._token_losses(
            model,
            labels=mb.labels,
            input_ids=mb.input_ids,
            position_ids=mb.position_ids,
            attention_mask=None,
        )
        return out, mb.loss_mask

    def _packed_forward(
        self, model: torch.nn.Module, item: tuple[tuple[int, ...], Any, Any]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        _, mb, params = item
        b = mb.batch
        # Positions come from the THD layout inside the attention (RoPE of the no-CP run); labels of
        # padding / last tokens are masked out of the loss (megatron's cross-entropy needs them clamped
        # to a valid id, the fused head ignores them).
        out = self._token_losses(
            model,
            labels=b.labels[None],
            input_ids=b.input_ids[None],
            position_ids=None,
            attention_mask=None,
            packed_seq_params=params,
        )
        return out, b.loss_mask[None]

    def _token_losses(self, model: torch.nn.Module, *, labels: torch.Tensor, **inputs: Any) -> torch.Tensor:
        """Per-token cross-entropy ``[b, s]``: megatron-core's (vocab-parallel under TP) or the fused head's."""
        if not self.fused_lm_head:
            return model(**inputs, labels=labels.clamp(min=0))
        from verl_engine.fused_head import lm_head_returns_hidden
        from verl_mcore_utils.module import unwrap_model

        with lm_head_returns_hidden(unwrap_model(model)) as head:
            hidden = model(**inputs, labels=None)
        log_probs, _ = head.log_probs(
            hidden,
            labels,
            tp_group=parallel_state.get_tensor_model_parallel_group() if self.dims.tp > 1 else None,
            compute_entropy=False,
        )
        return -log_probs

    def _backward(
        self,
        items: Sequence[Any],
        forward: Callable[[torch.nn.Module, Any], tuple[torch.Tensor, torch.Tensor]],
        *,
        global_tokens: float,
    ) -> float:
        """Forward + backward of every item through the backend; returns this rank's masked loss sum.

        Each item's loss is its masked sum over the GLOBAL token count times the pool size: both backends
        average gradients over the pool (DDP / the debug all-reduce), so the result is the gradient of
        the global token mean.
        """
        pool = self.dims.dp
        sums: list[torch.Tensor] = []

        def step(item: Any, model: torch.nn.Module) -> torch.Tensor:
            s = masked_loss_sum(*forward(model, item))
            sums.append(s.detach())
            return s / global_tokens * pool

        self.runner.zero_grad(self)
        self.runner.run(self, items, step, forward_only=False)
        return float(sum(float(s) for s in sums))

    def train_step_packed(self, batch: PackedBatch, *, lr: float) -> StepMetrics:
        """One optimizer step over a packed global batch (see :meth:`compute_gradients_packed`)."""
        loss, tokens = self.compute_gradients_packed(batch)
        return self._finish_step(loss, tokens, lr=lr)


def build_engine(
    cfg: SFTConfig,
    *,
    hf_config: Mapping[str, Any],
    dims: ParallelDims,
    device: torch.device,
    cp_layout: CPLayout | None = None,
) -> Engine:
    """Build the model and optimizer for ``cfg`` on ``device`` (CPU means the debug backend).

    With ``cp_layout`` the model takes packed (THD) batches through verl-dyncp's attention and the
    engine creates the CP groups of the DP x CP pool; megatron-core must then have been initialised
    with ``context_parallel_size=1`` (its data-parallel group is the pool).
    """
    m, o = cfg.megatron, cfg.optim
    debug = device.type == "cpu"
    dtype = "float32" if debug else m.dtype
    if cp_layout is None and (m.context_parallel_size > 1 or m.dynamic_context_parallel):
        raise ValueError(
            "megatron.context_parallel_size > 1 / megatron.dynamic_context_parallel need packed batches:"
            " build the engine with cp_layout=cp_layout_from_config(cfg.megatron, ...) and train with"
            " train_step_packed"
        )
    if cp_layout is not None and dims.cp != 1:
        raise ValueError(
            f"the packed path runs CP through verl-dyncp's groups: initialise megatron-core with"
            f" context_parallel_size=1 (got {dims.cp}); the DP x CP pool is world / (TP x PP)"
        )
    tf_config = hf_to_transformer_config(
        hf_config,
        dtype=dtype,
        tensor_model_parallel_size=m.tensor_model_parallel_size,
        pipeline_model_parallel_size=m.pipeline_model_parallel_size,
        context_parallel_size=dims.cp,
        sequence_parallel=m.sequence_parallel,
        overrides=with_wgrad_fusion(
            m.given_transformer_overrides(),
            device=device,
            megatron_ddp=not debug and not m.use_megatron_fsdp,
        ),
    )
    # CPU initialisation with one seed: identical weights whatever the DP / CP layout. Not across TP sizes on
    # megatron-core 0.14, which initialises TP-sharded weights differently from TP 1 (0.19 does not):
    # compare TP layouts from loaded weights.
    torch.manual_seed(m.seed)
    cp_groups = None
    cp_workload: WorkloadModel | None = None
    provider: Any
    if cp_layout is None:
        provider = GPTModelProvider(hf_config=hf_config, transformer_config=tf_config, device=device)
    else:
        from verl_dyncp.model import THDGPTModelProvider
        from verl_dyncp.planner import MEASURED_ATTENTION_COST_FACTOR, WorkloadModel

        provider = THDGPTModelProvider(
            hf_config=hf_config,
            transformer_config=tf_config,
            device=device,
            kernel=m.packed_attention_backend,
        )
        cp_groups = _pool_cp_groups()
        cp_workload = WorkloadModel.from_transformer_config(
            tf_config,
            vocab_size=hf_get(hf_config, "vocab_size"),
            attention_cost_factor=MEASURED_ATTENTION_COST_FACTOR,
        )
    # One wrapping path for every backend: verl-mcore-utils' make_megatron_module (Float16Module, DDP config
    # from build_ddp_config, broadcast) or verl-mfsdp's Megatron-FSDP, with verl-config's converter of the
    # megatron section; the CPU debug backend takes the unwrapped chunk.
    wrap = WrapConfig(**{**m.wrap_config_kwargs(), "wrap_with_ddp": not debug})
    if m.use_megatron_fsdp and not debug:
        from verl_mfsdp.wrap import make_megatron_fsdp_module, make_megatron_fsdp_optimizer

        chunks = make_megatron_fsdp_module(
            provider, wrap_config=wrap, override_ddp_config=m.override_ddp_config
        )
    else:
        chunks = make_megatron_module(provider, wrap_config=wrap, override_ddp_config=m.override_ddp_config)
    model = chunks[0]
    make_engine = partial(
        Engine,
        model=model,
        dims=dims,
        device=device,
        cp_layout=cp_layout,
        cp_groups=cp_groups,
        cp_workload=cp_workload,
        fused_lm_head=cfg.model.use_fused_kernels,
    )
    if debug:
        optimizer = debug_adamw(model, lr=o.lr, weight_decay=o.weight_decay, betas=o.betas, eps=o.eps)
        runner = DebugBackend(
            clip_grad=o.clip_grad, pool_group=parallel_state.get_data_parallel_group(), pool_size=dims.dp
        )
        return make_engine(optimizer=optimizer, runner=runner)

    from megatron.core.optimizer import OptimizerConfig

    kwargs = o.optimizer_config_kwargs(
        dtype=m.dtype, use_distributed_optimizer=model.ddp_config.use_distributed_optimizer
    )
    kwargs["params_dtype"] = tf_config.params_dtype  # verl-config is torch-free: it names the dtype
    opt_config = OptimizerConfig(**kwargs)
    if m.use_megatron_fsdp:
        optimizer = make_megatron_fsdp_optimizer(opt_config, chunks)
    else:
        optimizer = make_megatron_optimizer(opt_config, chunks)
    attach_training_hooks(chunks, optimizer)
    return make_engine(optimizer=optimizer, runner=MegatronBackend())


def _pool_cp_groups() -> Any:
    """verl-dyncp CP groups over megatron-core's data-parallel groups (one rank list per TP/PP position)."""
    from verl_dyncp.groups import CPGroups

    mine = dist.get_process_group_ranks(parallel_state.get_data_parallel_group())
    lists: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(lists, sorted(mine))
    unique = sorted({tuple(r) for r in lists})
    return CPGroups(rank_lists=unique)
