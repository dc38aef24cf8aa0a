"""Offload / onload of parameters, gradients and optimizer state (CPU; the GPU path: tests/test_gpu_offload.py).

megatron-core's DDP buffers and optimizers hard-code CUDA, so here the real megatron GPTModel runs
unwrapped with torch.optim.AdamW (the engine's debug backend), and megatron DDP's memory layout
(parameters and main_grads as views into one flat buffer each) is rebuilt by hand in
``_FlatBufferModel`` to check that views survive a round trip. On CPU "offload" moves into plain host
buffers through the same code path the GPU uses.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from verl_mcore_utils.offload import (
    OffloadStateError,
    get_offload_state,
    is_offloaded,
    offload_megatron_model,
    offload_megatron_optimizer,
    onload_megatron_model,
    onload_megatron_optimizer,
)
from verl_mcore_utils.presets import qwen2_preset
from verl_mcore_utils.testing import free_port
from verl_mcore_utils.transformer_config import hf_to_transformer_config


def _nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def _state_tensors(opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every tensor of the optimizer state, named by (param index, key)."""
    index = {id(p): i for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}
    return {
        f"{index[id(p)]}.{k}": v
        for p, st in opt.state.items()
        for k, v in st.items()
        if isinstance(v, torch.Tensor)
    }


def _snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"param.{n}": p.detach().clone() for n, p in model.named_parameters()}
    out |= {f"grad.{n}": p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    out |= {f"opt.{k}": v.clone() for k, v in _state_tensors(opt).items()}
    return out


def _live(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"param.{n}": p for n, p in model.named_parameters()}
    out |= {f"grad.{n}": p.grad for n, p in model.named_parameters() if p.grad is not None}
    out |= {f"opt.{k}": v for k, v in _state_tensors(opt).items()}
    return out


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (unlike torch.equal, NaN == NaN and -0.0 != 0.0)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.detach().reshape(-1).view(torch.uint8), b.detach().reshape(-1).view(torch.uint8))


def _mismatches(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    assert a.keys() == b.keys()
    return [k for k in a if not _bitwise_equal(a[k], b[k])]


# ------------------------------------------------------------------------------------------------
# The real megatron-core GPTModel (tiny Qwen2) + AdamW, on a 1-rank gloo process group.
# ------------------------------------------------------------------------------------------------


def _build(hf: dict[str, Any]) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from verl_mcore_utils.model import build_gpt_model

    torch.manual_seed(0)
    model = build_gpt_model(
        hf_config=hf, tf_config=hf_to_transformer_config(hf, dtype="float32"), device="cpu"
    )
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> float:
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(seed))
    positions = torch.arange(16).expand(2, 16)
    opt.zero_grad(set_to_none=True)
    loss = model(input_ids=tokens, position_ids=positions, attention_mask=None, labels=tokens).mean()
    loss.backward()
    opt.step()
    return float(loss.detach())


def _megatron_round_trips() -> dict[str, Any]:
    hf = qwen2_preset("tiny", vocab_size=128)
    model, opt = _build(hf)
    ref_model, ref_opt = _build(hf)
    _train_step(model, opt, seed=1)
    _train_step(ref_model, ref_opt, seed=1)
    out: dict[str, Any] = {"cycles": []}
    before = _snapshot(model, opt)
    out["reference_identical_before"] = _mismatches(before, _snapshot(ref_model, ref_opt))
    for _ in range(3):
        m_stats = offload_megatron_model([model])
        o_stats = offload_megatron_optimizer(opt)
        live = _live(model, opt)
        m_state, o_state = get_offload_state(model), get_offload_state(opt)
        cycle = {
            "not_released": [k for k, t in live.items() if _nbytes(t) != 0],
            "flags": [
                is_offloaded(model, "params"),
                is_offloaded(model, "grads"),
                is_offloaded(opt, "optimizer"),
            ],
            "bytes": m_stats.bytes_by_kind | o_stats.bytes_by_kind,
            "host_bytes": {
                k: s.host_bytes(k)
                for s, k in ((m_state, "params"), (m_state, "grads"), (o_state, "optimizer"))
            },
            "host_allocated": m_stats.host_bytes_allocated + o_stats.host_bytes_allocated,
            "host_ptrs": sorted(b.data_ptr() for k in ("params", "grads") for b in m_state.host_buffers(k))
            + sorted(b.data_ptr() for b in o_state.host_buffers("optimizer")),
            "pinned": any(b.is_pinned() for b in m_state.host_buffers("params")),
        }
        on_m = onload_megatron_model([model])
        on_o = onload_megatron_optimizer(opt)
        cycle["onload_bytes"] = on_m.bytes_by_kind | on_o.bytes_by_kind
        cycle["mismatched_after_onload"] = _mismatches(before, _snapshot(model, opt))
        out["cycles"].append(cycle)
    out["device_bytes"] = {
        "params": sum(_nbytes(p) for p in model.parameters()),
        "grads": sum(_nbytes(p.grad) for p in model.parameters()),
        "optimizer": sum(_nbytes(t) for t in _state_tensors(opt).values()),
    }
    out["flags_after"] = [is_offloaded(model, "params"), is_offloaded(opt, "optimizer")]
    # Training goes on exactly as if nothing had happened.
    out["loss"] = _train_step(model, opt, seed=2)
    out["ref_loss"] = _train_step(ref_model, ref_opt, seed=2)
    out["mismatched_after_step"] = _mismatches(_snapshot(model, opt), _snapshot(ref_model, ref_opt))
    return out


