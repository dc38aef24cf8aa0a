"""verl 0.9.1's ``BaseEngine`` over :class:`~verl_engine.engine.RLEngine`: what verl's ``TrainingWorker`` calls.

verl builds the engine with its four per-role config objects and asks for data-parallel information before
``initialize()``; the model is built in ``initialize()`` through :func:`verl_engine.build.build_rl_engine` (the
translation of the configs, with refusals, runs in the constructor so a bad setting fails before any model).
Every method keeps verl's signature and meaning (``verl/workers/engine/base.py``); docs/verl.md has the table.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from typing import Any, cast

import torch
import torch.distributed as dist
from verl.workers.engine.base import BaseEngine, BaseEngineCtx

from verl_engine.integrations.verl.configs import build_args
from verl_engine.integrations.verl.convention import VerlConventionEngine
from verl_engine.integrations.verl.weights import VerlWeightSync
from verl_engine.micro_batching import MicroBatching
from verl_engine.rl_batch import read_scalar

__all__ = ["VerlEngine", "VerlValueEngine"]

_MODE_KWARGS = ("disable_auto_offload", "zero_grad_on_exit")


class VerlEngine(VerlWeightSync, BaseEngine):
    """verl's engine for ``model_type="language_model"`` (actor and reference), backend ``megatron``."""

    value_model = False
    # the delta snapshots are one host copy of the HF weights; pinning them all competes with every other pinned
    # pool on the node (verl's own Megatron engine makes the same choice)
    delta_pin_snapshots = False

    def __init__(
        self, *, model_config: Any, engine_config: Any, optimizer_config: Any, checkpoint_config: Any
    ) -> None:
        self.model_config = model_config
        self.engine_config = engine_config
        self.optimizer_config = optimizer_config
        self.checkpoint_config = checkpoint_config
        self.args = build_args(
            model_config=model_config,
            engine_config=engine_config,
            optimizer_config=optimizer_config,
            value_model=self.value_model,
        )
        self.engine: VerlConventionEngine | None = None
        self.mode: str | None = None
        self._dp_group = _single_rank_group()
        self._saved_paths: list[str] = []
        self._offloaded = {"model": False, "grad": False, "optimizer": False}

    # ------------------------------------------------------------------------------ lifecycle
    def initialize(self) -> None:
        """Build model, optimizer and schedule; offload them when the engine config says so (as verl's engine).

        A second call (verl's ``TrainingWorker.reset``) builds a fresh engine in place of the first.
        """
        from verl.utils.device import get_device_id, get_device_name

        from verl_engine.build import build_rl_engine

        if self.engine is not None:
            self.engine.close()
        name = get_device_name()
        device = torch.device("cpu") if name == "cpu" else torch.device(name, get_device_id())
        args = self.args
        engine = cast(  # engine_class=VerlConventionEngine builds one
            VerlConventionEngine,
            build_rl_engine(
                engine=args.engine,
                model_path=args.model_path,
                optim=args.optim,
                micro_batching=_micro_batching(self.engine_config, infer=args.optim is None),
                device=device,
                value_model=args.value_model,
                override_model_config=args.override_model_config,
                total_training_steps=args.total_training_steps,
                fused_lm_head=args.fused_lm_head,
                lora=args.lora,
                engine_class=VerlConventionEngine,
            ),
        )
        engine.verl_dp_group = self._dp_group
        self.engine = engine
        self._offloaded = {"model": False, "grad": False, "optimizer": False}
        if self.is_param_offload_enabled or self.is_optimizer_offload_enabled:
            self.to(
                "cpu",
                model=self.is_param_offload_enabled,
                optimizer=self.is_optimizer_offload_enabled,
                grad=self.is_param_offload_enabled,
            )

    @property
    def _built(self) -> VerlConventionEngine:
        if self.engine is None:
            raise RuntimeError(
                "the engine is not built yet: call initialize() first (verl's TrainingWorker.reset)"
            )
        return self.engine

    @property
    def is_param_offload_enabled(self) -> bool:
        return bool(self.engine_config.param_offload)

    @property
    def is_optimizer_offload_enabled(self) -> bool:
        return bool(self.engine_config.optimizer_offload)

    # ------------------------------------------------------------------------------ modes
    def train_mode(self, **kwargs: Any) -> BaseEngineCtx:
        """verl's train context: onload on enter / offload on exit per the offload flags, gradients zeroed on exit
        unless ``zero_grad_on_exit=False``; ``disable_auto_offload=True`` skips the moves."""
        return _ModeCtx(self, "train", **_mode_kwargs(kwargs))

    def eval_mode(self, **kwargs: Any) -> BaseEngineCtx:
        """verl's eval context: parameters onloaded per ``param_offload``, the model in eval mode (no dropout)."""
        return _ModeCtx(self, "eval", **_mode_kwargs(kwargs))

    def to(self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True) -> None:
        """Move parameters (``model``), gradient buffers (``grad``) and optimizer state to ``device``.

        ``"cpu"`` offloads, the accelerator's name onloads (verl-mcore-utils' offload: bit-for-bit, host memory 1x).
        On a CPU-only engine (the test backend) host and device are the same name, so ``to("cpu")`` brings back
        what is offloaded and offloads otherwise: the pairs verl issues (offload, then onload) stay pairs.
        """
        super().to(device, model=model, optimizer=optimizer, grad=grad)
        engine = self._built
        chosen = {"model": model, "grad": grad, "optimizer": optimizer and engine.optimizer is not None}
        selected = [k for k, v in chosen.items() if v]
        if not selected:
            return
        to_host = torch.device(device).type == "cpu"
        if to_host and engine.device.type == "cpu":
            to_host = not any(self._offloaded[k] for k in selected)
        moving = [k for k in selected if self._offloaded[k] != to_host]
        if not moving:
            return
        move = engine.offload if to_host else engine.onload
        move(params="model" in moving, grads="grad" in moving, optimizer="optimizer" in moving)
        for key in moving:
            self._offloaded[key] = to_host

    # ------------------------------------------------------------------------------ ranks
    def get_data_parallel_size(self) -> int:
        """1: verl's dispatcher gives every rank the whole batch; the engine spreads it over DP x CP itself (as
        verl's own engine under dynamic context parallelism)."""
        return 1

    def get_data_parallel_rank(self) -> int:
        return 0

    def get_data_parallel_group(self) -> Any:
        """This rank alone: with None (the world) verl's worker would average the loss and gather metrics over
        ranks that all hold the same numbers, and multiply MFU by the world size."""
        return self._dp_group

    def is_mp_src_rank_with_outputs(self) -> bool:
        """Global rank 0 returns outputs (every rank holds the same ones)."""
        return not dist.is_initialized() or dist.get_rank() == 0

    # ------------------------------------------------------------------------------ steps
    def optimizer_zero_grad(self) -> None:
        self._built.optimizer_zero_grad()

    def optimizer_step(self) -> float:
        return self._built.optimizer_step()

    def lr_scheduler_step(self) -> float:
        return self._built.lr_scheduler_step()

    def forward_backward_batch(
        self, data: Any, loss_function: Any, forward_only: bool = False
    ) -> dict[str, Any]:
        """verl's contract (see :mod:`.convention`): per-call ``use_dynamic_bsz`` / ``max_token_len_per_gpu`` /
        ``micro_batch_size_per_gpu`` from ``data`` (the worker sets them per call), else the engine config's."""
        engine = self._built
        engine.micro_batching = _micro_batching(self.engine_config, infer=forward_only, data=data)
        return engine.forward_backward_batch(data, loss_function, forward_only=forward_only)

    def disable_adapter(self) -> contextlib.AbstractContextManager[None]:
        """The actor without its LoRA adapter (verl's ``no_lora_adapter`` batch key: the reference log-probs of
        a LoRA actor); without LoRA the model is the base model and this does nothing."""
        return self._built.disable_adapter()

    # ------------------------------------------------------------------------------ checkpoints
    def save_checkpoint(
        self,
        local_path: str,
        hdfs_path: str | None = None,
        global_step: int = 0,
        max_ckpt_to_keep: int | None = None,
        **kwargs: Any,
    ) -> None:
        """Checkpoint into ``local_path`` (verl's ``.../global_step_<N>/<role>``; ours lands in its
        ``global_step_<N>`` with the latest marker in ``local_path``). ``max_ckpt_to_keep``: the oldest
        ``local_path`` s this engine saved beyond the newest ``max_ckpt_to_keep`` are removed (verl's meaning)."""
        _refuse_hdfs(hdfs_path, "save_checkpoint")
        _refuse_kwargs(kwargs, "save_checkpoint")
        self._built.save_checkpoint(local_path, global_step=int(global_step))
        path = os.path.abspath(local_path)
        if path in self._saved_paths:
            self._saved_paths.remove(path)
        self._saved_paths.append(path)
        if max_ckpt_to_keep is not None and max_ckpt_to_keep > 0:
            stale, self._saved_paths = (
                self._saved_paths[:-max_ckpt_to_keep],
                self._saved_paths[-max_ckpt_to_keep:],
            )
            _remove_on_rank_zero(stale)

    def load_checkpoint(
        self, local_path: str, hdfs_path: str | None = None, del_local_after_load: bool = True, **kwargs: Any
    ) -> None:
        """Restore what :meth:`save_checkpoint` wrote into ``local_path``; ``del_local_after_load`` removes it
        afterwards (every rank has read it first)."""
        _refuse_hdfs(hdfs_path, "load_checkpoint")
        _refuse_kwargs(kwargs, "load_checkpoint")
        self._built.load_checkpoint(local_path)
        if del_local_after_load:
            _remove_on_rank_zero([os.path.abspath(local_path)])


