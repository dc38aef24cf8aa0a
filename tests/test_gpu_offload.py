"""GPU: offload / onload of a megatron DDP model and its megatron optimizer (bf16), exact round trips.

Run on a GPU host with ``python -m pytest -m gpu tests/test_gpu_offload.py -v``; skipped without CUDA.
Each case builds two identical training states in one process (Float16Module + megatron-core DDP +
get_megatron_optimizer, as verl_engine's megatron backend does), trains both one step, offloads and
onloads one of them three times, then trains both one more step: the offloaded one must match the
other bit for bit. Deterministic kernels are requested so the two states can be compared exactly; the
test first checks that they really are identical before any offload (a control).
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import pytest
import torch

from verl_mcore_utils.testing import run_distributed

PRESET = "base"  # hidden 1024, 12 layers: ~135M parameters, ~2.2 GB of bf16 training state
VOCAB = 1024
SEQ, MICRO, NUM_MICRO = 64, 2, 2


def _build(*, dist_opt: bool) -> tuple[Any, Any]:
    """Float16Module + DDP + megatron optimizer, exactly as verl_engine's megatron backend builds them."""
    from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    from verl_mcore_utils.ddp import WrapConfig, build_ddp_config
    from verl_mcore_utils.model import build_gpt_model
    from verl_mcore_utils.presets import qwen2_preset
    from verl_mcore_utils.transformer_config import hf_to_transformer_config

    hf = qwen2_preset(PRESET, vocab_size=VOCAB)
    tf_config = hf_to_transformer_config(hf, dtype="bfloat16")
    torch.manual_seed(0)  # CPU initialisation: both states start from the same weights
    model = build_gpt_model(
        hf_config=hf, tf_config=tf_config, device=torch.device("cuda", torch.cuda.current_device())
    )
    ddp_config = build_ddp_config(wrap_config=WrapConfig(use_distributed_optimizer=dist_opt))
    ddp_model = DistributedDataParallel(
        config=tf_config, ddp_config=ddp_config, module=Float16Module(tf_config, model)
    )
    ddp_model.broadcast_params()
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=1e-3,
            weight_decay=0.01,
            clip_grad=1.0,
            bf16=True,
            params_dtype=torch.bfloat16,
            use_distributed_optimizer=dist_opt,
        ),
        [ddp_model],
    )
    tf_config.finalize_model_grads_func = finalize_model_grads
    tf_config.grad_scale_func = optimizer.scale_loss
    return ddp_model, optimizer


def _train_step(model: Any, optimizer: Any, *, step: int) -> tuple[float, float | None]:
    """One forward/backward over NUM_MICRO micro-batches through megatron's schedule, then step."""
    from megatron.core.parallel_state import get_data_parallel_rank

    from megatron_steps import schedule_step

    gen = torch.Generator().manual_seed(1000 * step + get_data_parallel_rank())
    tokens = torch.randint(0, VOCAB, (MICRO * NUM_MICRO, SEQ + 1), generator=gen).cuda()
    result = schedule_step([[model]], optimizer, list(tokens.chunk(NUM_MICRO)), shift_labels=True)
    return sum(result.local_losses), result.grad_norm


def _optimizer_tensors(optimizer: Any) -> dict[str, torch.Tensor]:
    """Master fp32 copies and Adam state on the GPU, read independently of verl_mcore_utils.offload."""
    out: dict[str, torch.Tensor] = {}
    for i, leaf in enumerate(getattr(optimizer, "chained_optimizers", None) or [optimizer]):
        for attr in ("fp32_from_float16_groups", "shard_fp32_from_float16_groups"):
            for g, group in enumerate(getattr(leaf, attr, None) or []):
                out |= {f"{i}.{attr}.{g}.{j}": t for j, t in enumerate(group) if t is not None}
        inner = leaf.optimizer
        order = {id(p): n for n, p in enumerate(p for group in inner.param_groups for p in group["params"])}
        for p, state in inner.state.items():
            out |= {
                f"{i}.state.{order[id(p)]}.{k}": v
                for k, v in state.items()
                if isinstance(v, torch.Tensor) and v.is_cuda
            }
    return out


