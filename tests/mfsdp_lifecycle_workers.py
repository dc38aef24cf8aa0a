"""Spawned-rank workers for the Megatron-FSDP lifecycle GPU tests (sync, offload, export, checkpoint).

Every worker builds tiny Qwen2 models with verl_mcore_utils' GPTModelProvider, wraps them with
verl_mfsdp.make_megatron_fsdp_module and trains on fixed data (the same two micro-batches every step,
seeded per rank), so two runs that start from the same state compute the same numbers bit for bit.
Results are plain Python values (pickled back to the test).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from megatron_steps import schedule_step

HF_KWARGS: dict[str, Any] = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4}
SEQ, MBS = 32, 4


def hf_config() -> dict[str, Any]:
    from verl_mcore_utils.hf_testing import tiny_hf_config

    return tiny_hf_config("qwen2", **HF_KWARGS).to_dict()


def random_hf_weights(seed: int) -> dict[str, torch.Tensor]:
    """Deterministic Hugging Face tensors for ``hf_config()`` (bf16, CPU): made once in the test process."""
    from verl_mcore_utils.weights import hf_tensor_shapes

    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in hf_tensor_shapes(hf_config=hf_config()).items():
        t = torch.randn(shape, generator=gen) * 0.05
        if name.endswith("norm.weight"):
            t = t + 1.0
        out[name] = t.to(torch.bfloat16)
    return out


def _init() -> None:
    from verl_mcore_utils.parallel import init_parallel

    init_parallel(device="cuda")


def _build(
    *,
    seed: int,
    strategy: str = "optim_grads_params",
    extra_ddp: Mapping[str, Any] | None = None,
    pre_wrap_hooks: Sequence[Callable[[list[torch.nn.Module]], Any]] = (),
) -> list[torch.nn.Module]:
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from verl_mcore_utils.ddp import WrapConfig
    from verl_mcore_utils.module import GPTModelProvider
    from verl_mcore_utils.transformer_config import hf_to_transformer_config
    from verl_mfsdp import make_megatron_fsdp_module

    model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)
    hf = hf_config()
    tf = hf_to_transformer_config(hf, dtype="bfloat16")
    provider = GPTModelProvider(hf_config=hf, transformer_config=tf, device="cuda")
    return make_megatron_fsdp_module(
        provider,
        wrap_config=WrapConfig(use_megatron_fsdp=True),
        override_ddp_config={"data_parallel_sharding_strategy": strategy, **dict(extra_ddp or {})},
        pre_wrap_hooks=pre_wrap_hooks,
    )


def _optimizer(models: Sequence[list[torch.nn.Module]]) -> Any:
    from mfsdp_workers import adam_config
    from verl_mcore_utils.module import attach_training_hooks
    from verl_mfsdp import make_megatron_fsdp_optimizer

    opt = make_megatron_fsdp_optimizer(adam_config(), [c for chunks in models for c in chunks])
    for chunks in models:
        attach_training_hooks(chunks, opt)
    return opt


def _data(rank: int) -> list[torch.Tensor]:
    gen = torch.Generator("cuda").manual_seed(100 + rank)
    return [torch.randint(0, 128, (MBS, SEQ), device="cuda", generator=gen) for _ in range(2)]


def _train_step(models: Sequence[list[torch.nn.Module]], opt: Any, data: list[torch.Tensor]) -> float:
    """One optimizer step over every model; the loss summed over models, averaged over ranks."""
    step = schedule_step(models, opt, data)
    assert step.ok, "optimizer step skipped"
    return step.loss


def _gpt(chunk: torch.nn.Module) -> torch.nn.Module:
    from verl_mcore_utils.weights import unwrap_model_chunks

    return unwrap_model_chunks([chunk])[0]


def _master_weights(chunk: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Reference: the optimizer's fp32 main-weight shards, gathered and cast to the compute dtype.

    Read from Megatron-FSDP's optimizer parameters, independent of what the module exposes now.
    """
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import uneven_dtensor_to_full_tensor

    out = {}
    for name, p in chunk.param_and_grad_buffer.optimizer_named_parameters:
        full = uneven_dtensor_to_full_tensor(p.detach())
        out[name.removeprefix("module.")] = full.to(p.orig_param.dtype)
    return out


