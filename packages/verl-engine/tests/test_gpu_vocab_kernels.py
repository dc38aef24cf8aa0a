"""GPU: the Triton vocabulary kernels give the torch path's log-probs, entropy and gradients.

Run on a GPU host with ``python -m pytest -m gpu packages/verl-engine/tests/test_gpu_vocab_kernels.py``.
Both paths compute in float32 from the same bf16 logits; only summation order (and the exp
implementation) differ, so statistics agree to float32 rounding (rtol 1e-5) and the bf16 gradients to one
bf16 rounding step (rtol 2^-7): each path rounds its float32 result once. Cases: temperature 1 and 0.7,
ignored labels (-100), a vocabulary shard that owns only some labels (as on a TP rank), a vocabulary that
is not a multiple of the kernel's block, entropy on and off, gradients through the log-prob, the entropy
or both (also arriving as strided views, as from the engine's merge), the stored-logits path and the
fused LM head.
"""

from __future__ import annotations

import pytest
import torch

from verl_engine.fused_head import fused_lm_head_log_probs
from verl_engine.logprobs import vocab_parallel_log_probs_and_entropy
from verl_engine.vocab_kernels import kernels_apply, torch_ops_only

pytestmark = pytest.mark.gpu


def _labels(n: int, vocab: int, g: torch.Generator) -> torch.Tensor:
    labels = torch.randint(0, vocab, (n,), device="cuda", generator=g)
    labels[::7] = -100  # ignored
    return labels


def _run(fn, *, grads: str):
    outs = fn()
    log_probs, entropy = outs
    # "merged": as the engine's merge, both as columns of one tensor, gradients back as stride-2 views
    if grads == "merged":
        lp, ent = torch.cat([log_probs[:, None], entropy[:, None]], dim=1).split([1, 1], dim=1)
        log_probs, entropy, grads = lp.reshape(-1), ent.reshape(-1), "both"
    loss = torch.zeros((), device="cuda")
    if grads in ("log_prob", "both"):
        loss = loss + (log_probs * torch.linspace(-1, 1, log_probs.numel(), device="cuda")).sum()
    if grads in ("entropy", "both") and entropy is not None:
        loss = loss + (entropy * torch.linspace(1, 2, entropy.numel(), device="cuda")).sum()
    loss.backward()
    return log_probs.detach(), None if entropy is None else entropy.detach()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize(
    "compute_entropy,grads", [(True, "both"), (True, "entropy"), (True, "merged"), (False, "log_prob")]
)
def test_stored_logits_path_matches_torch_ops(temperature: float, compute_entropy: bool, grads: str) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    tokens, vocab = 300, 10_007  # not a multiple of the block
    base = (3 * torch.randn(tokens, vocab, device="cuda", generator=g)).bfloat16()
    labels = _labels(tokens, vocab, g)
    assert kernels_apply(base)
    results = {}
    for name in ("kernel", "torch"):
        logits = base.clone().requires_grad_()

        def fn(logits=logits):
            return vocab_parallel_log_probs_and_entropy(
                logits, labels, temperature=temperature, compute_entropy=compute_entropy, chunk_size=128
            )

        if name == "torch":
            with torch_ops_only():
                lp, ent = _run(fn, grads=grads)
        else:
            lp, ent = _run(fn, grads=grads)
        results[name] = (lp, ent, logits.grad)
    (lp_k, ent_k, grad_k), (lp_t, ent_t, grad_t) = results["kernel"], results["torch"]
    torch.testing.assert_close(lp_k, lp_t, rtol=1e-5, atol=1e-5)
    if compute_entropy:
        torch.testing.assert_close(ent_k, ent_t, rtol=1e-5, atol=1e-5)
    assert grad_k.dtype == torch.bfloat16
    torch.testing.assert_close(grad_k.float(), grad_t.float(), rtol=2**-7, atol=1e-7)


