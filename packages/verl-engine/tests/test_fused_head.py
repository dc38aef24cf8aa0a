"""The fused LM head (hidden states -> log-probs / entropy, chunked): values and the gradients of the hidden
states and of the weight against a float64 reference built the plain way (full logits, log_softmax), with
and without tensor parallelism (gloo on CPU), and its memory contract: no tensor of ``[tokens, vocab]``
elements is ever created, in forward or in backward.

Tolerance as in test_logprobs.py: relative 1e-5 of the largest reference magnitude of each compared tensor
(fp32 inputs); bf16 inputs: values 1e-5 against a float64 reference on the same bf16 numbers with the
logits rounded to bf16 as the output layer rounds them, gradients rounded to bf16 (2**-7 of the largest:
two bf16 roundings, of the logits' gradient and of the product).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from vocab_testing import LargestTensor, close, output_grads, seeded_labels, tp_worker, vocab_shard

from verl_engine.fused_head import fused_lm_head_log_probs
from verl_mcore_utils.testing import run_distributed


def _case(
    *, seed: int, lead: tuple[int, ...], vocab: int, hidden: int = 16, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    labels = seeded_labels(gen, lead=lead, vocab=vocab)
    return {
        "hidden": torch.randn((*lead, hidden), generator=gen).to(dtype),
        "weight": (torch.randn((vocab, hidden), generator=gen) * 0.7).to(dtype),
        "labels": labels,
        "grad_log_probs": torch.randn(lead, generator=gen),
        "grad_entropy": torch.randn(lead, generator=gen),
    }


def _reference(case: dict[str, torch.Tensor], *, temperature: float, entropy: bool = True) -> dict[str, Any]:
    """float64 log_softmax / entropy of ``hidden @ weight^T`` and the gradients of hidden and weight."""
    hidden = case["hidden"].detach().double().requires_grad_()
    weight = case["weight"].detach().double().requires_grad_()
    logits = hidden @ weight.t()
    if case["hidden"].dtype == torch.bfloat16:  # the output layer's logits are bf16 numbers
        logits = logits.detach().to(torch.bfloat16).double() + (logits - logits.detach())
    labels, vocab = case["labels"], weight.shape[0]
    log_p = torch.log_softmax(logits / temperature, dim=-1)
    valid = (labels >= 0) & (labels < vocab)
    picked = log_p.gather(-1, labels.clamp(0, vocab - 1)[..., None]).squeeze(-1)
    log_probs = torch.where(valid, picked, torch.zeros_like(picked))
    ent = -(log_p.exp() * log_p).sum(-1)
    outputs, grads = [log_probs], [case["grad_log_probs"].double()]
    if entropy:
        outputs.append(ent)
        grads.append(case["grad_entropy"].double())
    grad_hidden, grad_weight = torch.autograd.grad(outputs, (hidden, weight), grads)
    return {
        "log_probs": log_probs.detach(),
        "entropy": ent.detach(),
        "grad_hidden": grad_hidden,
        "grad_weight": grad_weight,
    }


def _ours(
    case: dict[str, torch.Tensor], *, weight: torch.Tensor | None = None, **options: Any
) -> dict[str, Any]:
    """Outputs of the function under test (``options``: its keywords) and the gradients of the hidden states
    and of the weight for the case's grads."""
    hidden = case["hidden"].detach().requires_grad_()
    weight = (case["weight"] if weight is None else weight).detach().requires_grad_()
    log_probs, entropy = fused_lm_head_log_probs(hidden, weight, case["labels"], **options)
    grad_hidden, grad_weight = output_grads(case, log_probs, entropy, inputs=[hidden, weight])
    return {
        "log_probs": log_probs.detach(),
        "entropy": None if entropy is None else entropy.detach(),
        "grad_hidden": grad_hidden,
        "grad_weight": grad_weight,
    }


@pytest.mark.parametrize(
    ("lead", "temperature", "chunk_size", "compute_entropy"),
    [
        ((13,), 1.0, 4096, True),  # one chunk
        ((13,), 0.7, 4, True),  # chunk does not divide the tokens
        ((3, 5), 1.3, 2, True),  # [B, S, H] input
        ((2, 3, 4), 1.0, 1, False),  # a token per chunk, no entropy
    ],
)
def test_matches_float64_reference_without_tp(
    lead: tuple[int, ...], temperature: float, chunk_size: int, compute_entropy: bool
) -> None:
    case = _case(seed=1, lead=lead, vocab=97)
    ours = _ours(case, temperature=temperature, chunk_size=chunk_size, compute_entropy=compute_entropy)
    ref = _reference(case, temperature=temperature, entropy=compute_entropy)
    assert ours["log_probs"].shape == lead and ours["log_probs"].dtype == torch.float32
    close(ours["log_probs"], ref["log_probs"])
    if compute_entropy:
        close(ours["entropy"], ref["entropy"])
    else:
        assert ours["entropy"] is None
    close(ours["grad_hidden"], ref["grad_hidden"])
    close(ours["grad_weight"], ref["grad_weight"])