def _module_weights_match(chunk: torch.nn.Module, reference: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """Do the module's parameters, as a weight exporter reads them, equal ``reference``?

    DTensor parameters (a synchronised chunk) are gathered; a plain parameter is read as it is, and one
    whose storage was released (an un-gathered FSDP unit) counts as not materialised.
    """
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import uneven_dtensor_to_full_tensor

    mismatched, unmaterialised, plain = [], [], 0
    with torch.no_grad():
        for name, p in _gpt(chunk).named_parameters():
            if type(p).__name__ == "DTensor":
                full = uneven_dtensor_to_full_tensor(p.detach()).to(p.orig_param.dtype)
            else:
                plain += 1
                if p.untyped_storage().nbytes() == 0:
                    unmaterialised.append(name)
                    continue
                full = p.detach()
            ref = reference[name]
            if full.shape != ref.shape or not torch.equal(full, ref):
                mismatched.append(name)
    return {
        "equal": not mismatched and not unmaterialised,
        "mismatched": len(mismatched),
        "unmaterialised": len(unmaterialised),
        "plain": plain,
    }


def _buggy_first_chunk_sync(chunks: Sequence[torch.nn.Module]) -> int:
    """verl's first version: returns after synchronising the FIRST chunk (the bug the test must catch)."""
    from verl_mcore_utils.compat import fsdp_synchronize_param_gather

    for chunk in chunks:
        fsdp_synchronize_param_gather(chunk)
        return 1
    return 0


def two_chunk_sync(rank: int, world_size: int, steps: int) -> dict[str, Any]:
    """Two Megatron-FSDP chunks (two separately provided models) trained by one optimizer.

    overlap_param_gather with no all-gather in start_param_sync: after a step the chunks hold raw
    (pre-step or released) gathered weights until their parameter gather is synchronised, so a chunk
    that is not synchronised is deterministically stale.
    """
    from verl_mfsdp import synchronize_megatron_fsdp_params

    _init()
    extra = {"overlap_param_gather": True, "fsdp_all_gather_in_start_param_sync": False}
    models = [_build(seed=11, extra_ddp=extra), _build(seed=22, extra_ddp=extra)]
    chunks = [models[0][0], models[1][0]]
    opt = _optimizer(models)
    initial = [_master_weights(c) for c in chunks]
    data = _data(rank)
    losses = [_train_step(models, opt, data) for _ in range(steps)]
    reference = [_master_weights(c) for c in chunks]
    changed = [
        sum(not torch.equal(initial[i][k], reference[i][k]) for k in reference[i]) for i in range(len(chunks))
    ]
    buggy_synced = _buggy_first_chunk_sync(chunks)
    buggy = [_module_weights_match(c, reference[i]) for i, c in enumerate(chunks)]
    synced = synchronize_megatron_fsdp_params(chunks)
    fixed = [_module_weights_match(c, reference[i]) for i, c in enumerate(chunks)]
    # Training goes on after the sync (the next forward re-gathers every chunk).
    losses.append(_train_step(models, opt, data))
    return {
        "losses": losses,
        "num_params": [len(r) for r in reference],
        "changed": changed,
        "buggy_synced": buggy_synced,
        "buggy": buggy,
        "synced": synced,
        "fixed": fixed,
    }


def _local(t: Any) -> torch.Tensor:
    return t._local_tensor if type(t).__name__ == "DTensor" else t


def _snapshot(chunks: Sequence[torch.nn.Module], opt: Any) -> dict[str, list[torch.Tensor]]:
    """Clones of every local shard: weight / main-weight / main-grad buffers and the Adam moments."""
    snap: dict[str, list[torch.Tensor]] = {"params": [], "grads": [], "optimizer": []}
    for chunk in chunks:
        for g in chunk.param_and_grad_buffer.parameter_groups:
            for kind, buf in (
                ("params", g.model_weight_buffer),
                ("params", g.main_weight_buffer),
                ("grads", g.main_grad_buffer),
            ):
                if buf is not None and getattr(buf, "data", None) is not None:
                    snap[kind].append(buf.data.detach().clone())
    inner = opt.chained_optimizers[0].optimizer if hasattr(opt, "chained_optimizers") else opt.optimizer
    for state in inner.state.values():
        for key in sorted(state):
            if isinstance(state[key], torch.Tensor):
                snap["optimizer"].append(_local(state[key]).detach().clone())
    return snap


def _same(a: dict[str, list[torch.Tensor]], b: dict[str, list[torch.Tensor]]) -> dict[str, bool]:
    return {
        k: len(a[k]) == len(b[k])
        and len(a[k]) > 0
        and all(torch.equal(x, y) for x, y in zip(a[k], b[k], strict=True))
        for k in a
    }


def offload_cycle(rank: int, world_size: int) -> dict[str, Any]:
    """Train 5 steps with two offload/onload cycles (after steps 2 and 3) and 5 steps without; compare."""
    from verl_mfsdp import (
        offload_megatron_fsdp_model,
        offload_megatron_fsdp_optimizer,
        onload_megatron_fsdp_model,
        onload_megatron_fsdp_optimizer,
        synchronize_megatron_fsdp_params,
    )

    _init()
    data = _data(rank)
    model = _build(seed=5)
    opt = _optimizer([model])
    losses = [_train_step([model], opt, data) for _ in range(2)]
    cycles = []
    for cycle in range(2):
        synchronize_megatron_fsdp_params(model)  # what offload does first; memory measured after it
        torch.cuda.synchronize()
        before = _snapshot(model, opt)
        mem0 = torch.cuda.memory_allocated()
        m_stats = offload_megatron_fsdp_model(model)
        o_stats = offload_megatron_fsdp_optimizer(opt)
        mem1 = torch.cuda.memory_allocated()
        on_m = onload_megatron_fsdp_model(model)
        on_o = onload_megatron_fsdp_optimizer(opt)
        after = _snapshot(model, opt)
        cycles.append(
            {
                "bitwise": _same(before, after),
                "offloaded_bytes": m_stats.total_bytes + o_stats.total_bytes,
                "bytes_by_kind": {**m_stats.bytes_by_kind, **o_stats.bytes_by_kind},
                "onloaded_bytes": on_m.total_bytes + on_o.total_bytes,
                "freed_bytes": mem0 - mem1,
                "host_bytes_allocated": m_stats.host_bytes_allocated + o_stats.host_bytes_allocated,
            }
        )
        del before, after
        losses += [_train_step([model], opt, data) for _ in range(1 if cycle == 0 else 2)]
    del model, opt
    torch.cuda.empty_cache()
    ref_model = _build(seed=5)
    ref_opt = _optimizer([ref_model])
    ref_losses = [_train_step([ref_model], ref_opt, data) for _ in range(5)]
    return {"losses": losses, "ref_losses": ref_losses, "cycles": cycles}


def export_weights(rank: int, world_size: int, weights: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Load ``weights`` into Megatron-FSDP models (two strategies) and a DDP model; export all three."""
    from verl_mcore_utils.ddp import WrapConfig
    from verl_mcore_utils.module import GPTModelProvider, make_megatron_module
    from verl_mcore_utils.transformer_config import hf_to_transformer_config
    from verl_mcore_utils.weights import export_hf_weights, hf_tensor_shapes, load_hf_weights
    from verl_mfsdp import export_megatron_fsdp_hf_weights

    _init()
    hf = hf_config()

    def load(chunks: list[torch.nn.Module]) -> None:
        load_hf_weights(chunks, weights, hf_config=hf)

    expected = {k: v.cuda() for k, v in weights.items()}
    out: dict[str, Any] = {"expected_names": sorted(hf_tensor_shapes(hf_config=hf))}
    for strategy in ("optim_grads_params", "optim"):
        chunks = _build(seed=1, strategy=strategy, pre_wrap_hooks=[load])
        exported = dict(export_megatron_fsdp_hf_weights(chunks, hf_config=hf))
        out[strategy] = {
            "names": sorted(exported),
            "unequal": sorted(
                k for k in expected if k in exported and not torch.equal(exported[k], expected[k])
            ),
            "dtypes": sorted({str(t.dtype) for t in exported.values()}),
        }
        fsdp_export = exported
    tf = hf_to_transformer_config(hf, dtype="bfloat16")
    ddp = make_megatron_module(
        GPTModelProvider(hf_config=hf, transformer_config=tf, device="cuda"),
        wrap_config=WrapConfig(use_distributed_optimizer=True),
        pre_wrap_hooks=[load],
    )
    ddp_export = {k: v.clone() for k, v in export_hf_weights(ddp, hf_config=hf)}
    out["ddp_vs_fsdp_unequal"] = sorted(
        k for k in ddp_export if k not in fsdp_export or not torch.equal(ddp_export[k], fsdp_export[k])
    )
    out["ddp_names"] = sorted(ddp_export)
    return out


def checkpoint_run(
    rank: int, world_size: int, path: str, mode: str, total_steps: int, save_after: int
) -> dict[str, Any]:
    """mode "save": train, save after ``save_after`` steps, keep training; "load": fresh model, load, train."""
    from verl_mfsdp import load_megatron_fsdp_checkpoint, save_megatron_fsdp_checkpoint

    _init()
    data = _data(rank)
    out: dict[str, Any] = {}
    if mode == "save":
        model = _build(seed=3)
        opt = _optimizer([model])
        losses = []
        for step in range(1, total_steps + 1):
            losses.append(_train_step([model], opt, data))
            if step == save_after:
                save_megatron_fsdp_checkpoint(
                    model, opt, path=path, step=step, extra={"consumed_samples": 8 * step}
                )
        out["losses"] = losses
        out.update(_adam_steps(opt))
        return out
    # A missing checkpoint and a checkpoint of another sharding strategy fail clearly, before collectives.
    other = _build(seed=9, strategy="optim")
    other_opt = _optimizer([other])
    try:
        load_megatron_fsdp_checkpoint(other, other_opt, path=path + "_missing")
    except FileNotFoundError as exc:
        out["missing_error"] = str(exc)
    try:
        load_megatron_fsdp_checkpoint(other, other_opt, path=path)
    except ValueError as exc:
        out["layout_error"] = str(exc)
    del other, other_opt
    model = _build(seed=777)  # different initial weights: everything must come from the checkpoint
    opt = _optimizer([model])
    info = load_megatron_fsdp_checkpoint(model, opt, path=path)
    out["info"] = info
    out["losses"] = [_train_step([model], opt, data) for _ in range(total_steps - save_after)]
    out.update(_adam_steps(opt))
    return out


def _adam_steps(opt: Any) -> dict[str, list[float]]:
    """Adam step counters of parameters with / without a local shard on this rank (distinct values)."""
    inner = opt.chained_optimizers[0].optimizer if hasattr(opt, "chained_optimizers") else opt.optimizer
    steps: dict[str, set[float]] = {"adam_steps": set(), "adam_steps_empty_shard": set()}
    for p, st in inner.state.items():
        key = "adam_steps" if _local(p).numel() > 0 else "adam_steps_empty_shard"
        steps[key].add(float(st["step"]))
    return {k: sorted(v) for k, v in steps.items()}
