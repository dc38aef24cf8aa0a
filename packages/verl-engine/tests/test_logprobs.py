"""Chunked vocab-parallel log-probs and entropy: values and gradients against a float64 reference, with and
without tensor parallelism (gloo on CPU), and the memory contract (no float32 copy of the logits is made
whole or kept for backward).

Tolerance: relative 1e-5 of the largest reference magnitude of the compared tensor (an elementwise relative
bound would be meaningless where a gradient crosses zero). bf16 logits: values are computed in float32 from
the bf16 numbers, so they keep 1e-5 against a reference on the same bf16 numbers; the gradient is rounded to
bf16 (8 significant bits), so it gets 2**-8 relative to each element plus 1e-5 of the largest.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from vocab_testing import LargestTensor, close, output_grads, seeded_labels, tp_worker, vocab_shard

from verl_engine.logprobs import log_probs_from_logits, vocab_parallel_log_probs_and_entropy
from verl_mcore_utils.testing import run_distributed


def _case(
    *, seed: int, lead: tuple[int, ...], vocab: int, dtype: torch.dtype = torch.float32, skew: bool = False
) -> dict[str, torch.Tensor]:
    """Seeded logits, labels (some ignored, one past the vocabulary) and upstream grads for both outputs.

    ``skew`` lifts the first half of the vocabulary by 25, so in TP the other shards' maxima are far below
    the global one (the rescaling of per-shard sums must then be right, not merely harmless).
    """
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn((*lead, vocab), generator=gen) * 3
    if skew:
        logits[..., : vocab // 2] += 25
    labels = seeded_labels(gen, lead=lead, vocab=vocab)
    return {
        "logits": logits.to(dtype),
        "labels": labels,
        "grad_log_probs": torch.randn(lead, generator=gen),
        "grad_entropy": torch.randn(lead, generator=gen),
    }


def _reference(case: dict[str, torch.Tensor], *, temperature: float) -> dict[str, torch.Tensor]:
    """float64 log_softmax / entropy of the full logits and their gradient for the case's upstream grads."""
    logits = case["logits"].detach().double().requires_grad_()
    labels = case["labels"]
    vocab = logits.shape[-1]
    log_p = torch.log_softmax(logits / temperature, dim=-1)
    valid = (labels >= 0) & (labels < vocab)
    picked = log_p.gather(-1, labels.clamp(0, vocab - 1)[..., None]).squeeze(-1)
    log_probs = torch.where(valid, picked, torch.zeros_like(picked))
    entropy = -(log_p.exp() * log_p).sum(-1)
    (grad,) = torch.autograd.grad(
        (log_probs, entropy), logits, (case["grad_log_probs"].double(), case["grad_entropy"].double())
    )
    return {"log_probs": log_probs.detach(), "entropy": entropy.detach(), "grad": grad}


def _ours(
    case: dict[str, torch.Tensor], *, logits: torch.Tensor | None = None, **options: Any
) -> dict[str, Any]:
    """Outputs of the function under test (``options``: its keywords) and the gradient of (log_probs,
    entropy) for the case's grads."""
    logits = (case["logits"] if logits is None else logits).detach().requires_grad_()
    log_probs, entropy = vocab_parallel_log_probs_and_entropy(logits, case["labels"], **options)
    (grad,) = output_grads(case, log_probs, entropy, inputs=[logits])
    return {"log_probs": log_probs.detach(), "entropy": entropy, "grad": grad}


def _assert_matches(ours: dict[str, Any], ref: dict[str, torch.Tensor], *, with_entropy: bool = True) -> None:
    close(ours["log_probs"], ref["log_probs"])
    if with_entropy:
        close(ours["entropy"].detach(), ref["entropy"])
        close(ours["grad"], ref["grad"])


# --------------------------------------------------------------------------------------------- no TP


