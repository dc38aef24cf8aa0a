"""verl_engine: a megatron-core training engine for LLM post-training (RL and SFT).

Public API (the engine core; what drives it lives in :mod:`verl_engine.apps`):

* :class:`RLEngine`, verl's engine surface (``forward_backward_batch``, ``train_batch``, ``infer_batch``,
  ``train_mode`` / ``eval_mode``, ``optimizer_step``, ``lr_scheduler_step`` ...), built by
  :func:`rl_engine_from_config` from a loaded verl-config ``ppo_trainer`` config or :func:`build_rl_engine`
  from the sections; :class:`MicroBatching`, :class:`RLBatch`; :func:`loss_config`, the config a role's loss is
  bound with (verl's trainer's, e.g. ``bypass_mode`` from ``algorithm.rollout_correction``).
* Losses (:mod:`verl_engine.losses`: ``ppo_loss``, ``value_loss``, ``sft_loss`` ...) returning device tensors and
  :class:`Metric` values with their :class:`Reduction`; the learning-rate schedule :class:`LRSchedule`;
  vocab-parallel log-probs and entropy (:func:`vocab_parallel_log_probs_and_entropy`); packed batches and CP
  layouts (:class:`PackedBatch`, :class:`CPLayout`); CUDA graphs of the decoder for CP-1 training
  micro-batches (:func:`use_decoder_graphs`, :func:`decoder_graph_counts`).

Names load on first use (PEP 562): importing the package does not import megatron-core, so spawned test
ranks and torch-only users start fast.
"""

from importlib import metadata as _metadata

from verl_mcore_utils.compat import prepare_megatron_import
from verl_mcore_utils.lazy import lazy_attributes

# Before any module of this package imports megatron-core (Python runs this file first): check the release
# and prepare a GPU-less machine.
prepare_megatron_import()

__version__ = _metadata.version("verl-engine")  # single source: pyproject.toml

_LAZY: dict[str, str] = {
    "CPLayout": "verl_engine.packed",
    "LRSchedule": "verl_engine.lr_schedule",
    "Metric": "verl_engine.metrics",
    "MicroBatching": "verl_engine.micro_batching",
    "PackedBatch": "verl_engine.packed",
    "RLBatch": "verl_engine.rl_batch",
    "RLEngine": "verl_engine.engine",
    "RULES": "verl_engine.config_support",
    "Reduction": "verl_engine.metrics",
    "build_rl_engine": "verl_engine.build",
    "check_supported": "verl_engine.refusals",
    "cp_layout_from_config": "verl_engine.packed",
    "decoder_graph_counts": "verl_engine.decoder_graphs",
    "loss_config": "verl_engine.loss_binding",
    "lr_schedule_from_config": "verl_engine.lr_schedule",
    "rl_engine_from_config": "verl_engine.build",
    "split_packed_micro_batches": "verl_engine.packed",
    "use_decoder_graphs": "verl_engine.decoder_graphs",
    "vocab_parallel_log_probs_and_entropy": "verl_engine.logprobs",
}


__getattr__, __dir__ = lazy_attributes(module=__name__, lazy=_LAZY)

__all__ = sorted(_LAZY)
