"""One CUDA graph of the decoder replayed for different CP-1 micro-batches equals the eager decoder (bf16).

verl_dyncp.graphed_decoder captures megatron-core's TransformerBlock (verl-dyncp's attention, RoPE from the
copied-in positions) once for GraphSlots(512 tokens, 8 sequences); micro-batches with other token counts,
sequence counts and lengths, one filling the budget exactly, replay it. Each is compared with the eager
decoder on the same micro-batch: output, input gradient, every parameter's gradient. Also: a CP-k
micro-batch's graph inputs reach the GPU without the host waiting for it.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch

from verl_mcore_utils.testing import run_distributed

# token counts differ, sequence counts differ (7 sequences + the padding slot = all 8), one fills the budget
BATCHES = ((200, 100, 37), (512,), (60,) * 7, (300, 211))


def _decoder() -> tuple[Any, int]:
    from megatron.core.tensor_parallel import random as mcore_random

    from verl_dyncp.model import build_thd_gpt_model
    from verl_mcore_utils.parallel import init_parallel
    from verl_mcore_utils.presets import qwen2_preset
    from verl_mcore_utils.transformer_config import hf_to_transformer_config

    init_parallel(device="cuda")
    accepted = inspect.signature(mcore_random.model_parallel_cuda_manual_seed).parameters
    mcore_random.model_parallel_cuda_manual_seed(
        1234, **{k: True for k in ("use_cudagraphable_rng", "force_reset_rng") if k in accepted}
    )
    torch.manual_seed(0)
    hf = qwen2_preset("1b", vocab_size=32000, num_hidden_layers=2, max_position_embeddings=4096)
    tf = hf_to_transformer_config(hf, dtype="bfloat16")
    device = torch.device("cuda", torch.cuda.current_device())
    model = build_thd_gpt_model(hf_config=hf, tf_config=tf, device=device).to(dtype=torch.bfloat16)
    return model.decoder, int(hf["hidden_size"])


def _params(lens: tuple[int, ...]) -> Any:
    from verl_dyncp.groups import CPGroups
    from verl_dyncp.layout import thd_packed_seq_params
    from verl_dyncp.planner import dynamic_cp_split_batch

    tokens = torch.zeros(sum(lens), dtype=torch.long, device="cuda")
    mb = dynamic_cp_split_batch(tokens, seq_lens=lens, groups=CPGroups(), static_cp_size=1)
    return thd_packed_seq_params(mb.batch.meta, cp_group=None)


def _run(fn: Any, decoder: Any, x: torch.Tensor, grad: torch.Tensor) -> dict[str, torch.Tensor]:
    for p in decoder.parameters():
        p.grad = None
    xi = x.detach().clone().requires_grad_(True)
    y = fn(xi)
    y.backward(grad)
    out = {"out": y.detach().float().clone(), "dx": xi.grad.float()}
    out |= {f"p.{n}": p.grad.float().clone() for n, p in decoder.named_parameters()}
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _graph_worker(rank: int, world_size: int) -> dict[str, Any]:
    from verl_dyncp.graph_layout import GraphSlots
    from verl_dyncp.graphed_decoder import GraphedDecoder
    from verl_dyncp.kernels import varlen_kernel_available

    if not varlen_kernel_available():
        return {"skip": "torch.nn.attention.varlen is not available"}
    decoder, hidden = _decoder()
    graphed = GraphedDecoder(decoder, slots=GraphSlots(tokens=512, sequences=8), hidden_size=hidden,
                             dtype=torch.bfloat16)  # fmt: skip
    gen = torch.Generator(device="cuda").manual_seed(5)
    errors = []
    for lens in BATCHES:
        params = _params(lens)
        x = torch.randn(sum(lens), 1, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
        g = torch.randn(x.shape, device="cuda", dtype=torch.bfloat16, generator=gen) * 1e-2
        eager = _run(lambda h, p=params: decoder(hidden_states=h, attention_mask=None, packed_seq_params=p),
                     decoder, x, g)  # fmt: skip
        replay = _run(lambda h, p=params: graphed(h, packed_seq_params=p), decoder, x, g)
        errors.append({k: _rel(replay[k], eager[k]) for k in eager})
    params = _params(BATCHES[0])
    x = torch.randn(sum(BATCHES[0]), 1, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    graphed(x, packed_seq_params=params)
    try:
        graphed(x, packed_seq_params=params)
        refused = ""
    except RuntimeError as err:
        refused = str(err)
    return {"errors": errors, "refused": refused}


@pytest.mark.num_gpus(1)
def test_one_graph_replays_micro_batches_of_any_layout_like_the_eager_decoder() -> None:
    (result,) = run_distributed(_graph_worker, world_size=1, backend="nccl", timeout_s=300)
    if "skip" in result:
        pytest.skip(result["skip"])
    for lens, errors in zip(BATCHES, result["errors"], strict=True):
        worst = max(errors, key=errors.get)
        print(f"{len(lens)} sequences, {sum(lens)} tokens: out {errors['out']:.2e}, dx {errors['dx']:.2e},"
              f" worst {worst} {errors[worst]:.2e}")  # fmt: skip
        # bf16: the padded GEMMs may pick other kernels (other accumulation order) than the eager shapes;
        # 1e-2 relative (norm) is a few bf16 roundings, far below a wrong layout (order-1 errors)
        assert errors["out"] < 1e-2 and errors["dx"] < 1e-2, errors
        assert errors[worst] < 2e-2, (worst, errors[worst])
    assert "previous micro-batch's backward has not run" in result["refused"]


def _cp_inputs_worker(rank: int, world_size: int) -> dict[str, Any]:
    """CP-2 and CP-4 graph inputs built on CUDA from a micro-batch's cached layout, with every synchronising
    CUDA call an error (``set_sync_debug_mode``), against the same inputs built on the host."""
    from verl_dyncp.graph_layout import GraphSlots, pad_cp_layout_to_slots
    from verl_dyncp.layout import build_thd_layout

    slots, seq_lens, mismatches = GraphSlots(tokens=1024, sequences=8), [300, 17, 611], []
    for cp_size in (2, 4):
        padded = [-(-n // (2 * cp_size)) * 2 * cp_size for n in seq_lens]
        for cp_rank in range(cp_size):
            built = {
                device: build_thd_layout(
                    cu_seqlens=torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()], dtype=torch.int32),
                    cu_seqlens_padded=torch.tensor([0, *torch.tensor(padded).cumsum(0).tolist()], dtype=torch.int32),
                    cp_size=cp_size, cp_rank=cp_rank, device=device,
                )
                for device in ("cpu", "cuda")
            }  # fmt: skip
            torch.cuda.synchronize()
            torch.cuda._sleep(50_000_000)  # a busy queue: a copy that waited for it would stall here
            torch.cuda.set_sync_debug_mode("error")
            try:
                got = pad_cp_layout_to_slots(built["cuda"], slots=slots)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            want = pad_cp_layout_to_slots(built["cpu"], slots=slots)
            for name, a, b in zip(("position_ids", "valid", "full_index", "stream_index", "cu_q", "cu_k"),
                                  got.tensors(), want.tensors(), strict=True):  # fmt: skip
                if a.device.type != "cuda" or not torch.equal(a.cpu(), b):
                    mismatches.append(f"CP {cp_size} rank {cp_rank}: {name}")
    return {"mismatches": mismatches}


@pytest.mark.num_gpus(1)
def test_cp_graph_inputs_reach_the_gpu_without_a_host_wait() -> None:
    """A graphed CP-k micro-batch's inputs are built on the host and copied from pinned memory: a pageable
    (blocking) copy would make the host wait for every kernel queued before the replay."""
    (result,) = run_distributed(_cp_inputs_worker, world_size=1, backend="nccl", timeout_s=120)
    assert result["mismatches"] == []


@pytest.mark.num_gpus(1)
def test_a_layout_cached_on_the_gpu_is_found_under_cuda_with_or_without_an_index() -> None:
    """The cache key carries the device's index: a layout cached from tensors on ``cuda:<i>`` is the one a
    reader asking for ``"cuda"`` (the current device) gets, not a second build."""
    from verl_dyncp.layout import thd_layout, thd_packed_seq_params
    from verl_dyncp.thd import build_thd_meta

    meta = build_thd_meta(seq_lens=[5, 130, 1, 77], cp_size=1, cp_rank=0, tp_size=1, device="cuda")
    params = thd_packed_seq_params(meta, cp_group=None)
    first = thd_layout(params, cp_size=1, cp_rank=0, device=torch.device("cuda", torch.cuda.current_device()))
    assert thd_layout(params, cp_size=1, cp_rank=0, device="cuda") is first
    assert first.position_ids is meta.position_ids  # the view thd_packed_seq_params cached, not a rebuild
