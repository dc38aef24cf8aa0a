"""verl_engine: a megatron-core training engine for LLM post-training.

Public API: :class:`Engine` / :func:`build_engine` (model + optimizer + train_step; packed batches with
static or dynamic context parallelism via :class:`CPLayout` / :func:`cp_layout_from_config`,
:class:`PackedBatch`, ``train_step_packed`` and ``compute_log_probs``), the SFT loop
:func:`train`, the arithmetic data set and tokenizer used by the default ``verl-engine train`` run,
and the loss-normalisation helpers.
"""

from verl_engine.data import ArithmeticDataset, Batch, CharTokenizer
from verl_engine.engine import Engine, StepMetrics, build_engine, lr_at_step
from verl_engine.loss import masked_loss_sum, megatron_loss_scale
from verl_engine.packed import CPLayout, PackedBatch, cp_layout_from_config, split_packed_micro_batches
from verl_engine.trainer import RunSummary, resolve_device, train

__version__ = "0.1.0.dev0"

__all__ = [
    "ArithmeticDataset",
    "Batch",
    "CPLayout",
    "CharTokenizer",
    "Engine",
    "PackedBatch",
    "RunSummary",
    "StepMetrics",
    "build_engine",
    "cp_layout_from_config",
    "lr_at_step",
    "masked_loss_sum",
    "megatron_loss_scale",
    "resolve_device",
    "split_packed_micro_batches",
    "train",
]