@pytest.fixture(scope="module")
def megatron_run() -> Iterator[dict[str, Any]]:
    """One in-process gloo rank (a spawned rank would cost ~30 s of imports for 0.3 s of work)."""
    from verl_mcore_utils.parallel import destroy_parallel, init_parallel

    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1"}
    saved_env = {k: os.environ.get(k) for k in env}
    threads = torch.get_num_threads()
    os.environ.update(env)
    torch.set_num_threads(1)  # the reference model must compute bit for bit the same
    try:
        init_parallel(device="cpu")
        yield _megatron_round_trips()
    finally:
        destroy_parallel()
        torch.set_num_threads(threads)
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_megatron_model_round_trip_is_bitwise_exact(megatron_run: dict[str, Any]) -> None:
    assert megatron_run["reference_identical_before"] == []
    for cycle in megatron_run["cycles"]:
        assert cycle["mismatched_after_onload"] == []
        assert cycle["flags"] == [True, True, True]
    assert megatron_run["flags_after"] == [False, False]


def test_offload_releases_every_storage(megatron_run: dict[str, Any]) -> None:
    for cycle in megatron_run["cycles"]:
        assert cycle["not_released"] == []
        assert cycle["bytes"] == megatron_run["device_bytes"]
        assert cycle["onload_bytes"] == megatron_run["device_bytes"]
        assert not cycle["pinned"]  # nothing to pin without CUDA


def test_host_buffers_are_allocated_once_and_reused(megatron_run: dict[str, Any]) -> None:
    first, *later = megatron_run["cycles"]
    # Host memory is exactly one copy of the device state (no power-of-two rounding, no second copy).
    assert first["host_bytes"] == megatron_run["device_bytes"]
    assert first["host_allocated"] == sum(megatron_run["device_bytes"].values())
    for cycle in later:
        assert cycle["host_allocated"] == 0
        assert cycle["host_ptrs"] == first["host_ptrs"]
        assert cycle["host_bytes"] == first["host_bytes"]


def test_training_continues_identically_after_round_trips(megatron_run: dict[str, Any]) -> None:
    assert megatron_run["loss"] == megatron_run["ref_loss"]
    assert megatron_run["mismatched_after_step"] == []


# ------------------------------------------------------------------------------------------------
# megatron DDP's layout, rebuilt on CPU: every param.data and param.main_grad is a view into one flat
# buffer (with padding), like _ParamAndGradBuffer.param_data / .grad_data under the distributed
# optimizer. The real DDP runs in tests/test_gpu_offload.py.
# ------------------------------------------------------------------------------------------------


class _Buffer:
    def __init__(self, numel: int, *, shared: bool = False) -> None:
        self.param_data = torch.zeros(numel)
        self.grad_data = self.param_data if shared else torch.zeros(numel)