@pytest.mark.parametrize(
    ("lead", "temperature", "chunk_size"),
    [
        ((13,), 1.0, 4096),  # one chunk
        ((13,), 0.7, 4),  # chunk does not divide T
        ((3, 5), 1.3, 2),  # leading batch dims [B, S, V]
        ((2, 3, 4), 1.0, 1),  # one token per chunk
    ],
)
def test_matches_float64_reference_without_tp(
    lead: tuple[int, ...], temperature: float, chunk_size: int
) -> None:
    case = _case(seed=1, lead=lead, vocab=97)
    ours = _ours(case, temperature=temperature, chunk_size=chunk_size)
    assert ours["log_probs"].dtype == torch.float32 and ours["log_probs"].shape == lead
    assert ours["entropy"].dtype == torch.float32 and ours["entropy"].shape == lead
    assert ours["grad"].dtype == torch.float32
    _assert_matches(ours, _reference(case, temperature=temperature))


def test_ignored_labels_give_zero_and_no_log_prob_gradient() -> None:
    case = _case(seed=2, lead=(11,), vocab=31)
    ignored = (case["labels"] < 0) | (case["labels"] >= 31)
    logits = case["logits"].detach().requires_grad_()
    log_probs, entropy = vocab_parallel_log_probs_and_entropy(logits, case["labels"], chunk_size=3)
    assert entropy is not None
    assert ignored.sum() >= 2 and torch.all(log_probs[ignored] == 0)
    (grad,) = torch.autograd.grad(
        log_probs, logits, case["grad_log_probs"], retain_graph=True
    )  # entropy unused: None grad
    assert torch.all(grad[ignored] == 0) and torch.all(grad[~ignored].abs().sum(-1) > 0)
    # the entropy of an ignored token still has its gradient (the label plays no part in it)
    (grad_h,) = torch.autograd.grad(entropy, logits, case["grad_entropy"])
    ref = _reference({**case, "grad_log_probs": torch.zeros(11)}, temperature=1.0)
    close(grad_h, ref["grad"])


def test_without_entropy_and_the_convenience_wrapper() -> None:
    case = _case(seed=3, lead=(4, 5), vocab=40)
    ref = _reference({**case, "grad_entropy": torch.zeros(4, 5)}, temperature=0.9)
    ours = _ours(case, temperature=0.9, chunk_size=7, compute_entropy=False)
    assert ours["entropy"] is None
    close(ours["log_probs"], ref["log_probs"])
    close(ours["grad"], ref["grad"])
    close(
        log_probs_from_logits(case["logits"], case["labels"], temperature=0.9, chunk_size=3), ref["log_probs"]
    )


def test_non_contiguous_logits_and_int32_labels() -> None:
    case = _case(seed=4, lead=(6, 3), vocab=50)
    transposed = case["logits"].transpose(0, 1).contiguous().transpose(0, 1)  # [6, 3, V], not contiguous
    assert not transposed.is_contiguous()
    ours = _ours({**case, "labels": case["labels"].int()}, logits=transposed, temperature=1.0, chunk_size=5)
    _assert_matches(ours, _reference(case, temperature=1.0))


def test_bf16_logits_give_bf16_gradient() -> None:
    case = _case(seed=5, lead=(3, 7), vocab=64, dtype=torch.bfloat16)
    ours = _ours(case, temperature=0.8, chunk_size=4)
    ref = _reference(case, temperature=0.8)  # the same bf16 numbers, in float64
    assert ours["grad"].dtype == torch.bfloat16 and ours["log_probs"].dtype == torch.float32
    close(ours["log_probs"], ref["log_probs"])
    close(ours["entropy"].detach(), ref["entropy"])
    close(ours["grad"], ref["grad"], elementwise=2**-8)


