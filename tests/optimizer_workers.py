"""Per-rank function of the optimizer-group tests: the weight decay each parameter gets, by name."""

from __future__ import annotations

from typing import Any

import torch


def weight_decay_by_name(rank: int, world_size: int, device: str, overrides: list[str]) -> dict[str, Any]:
    from verl_config import SFTConfig, load_config
    from verl_engine.apps.sft import build_sft_engine
    from verl_mcore_utils.parallel import init_parallel

    cfg = load_config(SFTConfig, overrides=["model.preset=tiny", "optim.weight_decay=0.1", *overrides])
    init_parallel(device=device)
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    engine = build_sft_engine(cfg, device=dev)
    decay_of = {}
    for group in engine.optimizer.param_groups:
        for p in group["params"]:
            decay_of[id(p)] = float(group["weight_decay"])
    out = {
        "decay": {
            name: (decay_of.get(id(p)), p.ndim)
            for name, p in engine.model.named_parameters()
            if p.requires_grad
        },
        "optimizer": engine.describe()["optimizer"],
    }
    engine.close()
    return out
