"""The engine's loss functions per role: actor (``ppo_loss``), critic (``value_loss``), SFT (``sft_loss``).

verl's call shape: ``loss, metrics = loss_fn(model_output=..., data=..., dp_group=...)``; bind the role's
config with ``functools.partial(ppo_loss, config=actor_cfg)``. The loss is a device tensor and so is every
metric (:class:`~verl_engine.metrics.Metric`, with its reduction): nothing here reads a value on the host.
Metric names are verl 0.9.1's (``actor/pg_loss``, ``actor/entropy_loss``, ``critic/vf_loss`` ...).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch

from verl_engine.losses.agg import agg_loss
from verl_engine.losses.common import (
    check_shapes,
    config_value,
    global_batch_info,
    masked,
    masked_mean,
    optional_tensor,
    required_tensor,
    scalar,
)
from verl_engine.losses.kl import kl_penalty
from verl_engine.losses.policy import policy_loss
from verl_engine.metrics import Metric, Reduction

__all__ = ["ppo_loss", "sft_loss", "value_loss"]


def _share(value: torch.Tensor) -> Metric:
    """A micro-batch's share of a globally normalised loss: summed over micro-batches (verl's SUM)."""
    return Metric(value.detach(), Reduction.SUM)


def _loss_mode(config: Any) -> str:
    """``config.policy_loss.loss_mode`` (object or dict); verl's default ``vanilla`` when unset."""
    section = config_value(config, "policy_loss", loss="ppo_loss", default=None)
    if section is None:
        return "vanilla"
    return str(config_value(section, "loss_mode", loss="ppo_loss", default="vanilla"))


def ppo_loss(
    *, config: Any, model_output: Mapping[str, Any], data: Mapping[str, Any], dp_group: Any = None
) -> tuple[torch.Tensor, dict[str, Metric]]:
    """Actor loss: policy loss - entropy_coeff * entropy + kl_loss_coef * KL(pi || pi_ref).

    ``config`` is verl's actor config (``loss_agg_mode``, ``entropy_coeff``, ``use_kl_loss``,
    ``kl_loss_coef``, ``kl_loss_type``, ``policy_loss.loss_mode`` and the mode's own keys). Metrics:
    ``actor/pg_loss``, the mode's clip fractions and ``actor/ppo_kl``, ``actor/entropy_loss`` when the model
    returned the entropy, ``actor/kl_loss`` and ``actor/kl_coef`` when ``use_kl_loss``.
    """
    del dp_group  # the global counts in `data` make the normalisation local
    name = "ppo_loss"
    mask = required_tensor(data, "response_mask", loss=name, where="data")
    log_prob = required_tensor(model_output, "log_probs", loss=name, where="model_output")
    entropy = optional_tensor(model_output, "entropy")
    loss_agg_mode = config_value(config, "loss_agg_mode", loss=name)
    entropy_coeff = float(config_value(config, "entropy_coeff", loss=name))
    if entropy_coeff != 0 and entropy is None:
        raise ValueError(
            f"{name} needs model_output['entropy'] because config.entropy_coeff={entropy_coeff} != 0; "
            "compute the entropy in the forward pass or set entropy_coeff=0"
        )
    use_kl = bool(config_value(config, "use_kl_loss", loss=name))
    named = {
        "model_output['log_probs']": log_prob,
        "data['old_log_probs']": required_tensor(data, "old_log_probs", loss=name, where="data"),
        "data['advantages']": required_tensor(data, "advantages", loss=name, where="data"),
        "model_output['entropy']": entropy,
        "data['ref_log_prob']": required_tensor(data, "ref_log_prob", loss=name, where="data")
        if use_kl
        else None,
        "data['rollout_is_weights']": optional_tensor(data, "rollout_is_weights"),
    }
    check_shapes(loss=name, mask=mask, tensors=named)
    agg_kwargs = global_batch_info(data, loss=name, config=config)
    mask = mask.bool()
    t = {k: None if v is None else masked(v, mask) for k, v in named.items()}
    loss, metrics = policy_loss(
        loss_mode=_loss_mode(config),
        log_prob=cast(torch.Tensor, t["model_output['log_probs']"]),
        old_log_prob=cast(torch.Tensor, t["data['old_log_probs']"]),
        advantages=cast(torch.Tensor, t["data['advantages']"]),
        response_mask=mask,
        loss_agg_mode=loss_agg_mode,
        config=config,
        agg_kwargs=agg_kwargs,
        rollout_is_weights=t["data['rollout_is_weights']"],
    )
    metrics["actor/pg_loss"] = _share(loss)
    if entropy is not None:
        entropy_loss = agg_loss(
            loss_mat=cast(torch.Tensor, t["model_output['entropy']"]),
            loss_mask=mask,
            loss_agg_mode=loss_agg_mode,
            **agg_kwargs,
        )
        metrics["actor/entropy_loss"] = _share(entropy_loss)
        if entropy_coeff != 0:
            loss = loss - entropy_coeff * entropy_loss
    if use_kl:
        kl_coef = float(config_value(config, "kl_loss_coef", loss=name))
        kld = kl_penalty(
            log_prob=cast(torch.Tensor, t["model_output['log_probs']"]),
            ref_log_prob=cast(torch.Tensor, t["data['ref_log_prob']"]),
            kl_penalty=config_value(config, "kl_loss_type", loss=name),
        )
        kl_loss = agg_loss(loss_mat=kld, loss_mask=mask, loss_agg_mode=loss_agg_mode, **agg_kwargs)
        loss = loss + kl_coef * kl_loss
        metrics["actor/kl_loss"] = _share(kl_loss)
        metrics["actor/kl_coef"] = Metric(kl_coef)
    return loss, metrics


