"""Mixture-of-experts layers in the engine's loop: the load-balancing loss of a micro-batch, whatever the layout.

megatron-core's router adds the load-balancing (aux) loss of the tokens it routes through
``MoEAuxLossAutoScaler``: the forward is the identity, the backward injects ``aux_loss * scale``. Two things
make that loss depend on the parallel layout unless the engine sets them:

* **Which tokens the statistics cover.** The router counts tokens per expert over its ``tp_cp_group`` and
  divides by ``local tokens x group size``. The engine builds megatron-core's model with CP 1 (verl-dyncp runs
  context parallelism over the whole DP x CP pool, static or dynamic), so that group is TP only and every
  rank would balance its own shard: at CP 2 each rank sees half of each sequence, the statistics differ from
  CP 1, and so does the gradient (verl #6609's class of bug: grad norm 0.872 at CP 1 vs 1.139 at CP 2 in
  this repository's repro). Every rank of the pool works on the same micro-batch (its sequences, or pieces of
  them), so :func:`route_over_pool` points the routers at TP x pool: the statistics are the micro-batch's,
  identical at DP, CP and dynamic CP. Padding (THD alignment under CP, right-padding of padded rows, idle
  groups' dummy sequences) is excluded with megatron-core's ``padding_mask`` (0.16+), which also makes the
  token count exact when ranks hold different numbers of tokens.
* **The scale.** megatron-core's schedule sets ``loss_scale * cp / num_microbatches``; its DDP then averages
  gradients over the pool. Each rank's aux loss is its tokens' part of the micro-batch's (the parts sum to
  it), so the scale that gives ``mean over the call's micro-batches of d aux`` after the pool average is
  ``pool / num_microbatches``: :func:`aux_loss_scale` sets it for the CPU backend and multiplies the
  schedule's value by ``pool`` for the megatron backend.

The z-loss is a per-rank mean in megatron-core (exact only with equal token shares), so it is refused when the
pool has more than one rank (:func:`moe_refusals`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from megatron.core.transformer.moe.router import TopKRouter

__all__ = [
    "MoeRouting",
    "aux_loss_scale",
    "moe_refusals",
    "moe_routers",
    "moe_routing",
    "padding_mask_supported",
    "route_over_pool",
]


@dataclass(frozen=True)
class MoeRouting:
    """How the engine feeds a model's routers.

    ``padding_mask``: pass megatron-core's ``padding_mask`` (True at padding) with every forward, so that
    padding is neither balanced nor counted. The aux-loss scale's pool size is the engine's own ``pool_size``.
    """

    padding_mask: bool


def moe_routers(chunks: Sequence[torch.nn.Module]) -> list[TopKRouter]:
    """The TopKRouter modules of the model chunks (empty for a dense model)."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for chunk in chunks for m in chunk.modules() if isinstance(m, TopKRouter)]