def test_bf16_inputs_give_bf16_gradients() -> None:
    case = _case(seed=2, lead=(4, 6), vocab=64, dtype=torch.bfloat16)
    ours = _ours(case, temperature=0.8, chunk_size=5)
    ref = _reference(case, temperature=0.8)
    assert ours["grad_hidden"].dtype == torch.bfloat16 and ours["grad_weight"].dtype == torch.bfloat16
    close(ours["log_probs"], ref["log_probs"])
    close(ours["entropy"], ref["entropy"])
    close(ours["grad_hidden"], ref["grad_hidden"], rtol=2**-7)
    close(ours["grad_weight"], ref["grad_weight"], rtol=2**-7)


def test_ignored_labels_and_argument_checks() -> None:
    case = _case(seed=3, lead=(11,), vocab=31)
    ignored = (case["labels"] < 0) | (case["labels"] >= 31)
    log_probs, _ = fused_lm_head_log_probs(case["hidden"], case["weight"], case["labels"], chunk_size=3)
    assert ignored.sum() >= 2 and torch.all(log_probs[ignored] == 0) and torch.all(log_probs[~ignored] < 0)
    with pytest.raises(ValueError, match="do not match"):
        fused_lm_head_log_probs(case["hidden"], case["weight"][:, :5], case["labels"])
    with pytest.raises(ValueError, match="output weight is torch.bfloat16"):
        fused_lm_head_log_probs(case["hidden"], case["weight"].bfloat16(), case["labels"])
    with pytest.raises(ValueError, match="labels shape"):
        fused_lm_head_log_probs(case["hidden"], case["weight"], case["labels"][:3])
    with pytest.raises(ValueError, match="chunk_size"):
        fused_lm_head_log_probs(case["hidden"], case["weight"], case["labels"], chunk_size=0)


def test_no_tokens_by_vocab_tensor_is_ever_created() -> None:
    """Forward and backward stay within one chunk of logits (or the weight's own size)."""
    tokens, vocab, hidden, chunk = 64, 256, 8, 6
    case = _case(seed=4, lead=(tokens,), vocab=vocab, hidden=hidden, dtype=torch.bfloat16)
    h = case["hidden"].requires_grad_()
    w = case["weight"].requires_grad_()
    bound = max(chunk * vocab, vocab * hidden)
    assert bound * 8 <= tokens * vocab  # the bound is far below a full logits tensor
    with LargestTensor() as forward_mode:
        log_probs, entropy = fused_lm_head_log_probs(h, w, case["labels"], temperature=0.7, chunk_size=chunk)
    assert entropy is not None
    with LargestTensor() as backward_mode:
        torch.autograd.grad((log_probs, entropy), (h, w), (case["grad_log_probs"], case["grad_entropy"]))
    assert 0 < forward_mode.largest <= bound
    assert 0 < backward_mode.largest <= bound


# ---------------------------------------------------------------------------------- TP (gloo, CPU)

_TP_CASES = [  # (seed, lead, vocab, temperature, chunk_size, compute_entropy); vocab divisible by 2 and 4
    (10, (9,), 48, 1.0, 4, True),
    (11, (2, 5), 64, 0.6, 3, True),
    (12, (7,), 40, 1.5, 16, False),
]


def _tp_case(params: tuple[Any, ...], *, rank: int, world_size: int, tp_group: Any) -> dict[str, Any]:
    """One case on one rank: the whole hidden states, this rank's vocabulary rows of the weight."""
    seed, lead, vocab, temperature, chunk_size, compute_entropy = params
    case = _case(seed=seed, lead=lead, vocab=vocab)
    shard = vocab_shard(case["weight"], dim=0, rank=rank, world_size=world_size)
    options = {"temperature": temperature, "chunk_size": chunk_size, "compute_entropy": compute_entropy}
    return _ours(case, weight=shard, tp_group=tp_group, **options)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])
def test_matches_float64_reference_with_tp(tp: int) -> None:
    """Outputs replicated on every rank; the hidden states' gradient is this rank's share (megatron's
    copy-to-TP region sums the shares in backward), the weight's gradient is this rank's rows."""
    per_rank = run_distributed(
        tp_worker, world_size=tp, args=(_TP_CASES, _tp_case), backend="gloo", timeout_s=240
    )
    for index, (seed, lead, vocab, temperature, _, compute_entropy) in enumerate(_TP_CASES):
        case = _case(seed=seed, lead=lead, vocab=vocab)
        ref = _reference(case, temperature=temperature, entropy=compute_entropy)
        for results in per_rank:
            close(results[index]["log_probs"], ref["log_probs"])
            if compute_entropy:
                close(results[index]["entropy"], ref["entropy"])
        close(sum(results[index]["grad_hidden"] for results in per_rank), ref["grad_hidden"])
        close(torch.cat([results[index]["grad_weight"] for results in per_rank]), ref["grad_weight"])