class _FlatBufferModel(torch.nn.Module):
    def __init__(self, *, shared: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.module = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
        params = list(self.module.parameters())
        self.buffers = [_Buffer(sum(p.numel() + 3 for p in params), shared=shared)]  # like megatron DDP
        offset = 0
        for p in params:
            view = self.buffers[0].param_data[offset : offset + p.numel()].view_as(p)
            view.copy_(p.data)
            p.data = view
            p.main_grad = self.buffers[0].grad_data[offset : offset + p.numel()].view_as(p)
            offset += p.numel() + 3  # padding between params, as between DDP buckets


def test_views_into_flat_buffers_stay_valid() -> None:
    model = _FlatBufferModel()
    buf = model.buffers[0]
    torch.nn.init.normal_(buf.grad_data, generator=torch.Generator().manual_seed(3))
    buf.param_data[-1] = 7.0  # padding content survives too: whole storages move
    params = list(model.module.parameters())
    offsets = [
        (p.data_ptr() - buf.param_data.data_ptr(), p.main_grad.data_ptr() - buf.grad_data.data_ptr())
        for p in params
    ]
    expected = (buf.param_data.clone(), buf.grad_data.clone())
    for _ in range(2):
        stats = offload_megatron_model(model)
        assert stats.num_storages == 2  # one per flat buffer, however many params view it
        assert stats.bytes_by_kind == {
            "params": buf.param_data.numel() * 4,
            "grads": buf.grad_data.numel() * 4,
        }
        assert _nbytes(buf.param_data) == 0 and _nbytes(buf.grad_data) == 0
        assert all(_nbytes(p) == 0 and _nbytes(p.main_grad) == 0 for p in params)
        onload_megatron_model(model)
        assert torch.equal(buf.param_data, expected[0]) and torch.equal(buf.grad_data, expected[1])
        # The very same views, still into the buffers: writes through one are seen by the other.
        assert offsets == [
            (p.data_ptr() - buf.param_data.data_ptr(), p.main_grad.data_ptr() - buf.grad_data.data_ptr())
            for p in params
        ]
        params[0].main_grad.add_(1.0)
        assert torch.equal(buf.grad_data[: params[0].numel()], expected[1][: params[0].numel()] + 1.0)
        buf.grad_data.copy_(expected[1])
    out = model.module(torch.ones(2, 6))
    assert out.shape == (2, 3)


def test_params_and_grads_sharing_one_storage_are_refused() -> None:
    model = _FlatBufferModel(shared=True)  # like megatron's MXFP8 shared param/grad buffer
    with pytest.raises(ValueError, match="share device memory"):
        offload_megatron_model(model)
    assert not is_offloaded(model, "params")
    assert _nbytes(model.buffers[0].param_data) > 0  # nothing was released
    offload_megatron_model(model, grads=False)  # one group at a time is fine
    onload_megatron_model(model, grads=False)


# ------------------------------------------------------------------------------------------------
# State rules and edge cases (plain torch modules, in-process).
# ------------------------------------------------------------------------------------------------


def _trained_mlp() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return model, opt


def test_double_offload_and_stray_onload_raise_without_moving_anything() -> None:
    model, opt = _trained_mlp()
    with pytest.raises(OffloadStateError, match="never offloaded"):
        onload_megatron_model(model)
    with pytest.raises(OffloadStateError, match="never offloaded"):
        onload_megatron_optimizer(opt)
    offload_megatron_model(model, grads=False)
    with pytest.raises(OffloadStateError, match="'params' of Sequential is already offloaded"):
        offload_megatron_model(model)  # params+grads: refused as a whole, grads stay put
    assert not is_offloaded(model, "grads") and all(_nbytes(p.grad) > 0 for p in model.parameters())
    with pytest.raises(OffloadStateError, match="'grads' of Sequential is not offloaded"):
        onload_megatron_model(model)
    onload_megatron_model(model, grads=False)
    offload_megatron_optimizer(opt)
    with pytest.raises(OffloadStateError, match="already offloaded"):
        offload_megatron_optimizer(opt)
    with pytest.raises(OffloadStateError, match="while \\['optimizer'\\] are offloaded"):
        get_offload_state(opt).release_host_buffers()
    onload_megatron_optimizer(opt)
    with pytest.raises(OffloadStateError, match="not offloaded"):
        onload_megatron_optimizer(opt)
    with pytest.raises(ValueError, match="nothing selected"):
        offload_megatron_model(model, params=False, grads=False)


def test_recreated_grads_reuse_host_memory_and_never_grow_it() -> None:
    model, opt = _trained_mlp()
    state = get_offload_state(model)
    first = offload_megatron_model(model, params=False)
    ptrs = sorted(b.data_ptr() for b in state.host_buffers("grads"))
    onload_megatron_model(model, params=False)
    for seed in range(3):
        opt.zero_grad(set_to_none=True)  # new grad tensors at new addresses each step
        model(torch.randn(3, 4, generator=torch.Generator().manual_seed(seed))).sum().backward()
        expected = [p.grad.clone() for p in model.parameters()]
        stats = offload_megatron_model(model, params=False)
        assert stats.host_bytes_allocated == 0
        assert sorted(b.data_ptr() for b in state.host_buffers("grads")) == ptrs
        assert state.host_bytes("grads") == first.total_bytes
        onload_megatron_model(model, params=False)
        assert all(torch.equal(p.grad, e) for p, e in zip(model.parameters(), expected, strict=True))
    # A grad that disappears frees its host buffer; host memory follows the device state down.
    model[0].bias.grad = None
    stats = offload_megatron_model(model, params=False)
    assert state.host_bytes("grads") == stats.total_bytes == first.total_bytes - 8 * 4
    onload_megatron_model(model, params=False)
    state.release_host_buffers()
    assert state.host_bytes() == 0


def test_tied_and_shared_parameters_move_once() -> None:
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight  # tied embeddings
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    expected = emb.weight.detach().clone()
    stats = offload_megatron_model(model, grads=False)
    assert stats.num_storages == 1 and stats.total_bytes == 10 * 4 * 4
    onload_megatron_model(model, grads=False)
    assert torch.equal(head.weight, expected) and head.weight is emb.weight


def test_several_chunks_move_together() -> None:
    chunks = [_trained_mlp()[0] for _ in range(2)]
    expected = [[p.detach().clone() for p in c.parameters()] for c in chunks]
    stats = offload_megatron_model(chunks)
    assert all(is_offloaded(c, "params") and is_offloaded(c, "grads") for c in chunks)
    assert stats.num_storages == 2 * 2 * 4  # 2 chunks x (params + grads) x 4 tensors
    back = onload_megatron_model(chunks)
    assert back.total_bytes == stats.total_bytes
    for chunk, exp in zip(chunks, expected, strict=True):
        assert all(torch.equal(p, e) for p, e in zip(chunk.parameters(), exp, strict=True))


def test_non_resizable_storage_is_refused_clearly() -> None:
    model = torch.nn.Linear(2, 2)
    model.weight.data = torch.from_numpy(model.weight.detach().numpy().copy())
    with pytest.raises(ValueError, match="non-resizable storage"):
        offload_megatron_model(model, grads=False)
    assert not is_offloaded(model, "params")


def test_stats_report_bytes_and_rate() -> None:
    model, _ = _trained_mlp()
    stats = offload_megatron_model(model)
    n = sum(p.numel() * 4 for p in model.parameters())
    assert stats.bytes_by_kind == {"params": n, "grads": n}
    assert stats.seconds > 0 and stats.gb_per_s > 0
    d = stats.as_dict()
    assert d["total_bytes"] == 2 * n and d["direction"] == "offload"
    onload_megatron_model(model)


class _MasterShardOptimizer:
    """megatron's DistributedOptimizer layout on CPU: fp32 master shards it owns (under the attribute
    megatron uses) and an inner torch optimizer over them; the bf16 model params are not its own."""

    def __init__(self, model_params: list[torch.nn.Parameter]) -> None:
        self.shard_fp32_from_float16_groups = [[p.detach().float().clone() for p in model_params]]
        self.optimizer = torch.optim.AdamW(self.shard_fp32_from_float16_groups[0], lr=1e-2)


class _StubOptimizer:
    is_stub_optimizer = True  # a rank without parameters in a ChainedOptimizer


class _Chained:
    def __init__(self, *members: Any) -> None:
        self.chained_optimizers = list(members)


def test_megatron_optimizer_layout_masters_and_state_move_model_params_stay() -> None:
    model = torch.nn.Linear(8, 4).to(torch.bfloat16)
    leaf = _MasterShardOptimizer(list(model.parameters()))
    chained = _Chained(leaf, _StubOptimizer())
    masters = leaf.shard_fp32_from_float16_groups[0]
    for m in masters:
        m.grad = torch.randn_like(m)  # what the step leaves behind
    leaf.optimizer.step()
    expected = {id(t): t.clone() for t in [*masters, *_state_tensors(leaf.optimizer).values()]}
    stats = offload_megatron_optimizer(chained)
    # masters (fp32) + exp_avg + exp_avg_sq + step, per parameter; model params untouched
    assert stats.bytes_by_kind == {"optimizer": sum(3 * m.numel() * 4 + 4 for m in masters)}
    assert all(_nbytes(m) == 0 and m.grad is None for m in masters)
    assert all(_nbytes(p) > 0 for p in model.parameters())
    onload_megatron_optimizer(chained)
    live = [*masters, *_state_tensors(leaf.optimizer).values()]
    assert all(torch.equal(t, expected[id(t)]) for t in live)
    leaf.optimizer.step()  # the inner optimizer finds its state (keyed by the same tensors)