def test_fused_head_matches_torch_ops() -> None:
    g = torch.Generator(device="cuda").manual_seed(1)
    tokens, hidden, vocab = 512, 256, 32_000
    h0 = torch.randn(tokens, hidden, device="cuda", generator=g).bfloat16()
    w0 = (0.05 * torch.randn(vocab, hidden, device="cuda", generator=g)).bfloat16()
    labels = _labels(tokens, vocab, g)
    results = {}
    for name in ("kernel", "torch"):
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()

        def fn(h=h, w=w):
            return fused_lm_head_log_probs(h, w, labels, temperature=0.9, chunk_size=200)

        if name == "torch":
            with torch_ops_only():
                lp, ent = _run(fn, grads="both")
        else:
            lp, ent = _run(fn, grads="both")
        results[name] = (lp, ent, h.grad, w.grad)
    k, t = results["kernel"], results["torch"]
    torch.testing.assert_close(k[0], t[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k[1], t[1], rtol=1e-5, atol=1e-5)
    # grad_hidden / grad_weight are matmuls of the bf16 logits gradients: a one-ulp difference in some
    # of them moves a sum of ~V (resp. ~T) terms by far less than 1% of its norm
    for a, b in ((k[2], t[2]), (k[3], t[3])):
        assert float((a.float() - b.float()).norm() / b.float().norm()) < 1e-2


def test_a_shard_that_owns_some_labels() -> None:
    """As on TP rank 1 of 2: labels in [V_local, 2 V_local) are this shard's; the kernel's label column
    is -1 for the rest. Compared through the public function by giving it this shard's global labels
    shifted into a one-shard vocabulary on the torch path is not possible, so the two internal passes are
    compared directly."""
    from verl_engine.logprobs import LogitChunks, _LabelIndex, _shard_statistics

    g = torch.Generator(device="cuda").manual_seed(2)
    tokens, vocab_local = 200, 5000
    logits = torch.randn(tokens, vocab_local, device="cuda", generator=g).bfloat16()
    labels = torch.randint(0, 2 * vocab_local, (tokens,), device="cuda", generator=g)
    index = _LabelIndex(labels, rank=1, tp_size=2, vocab_local=vocab_local)
    chunks = LogitChunks(
        chunk=lambda s, e: logits[s:e], vocab_local=vocab_local, labels=labels, source=logits
    )
    kwargs = dict(temperature=1.3, compute_entropy=True, chunk_size=64)
    got = _shard_statistics(chunks, index, **kwargs)
    with torch_ops_only():
        ref = _shard_statistics(chunks, index, **kwargs)
    for key in ref:
        torch.testing.assert_close(got[key], ref[key], rtol=1e-5, atol=1e-5)
    assert bool((got["label"][~index.owned] == 0).all())


def test_gradient_of_a_shard_that_owns_some_labels() -> None:
    """Labels valid but owned by the other rank get no ``+g`` at any column of this shard."""
    from types import SimpleNamespace

    from verl_engine.logprobs import LogitChunks, chunked_backward

    g = torch.Generator(device="cuda").manual_seed(3)
    tokens, vocab_local = 150, 3000
    logits = torch.randn(tokens, vocab_local, device="cuda", generator=g).bfloat16()
    labels = torch.randint(0, 2 * vocab_local, (tokens,), device="cuda", generator=g)
    lse = torch.logsumexp(logits.float() / 0.8, dim=1) + 0.1  # as if the other shard added mass
    entropy = torch.rand(tokens, device="cuda", generator=g) + 1.0
    grads = (torch.randn(tokens, device="cuda", generator=g), torch.randn(tokens, device="cuda", generator=g))
    ctx = SimpleNamespace(compute_entropy=True, rank=1, tp_size=2, chunk_size=64, temperature=0.8)

    def run() -> torch.Tensor:
        out = torch.empty_like(logits)
        chunks = LogitChunks(
            chunk=lambda s, e: logits[s:e], vocab_local=vocab_local, labels=labels, source=logits
        )
        for s, e, chunk in chunked_backward(ctx, chunks, saved=(lse, entropy), grad_outputs=grads):
            out[s:e] = chunk
        return out

    got = run()
    with torch_ops_only():
        ref = run()
    torch.testing.assert_close(got.float(), ref.float(), rtol=2**-7, atol=1e-7)