def _live(model: Any, optimizer: Any) -> dict[str, torch.Tensor]:
    out = {f"param.{n}": p for n, p in model.named_parameters()}
    out |= {f"main_grad.{n}": p.main_grad for n, p in model.named_parameters()}
    out |= {f"opt.{k}": v for k, v in _optimizer_tensors(optimizer).items()}
    return out


def _snapshot(model: Any, optimizer: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in _live(model, optimizer).items()}


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (unlike torch.equal, NaN == NaN and -0.0 != 0.0)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.detach().reshape(-1).view(torch.uint8), b.detach().reshape(-1).view(torch.uint8))


def _mismatches(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    if a.keys() != b.keys():
        return sorted(set(a) ^ set(b))
    return [k for k in a if not _bitwise_equal(a[k], b[k])]


def offload_round_trip(rank: int, world_size: int, dist_opt: bool) -> dict[str, Any]:
    """Per-rank body (module level: picklable for run_distributed)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    from verl_mcore_utils.offload import (
        get_offload_state,
        is_offloaded,
        offload_megatron_model,
        offload_megatron_optimizer,
        onload_megatron_model,
        onload_megatron_optimizer,
    )
    from verl_mcore_utils.parallel import init_parallel

    init_parallel(device="cuda")
    model, optimizer = _build(dist_opt=dist_opt)
    ref_model, ref_optimizer = _build(dist_opt=dist_opt)
    out: dict[str, Any] = {
        "optimizer": [
            type(o).__name__ for o in getattr(optimizer, "chained_optimizers", None) or [optimizer]
        ],
        "step1": _train_step(model, optimizer, step=1),
        "ref_step1": _train_step(ref_model, ref_optimizer, step=1),
        "cycles": [],
    }
    before = _snapshot(model, optimizer)
    out["control_mismatches"] = _mismatches(before, _snapshot(ref_model, ref_optimizer))
    for _ in range(3):
        torch.cuda.synchronize()
        allocated = torch.cuda.memory_allocated()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            m_stats = offload_megatron_model([model])
            o_stats = offload_megatron_optimizer(optimizer)
        freed = allocated - torch.cuda.memory_allocated()
        states = {"model": get_offload_state(model), "optimizer": get_offload_state(optimizer)}
        buffers = [b for kind in ("params", "grads") for b in states["model"].host_buffers(kind)]
        buffers += list(states["optimizer"].host_buffers("optimizer"))
        cycle = {
            "offloaded_bytes": m_stats.total_bytes + o_stats.total_bytes,
            "bytes_by_kind": m_stats.bytes_by_kind | o_stats.bytes_by_kind,
            "freed_bytes": freed,
            "not_released": [k for k, t in _live(model, optimizer).items() if t.untyped_storage().nbytes()],
            "flags": [
                is_offloaded(model, "params"),
                is_offloaded(model, "grads"),
                is_offloaded(optimizer, "optimizer"),
            ],
            "host_bytes": states["model"].host_bytes() + states["optimizer"].host_bytes(),
            "host_allocated": m_stats.host_bytes_allocated + o_stats.host_bytes_allocated,
            "host_ptrs": sorted(b.data_ptr() for b in buffers),
            "all_pinned": all(b.is_pinned() for b in buffers),
            "pinning_warnings": [str(w.message) for w in caught if "cudaHostRegister" in str(w.message)],
            "offload_gbps": (m_stats.total_bytes + o_stats.total_bytes)
            / (m_stats.seconds + o_stats.seconds)
            / 1e9,
        }
        on_m = onload_megatron_model([model])
        on_o = onload_megatron_optimizer(optimizer)
        cycle["onload_bytes"] = on_m.total_bytes + on_o.total_bytes
        cycle["mismatched_after_onload"] = _mismatches(before, _snapshot(model, optimizer))
        out["cycles"].append(cycle)
    out["step2"] = _train_step(model, optimizer, step=2)
    out["ref_step2"] = _train_step(ref_model, ref_optimizer, step=2)
    out["mismatched_after_step2"] = _mismatches(
        _snapshot(model, optimizer), _snapshot(ref_model, ref_optimizer)
    )
    return out


def _check(out: dict[str, Any], *, dist_opt: bool) -> None:
    assert ("DistributedOptimizer" in out["optimizer"]) is dist_opt, out["optimizer"]
    first = out["cycles"][0]
    assert first["offloaded_bytes"] > 1e9, first["bytes_by_kind"]  # the bytes matter
    for cycle in out["cycles"]:
        # Round trip: bit for bit, views intact (the snapshot reads param.data / param.main_grad views).
        assert cycle["mismatched_after_onload"] == [], cycle["mismatched_after_onload"][:10]
        assert cycle["not_released"] == [], cycle["not_released"][:10]
        assert cycle["flags"] == [True, True, True]
        # GPU memory really released (allocator blocks), not just dropped references.
        assert cycle["freed_bytes"] >= 0.95 * cycle["offloaded_bytes"], (
            cycle["freed_bytes"],
            cycle["offloaded_bytes"],
        )
        assert cycle["onload_bytes"] == cycle["offloaded_bytes"]
        # One page-locked host copy, exactly the size of the device state, reused every cycle.
        assert cycle["all_pinned"] and cycle["pinning_warnings"] == [], cycle["pinning_warnings"]
        assert cycle["host_bytes"] == cycle["offloaded_bytes"]
        assert cycle["host_ptrs"] == first["host_ptrs"]
    assert first["host_allocated"] == first["offloaded_bytes"]
    assert all(c["host_allocated"] == 0 for c in out["cycles"][1:])
    # Training continues exactly as without offload (control first: the two states were identical).
    assert out["control_mismatches"] == [] and out["step1"] == out["ref_step1"], (
        "the reference state diverged before any offload: kernels are not deterministic here",
        out["control_mismatches"][:10],
    )
    assert out["step2"] == out["ref_step2"]
    assert out["mismatched_after_step2"] == [], out["mismatched_after_step2"][:10]


@pytest.mark.gpu
@pytest.mark.parametrize("dist_opt", [True, False], ids=["distopt", "no-distopt"])
def test_megatron_ddp_offload_round_trip_on_one_gpu(dist_opt: bool) -> None:
    (out,) = run_distributed(offload_round_trip, world_size=1, backend="nccl", args=(dist_opt,))
    _check(out, dist_opt=dist_opt)
    print(
        {
            "offload_gbps": [round(c["offload_gbps"], 2) for c in out["cycles"]],
            **out["cycles"][0]["bytes_by_kind"],
        }
    )


@pytest.mark.num_gpus(2)
def test_megatron_ddp_offload_round_trip_data_parallel() -> None:
    for out in run_distributed(offload_round_trip, world_size=2, backend="nccl", args=(True,)):
        _check(out, dist_opt=True)


@pytest.mark.gpu
def test_plain_cuda_module_and_torch_adamw() -> None:
    """Unwrapped module on CUDA: .grad moves; AdamW's step counters stay where they are if on the CPU."""
    from verl_mcore_utils.offload import (
        get_offload_state,
        offload_megatron_model,
        offload_megatron_optimizer,
        onload_megatron_model,
        onload_megatron_optimizer,
    )

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)
    ).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(8, 1024, device="cuda")).square().mean().backward()
    opt.step()

    def tensors() -> list[torch.Tensor]:
        return [
            t
            for p in model.parameters()
            for t in (p.detach(), p.grad, opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"])
        ]

    expected = [t.clone() for t in tensors()]
    steps = [st["step"] for st in opt.state.values()]
    cuda_step_bytes = sum(s.untyped_storage().nbytes() for s in steps if s.is_cuda)
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    stats = [offload_megatron_model(model), offload_megatron_optimizer(opt)]
    moved = sum(s.total_bytes for s in stats)
    assert moved == sum(e.numel() * 4 for e in expected) + cuda_step_bytes
    assert allocated - torch.cuda.memory_allocated() >= 0.95 * moved
    assert all(s.untyped_storage().nbytes() > 0 for s in steps if not s.is_cuda)  # CPU counters untouched
    assert get_offload_state(model).host_bytes() + get_offload_state(opt).host_bytes() == moved
    onload_megatron_model(model)
    onload_megatron_optimizer(opt)
    assert all(torch.equal(a, b) for a, b in zip(tensors(), expected, strict=True))
    opt.step()  # and the optimizer still works on the restored state