def test_empty_input_and_argument_checks() -> None:
    log_probs, entropy = vocab_parallel_log_probs_and_entropy(
        torch.zeros(0, 5), torch.zeros(0, dtype=torch.long)
    )
    assert log_probs.shape == (0,) and entropy is not None and entropy.shape == (0,)
    logits, labels = torch.zeros(2, 5), torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match="labels shape"):
        vocab_parallel_log_probs_and_entropy(logits, labels[:1])
    with pytest.raises(ValueError, match="temperature"):
        vocab_parallel_log_probs_and_entropy(logits, labels, temperature=0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        vocab_parallel_log_probs_and_entropy(logits, labels, chunk_size=0)
    with pytest.raises(ValueError, match="integer"):
        vocab_parallel_log_probs_and_entropy(logits, labels.float())


# ------------------------------------------------------------------------------------------- memory


def test_backward_saves_the_input_logits_and_only_per_token_tensors() -> None:
    """No float32 copy of the logits is kept for backward: the only big saved tensor is the input itself."""
    case = _case(seed=6, lead=(4, 8), vocab=96, dtype=torch.bfloat16)
    logits = case["logits"].requires_grad_()
    saved: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        log_probs, entropy = vocab_parallel_log_probs_and_entropy(logits, case["labels"], chunk_size=5)
    num_tokens = 4 * 8
    big = [t for t in saved if t.numel() > num_tokens]
    assert saved and all(t.numel() <= logits.numel() for t in saved)
    assert len(big) == 1
    assert big[0].data_ptr() == logits.data_ptr() and big[0].dtype == torch.bfloat16
    assert entropy is not None
    torch.autograd.grad((log_probs, entropy), logits, (case["grad_log_probs"], case["grad_entropy"]))


def test_float32_temporaries_are_bounded_by_the_chunk_in_forward_and_backward() -> None:
    case = _case(seed=7, lead=(40,), vocab=128, dtype=torch.bfloat16)
    logits = case["logits"].requires_grad_()
    chunk_size = 6
    with LargestTensor(torch.float32) as forward_mode:
        log_probs, entropy = vocab_parallel_log_probs_and_entropy(
            logits, case["labels"], temperature=0.7, chunk_size=chunk_size
        )
    assert entropy is not None
    with LargestTensor(torch.float32) as backward_mode:
        (grad,) = torch.autograd.grad(
            (log_probs, entropy), logits, (case["grad_log_probs"], case["grad_entropy"])
        )
    assert grad.dtype == torch.bfloat16
    assert 0 < forward_mode.largest <= chunk_size * 128
    assert 0 < backward_mode.largest <= chunk_size * 128


# ---------------------------------------------------------------------------------- TP (gloo, CPU)

# (seed, lead, vocab, temperature, chunk_size, compute_entropy, skew); vocab divisible by 2 and 4
_TP_CASES = [
    (10, (9,), 48, 1.0, 4, True, False),
    (11, (2, 5), 64, 0.6, 3, True, True),
    (12, (7,), 40, 1.5, 16, False, False),
]


def _tp_case(params: tuple[Any, ...], *, rank: int, world_size: int, tp_group: Any) -> dict[str, Any]:
    """One case on one rank: this rank's vocab shard of the logits, run over the TP group."""
    seed, lead, vocab, temperature, chunk_size, compute_entropy, skew = params
    case = _case(seed=seed, lead=lead, vocab=vocab, skew=skew)
    shard = vocab_shard(case["logits"], dim=-1, rank=rank, world_size=world_size)
    options = {"temperature": temperature, "chunk_size": chunk_size, "compute_entropy": compute_entropy}
    return _ours(case, logits=shard, tp_group=tp_group, **options)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])
def test_matches_float64_reference_with_tp(tp: int) -> None:
    per_rank = run_distributed(
        tp_worker, world_size=tp, args=(_TP_CASES, _tp_case), backend="gloo", timeout_s=240
    )
    for index, (seed, lead, vocab, temperature, _, compute_entropy, skew) in enumerate(_TP_CASES):
        case = _case(seed=seed, lead=lead, vocab=vocab, skew=skew)
        if not compute_entropy:
            case["grad_entropy"] = torch.zeros(lead)
        ref = _reference(case, temperature=temperature)
        for results in per_rank:  # outputs are replicated on every TP rank
            close(results[index]["log_probs"], ref["log_probs"])
            if compute_entropy:
                close(results[index]["entropy"].detach(), ref["entropy"])
            else:
                assert results[index]["entropy"] is None
        close(torch.cat([results[index]["grad"] for results in per_rank], dim=-1), ref["grad"])