def value_loss(
    *, config: Any, model_output: Mapping[str, Any], data: Mapping[str, Any], dp_group: Any = None
) -> tuple[torch.Tensor, dict[str, Metric]]:
    """Critic loss: 0.5 * agg(max((vpred - R)^2, (vclip - R)^2)), vclip = vpred kept within v_old +- c.

    Why the clip: like PPO's ratio clip, it keeps one update from moving the value far from the value
    the advantages were computed with. ``config`` needs ``cliprange_value`` and ``loss_agg_mode`` (verl's
    critic config). Metrics: ``critic/vf_loss`` (SUM), ``critic/vf_clipfrac``, ``critic/vpred_mean``.
    """
    del dp_group  # the global counts in `data` make the normalisation local
    name = "value_loss"
    mask = required_tensor(data, "response_mask", loss=name, where="data")
    vpred = required_tensor(model_output, "values", loss=name, where="model_output")
    old_values = required_tensor(data, "values", loss=name, where="data")
    returns = required_tensor(data, "returns", loss=name, where="data")
    cliprange = float(config_value(config, "cliprange_value", loss=name))
    loss_agg_mode = config_value(config, "loss_agg_mode", loss=name)
    named = {"model_output['values']": vpred, "data['values']": old_values, "data['returns']": returns}
    check_shapes(loss=name, mask=mask, tensors=named)
    agg_kwargs = global_batch_info(data, loss=name, config=config)
    mask = mask.bool()
    vpred, old_values, returns = (masked(t, mask) for t in (vpred, old_values, returns))

    vclip = torch.maximum(torch.minimum(vpred, old_values + cliprange), old_values - cliprange)
    unclipped = (vpred - returns).square()
    clipped = (vclip - returns).square()
    loss = 0.5 * agg_loss(
        loss_mat=torch.maximum(unclipped, clipped), loss_mask=mask, loss_agg_mode=loss_agg_mode, **agg_kwargs
    )
    metrics = {
        "critic/vf_loss": _share(loss),
        "critic/vf_clipfrac": Metric(masked_mean((clipped > unclipped).double(), mask)),
        "critic/vpred_mean": Metric(masked_mean(vpred, mask)),
    }
    return loss, metrics


def sft_loss(
    *, config: Any = None, model_output: Mapping[str, Any], data: Mapping[str, Any], dp_group: Any = None
) -> tuple[torch.Tensor, dict[str, Metric]]:
    """Supervised fine-tuning: mean negative log-likelihood of the response tokens over the global batch.

    Needs ``data['dp_size']`` and ``data['batch_num_tokens']`` (token-mean); ``config`` is unused. No
    metrics (verl's sft_loss has none): the engine's ``loss`` is the step's mean NLL.
    """
    del config, dp_group
    name = "sft_loss"
    mask = required_tensor(data, "response_mask", loss=name, where="data")
    log_prob = required_tensor(model_output, "log_probs", loss=name, where="model_output")
    check_shapes(loss=name, mask=mask, tensors={"model_output['log_probs']": log_prob})
    mask = mask.bool()
    nll = agg_loss(
        loss_mat=masked(log_prob, mask),
        loss_mask=mask,
        loss_agg_mode="token-mean",
        dp_size=int(scalar(data, "dp_size", loss=name, required=True)),
        batch_num_tokens=scalar(data, "batch_num_tokens", loss=name, required=True),
    )
    return -nll, {}