def padding_mask_supported() -> bool:
    """Whether this megatron-core's GPTModel takes ``padding_mask`` (0.16+)."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    return "padding_mask" in inspect.signature(GPTModel.forward).parameters


def route_over_pool(chunks: Sequence[torch.nn.Module], *, group: Any, mtp_layers: int = 0) -> int:
    """Point every router's token statistics (aux loss, z-loss averaging) at ``group`` (TP x the DP x CP
    pool: every rank holding a piece of the micro-batch). Returns the number of routers changed.

    ``mtp_layers``: the model's MTP layers (verl_mcore_utils.mtp, built beside GPTModel, whose own config has
    no ``mtp_num_layers``). megatron-core logs each router's aux loss into a process-wide per-layer tensor
    sized by the first router that records, ``num_layers (+ mtp_num_layers)`` of its config; the decoder's
    routers come first and would size it without the MTP slots, and the MTP routers' record then fails with
    an IndexError. The decoder's routers get a copy of their config that counts the MTP layers, as a
    megatron-core MTP model's routers do (the router reads ``mtp_num_layers`` for that log size only).
    """
    routers = moe_routers(chunks)
    counted: dict[int, Any] = {}
    for router in routers:
        router.tp_cp_group = group
        config = router.config
        if mtp_layers and config.mtp_num_layers is None:
            if id(config) not in counted:
                counted[id(config)] = dataclasses.replace(config, mtp_num_layers=mtp_layers)
            router.config = counted[id(config)]
    return len(routers)


def moe_refusals(tf_config: Any, *, pool_size: int, trains: bool, padded_rows: bool) -> list[str]:
    """Why this MoE model cannot train exactly here (empty: it can). ``padded_rows``: use_remove_padding=false.

    Padding exists when the pool has several ranks (THD alignment under CP, idle groups), with TP (alignment)
    or padded rows; one rank with packed sequences has none, so any megatron-core trains it exactly.
    """
    if not trains:
        return []
    problems = []
    aux = float(getattr(tf_config, "moe_aux_loss_coeff", 0.0) or 0.0)
    padding = pool_size > 1 or padded_rows or tf_config.tensor_model_parallel_size > 1
    if aux > 0 and padding and not padding_mask_supported():
        from megatron.core import __version__

        problems.append(
            f"the load-balancing loss (router_aux_loss_coef={aux}) needs megatron-core >= 0.16 (GPTModel's"
            f" padding_mask) so that padding is not counted as routed tokens; this is {__version__}: upgrade"
            " megatron-core or set model.override_config.model_config.router_aux_loss_coef=0"
        )
    if (
        getattr(tf_config, "moe_router_enable_expert_bias", False)
        and padding
        and not padding_mask_supported()
    ):
        from megatron.core import __version__

        problems.append(
            "the routers' expert bias (moe_router_enable_expert_bias, DeepSeek-V3 / GLM-4.5) needs megatron-core"
            f" >= 0.16 (GPTModel's padding_mask) so that padding is not counted as routed tokens; this is"
            f" {__version__}: upgrade megatron-core or train on one rank with packed sequences"
        )
    balancing = getattr(tf_config, "moe_router_load_balancing_type", "aux_loss")
    if aux > 0 and balancing not in ("aux_loss", "none"):
        why = (
            "megatron-core balances each row of its [sequence, batch] input, and a packed micro-batch is one row"
            " holding many sequences, so the loss would balance the micro-batch as packed (changing with packing"
            " and CP) instead of each sequence"
            if balancing == "seq_aux_loss"
            else "only the per-micro-batch load-balancing loss (aux_loss) is checked equal across layouts here"
        )
        problems.append(
            f"moe_router_load_balancing_type={balancing}: {why}; set"
            " override_transformer_config.moe_router_load_balancing_type=aux_loss"
        )
    z = getattr(tf_config, "moe_z_loss_coeff", None)
    if z and pool_size > 1:
        problems.append(
            f"moe_z_loss_coeff={z} with {pool_size} ranks in the DP x CP pool: megatron-core averages the z-loss"
            " per rank, which differs from the micro-batch's mean when ranks hold different token counts"
            " (dynamic CP, DP); unset moe_z_loss_coeff or train on one rank"
        )
    return problems


def moe_routing(
    tf_config: Any, *, pool_size: int, trains: bool, padded_rows: bool, model_name: str
) -> MoeRouting | None:
    """How the engine feeds the routers of the model ``tf_config`` describes (None: a dense model). Raises
    NotImplementedError naming every setting it cannot train exactly, before any model is built."""
    experts = getattr(tf_config, "num_moe_experts", None)
    if not experts:
        return None
    problems = moe_refusals(tf_config, pool_size=pool_size, trains=trains, padded_rows=padded_rows)
    if problems:
        raise NotImplementedError(f"model {model_name}, {experts} experts: " + "; ".join(problems))
    return MoeRouting(padding_mask=padding_mask_supported())


def drop_moe_metrics_tracker() -> None:
    """Drop megatron-core's process-wide MoE metrics tracker (its per-layer aux-loss sums, for its own logging).

    Why: the tracker sizes each metric by the first model that records it and never resizes it, so a second
    MoE model with more layers in the same process (a critic, the next experiment, a test after a test) fails
    inside the router with an IndexError; and a closed engine's tracker keeps a tensor on its device. The
    engines do not read it: it is dropped at close and before every call of an MoE engine, and megatron-core
    creates it again on the next record (lazily on >= 0.16; older releases add the entry on first use).
    """
    try:
        from megatron.core.transformer.moe import moe_logging
    except ImportError:  # megatron-core < 0.16: a module-level dict in moe_utils
        from megatron.core.transformer.moe import moe_utils

        tracker = getattr(moe_utils, "_MOE_LAYER_WISE_LOGGING_TRACKER", None)
        if isinstance(tracker, dict):
            tracker.clear()
        return
    moe_logging.destroy_moe_metrics_tracker()


@contextlib.contextmanager
def aux_loss_scale(*, pool_size: int, num_micro_batches: int, schedule_sets_it: bool) -> Iterator[None]:
    """The aux-loss backward scale for one call of ``num_micro_batches`` micro-batches (see the module doc).

    ``schedule_sets_it``: megatron-core's schedule calls ``MoEAuxLossAutoScaler.set_loss_scale`` before
    each backward (megatron backend); its value is multiplied by ``pool_size`` for the duration. Otherwise
    (CPU backend, own loop) the scale is set once to ``pool_size / num_micro_batches``. The previous state
    is restored on exit.
    """
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    previous = MoEAuxLossAutoScaler.main_loss_backward_scale
    previous_scale = None if previous is None else previous.clone()  # set_loss_scale copies in place
    previous_setter = MoEAuxLossAutoScaler.__dict__["set_loss_scale"]
    try:
        if schedule_sets_it:
            original = previous_setter.__func__

            def scaled(scale: torch.Tensor) -> None:
                original(scale * pool_size)

            MoEAuxLossAutoScaler.set_loss_scale = staticmethod(scaled)  # type: ignore[method-assign]
        else:
            MoEAuxLossAutoScaler.main_loss_backward_scale = torch.tensor(
                pool_size / max(num_micro_batches, 1)
            )
        yield
    finally:
        MoEAuxLossAutoScaler.set_loss_scale = previous_setter  # type: ignore[method-assign]
        MoEAuxLossAutoScaler.main_loss_backward_scale = previous_scale