class VerlValueEngine(VerlEngine):
    """verl's engine for ``model_type="value_model"`` (the critic): a value head instead of the LM head."""

    value_model = True


class _ModeCtx(BaseEngineCtx):
    """verl's ``BaseEngineCtx`` (auto offload, ``engine.mode``) plus the model's train / eval switch and the
    zero-grad on leaving training, as verl's Megatron engine's contexts."""

    def __enter__(self) -> VerlEngine:
        super().__enter__()
        model = self.engine._built.model
        self._was_training = model.training
        model.train(self.mode == "train")
        self.engine._built.mode = self.mode
        return self.engine

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        engine = self.engine._built
        if self.mode == "train" and self.zero_grad_on_exit:
            engine.optimizer_zero_grad()
        engine.model.train(self._was_training)
        engine.mode = None
        super().__exit__(exc_type, exc_val, exc_tb)


def _mode_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(kwargs) - set(_MODE_KWARGS))
    if unknown:
        raise TypeError(
            f"unknown mode arguments {unknown}; verl 0.9.1's contexts take {', '.join(_MODE_KWARGS)}"
        )
    return kwargs


def _micro_batching(engine_config: Any, *, infer: bool, data: Any = None) -> MicroBatching:
    """The call's micro-batching: ``data``'s keys when present (verl's worker sets them per call: ``ppo_*`` for
    training, ``infer_*`` for inference), else the engine config's for that kind of call."""
    prefix = "infer_" if infer else ""
    defaults = {
        "use_dynamic_bsz": engine_config.use_dynamic_bsz,
        "max_token_len_per_gpu": getattr(engine_config, f"{prefix}max_token_len_per_gpu", None)
        or engine_config.max_token_len_per_gpu,
        "micro_batch_size_per_gpu": getattr(engine_config, f"{prefix}micro_batch_size_per_gpu", None)
        or engine_config.micro_batch_size_per_gpu,
    }
    values = {
        key: default if data is None else read_scalar(data, key, default) for key, default in defaults.items()
    }
    values = {key: defaults[key] if value is None else value for key, value in values.items()}
    return MicroBatching(
        use_dynamic_bsz=bool(values["use_dynamic_bsz"]),
        max_token_len_per_gpu=values["max_token_len_per_gpu"],
        micro_batch_size_per_gpu=values["micro_batch_size_per_gpu"],
    )


