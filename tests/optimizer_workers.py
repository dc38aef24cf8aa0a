"""Per-rank function of the optimizer-group tests: how many parameter elements each weight decay covers."""

from __future__ import annotations

from typing import Any

import torch


def weight_decay_groups(rank: int, world_size: int, device: str, overrides: list[str]) -> dict[str, Any]:
    """(weight decay, elements) of every optimizer group, and the elements megatron's rule exempts.

    Counted in elements, not tensors: megatron-core's mixed-precision and distributed optimizers hold fp32
    copies or flat shards of the parameters, whose identity and shape differ from the model's.
    """
    from verl_config import SFTConfig, load_config
    from verl_engine.apps.sft import build_sft_engine
    from verl_engine.optimizer import decays
    from verl_mcore_utils.parallel import init_parallel

    cfg = load_config(SFTConfig, overrides=["model.preset=tiny", "optim.weight_decay=0.1", *overrides])
    init_parallel(device=device)
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    engine = build_sft_engine(cfg, device=dev)
    groups = [
        (float(g["weight_decay"]), sum(p.numel() for p in g["params"])) for g in engine.optimizer.param_groups
    ]
    named = [
        (n.removeprefix("module.").removeprefix("module."), p) for n, p in engine.model.named_parameters()
    ]
    out = {
        "groups": groups,
        "decayed": sum(p.numel() for n, p in named if p.requires_grad and decays(n, p)),
        "exempt": sum(p.numel() for n, p in named if p.requires_grad and not decays(n, p)),
        "exempt_names": [n for n, p in named if p.requires_grad and not decays(n, p)],
        "optimizer": engine.describe()["optimizer"],
    }
    engine.close()
    return out