_GROUPS: dict[int, Any] = {}


def _single_rank_group() -> Any:
    """A process group of this rank alone (created once per process: every rank creates every size-1 group,
    a collective, in the same order, which verl's workers do by constructing engines in the same order)."""
    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialised; verl's TrainingWorker initialises it before building the engine"
        )
    world = dist.get_world_size()
    if world not in _GROUPS:
        _GROUPS[world], _ = dist.new_subgroups(group_size=1)
    return _GROUPS[world]


def _refuse_hdfs(hdfs_path: str | None, call: str) -> None:
    if hdfs_path:
        raise ValueError(
            f"{call}(hdfs_path={hdfs_path!r}): verl-engine's verl backend does not copy checkpoints to HDFS; leave"
            " trainer.default_hdfs_dir unset (null) and copy local checkpoints with your own tooling"
        )


def _refuse_kwargs(kwargs: dict[str, Any], call: str) -> None:
    if kwargs:
        raise TypeError(f"{call}: unsupported arguments {sorted(kwargs)} (verl 0.9.1 passes none)")


def _remove_on_rank_zero(paths: list[str]) -> None:
    """Every rank waits until all have finished with ``paths``, then rank 0 removes them."""
    if not paths:
        return
    if dist.is_initialized():
        dist.barrier()
    if not dist.is_initialized() or dist.get_rank() == 0:
        for path in paths:
            shutil.rmtree(path, ignore_errors=True)
    if dist.is_initialized():
        dist.barrier()


def iter_registered() -> Iterator[tuple[str, type[VerlEngine]]]:
    """(verl model_type, class) pairs this backend registers."""
    yield "language_model", VerlEngine
    yield "value_model", VerlValueEngine
