"""The Triton vocabulary kernels' arithmetic on the CPU, through Triton's interpreter.

``TRITON_INTERPRET=1`` runs a ``@triton.jit`` kernel with numpy on CPU tensors; it must be set before Triton
is imported, so each case runs in a fresh Python process. The GPU test (test_gpu_vocab_kernels.py) checks
the compiled kernels; this one keeps the kernels' formulas (row max, sums relative to it, the gradient with
its label column, temperature, entropy on and off, a vocabulary not a multiple of the block) under CPU CI.
float32 inputs: the kernels and the torch path agree to 1e-5 relative.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")
pytestmark = pytest.mark.newest_mcore  # our kernels' arithmetic: the megatron-core release does not enter

SCRIPT = textwrap.dedent(
    """
    import torch
    from verl_engine import vocab_kernels
    from verl_engine.logprobs import _chunk_grad, _scaled_chunk
    from verl_engine.vocab_kernels import RowGrads

    g = torch.Generator().manual_seed(0)
    rows, vocab, t = 19, 4096 + 333, TEMPERATURE
    logits = 3 * torch.randn(rows, vocab, generator=g)
    m, s, e = vocab_kernels.row_statistics(logits, temperature=t, compute_entropy=ENTROPY)
    scaled = _scaled_chunk(logits, temperature=t)
    ref_m = scaled.amax(1)
    d = scaled - ref_m[:, None]
    torch.testing.assert_close(m, ref_m, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(s, d.exp().sum(1), rtol=1e-5, atol=1e-6)
    if ENTROPY:
        torch.testing.assert_close(e, (d.exp() * d).sum(1), rtol=1e-5, atol=1e-5)
    else:
        assert e is None

    lse = ref_m + d.exp().sum(1).log()
    entropy = lse - (d.exp() * scaled).sum(1) / d.exp().sum(1) if ENTROPY else None
    grad_lp = torch.randn(rows, generator=g)
    grad_h = torch.randn(rows, generator=g) if ENTROPY else None
    labels = torch.randint(0, vocab, (rows,), generator=g)
    owned = torch.ones(rows, dtype=torch.bool)
    owned[::3] = False  # labels another shard owns: no +g term here
    label_column = torch.where(owned, labels, -1)
    rows = RowGrads(lse, entropy, grad_lp, grad_h)
    out = torch.empty_like(logits)
    vocab_kernels.logits_grad(logits, out=out, rows=rows, label_column=label_column, temperature=t)
    ref = _chunk_grad(
        _scaled_chunk(logits, temperature=t), rows=rows, label_column=label_column, temperature=t
    )
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-7)
    print("ok")
    """
)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("entropy", [True, False])
def test_kernels_match_the_torch_path_in_triton_interpreter(temperature: float, entropy: bool) -> None:
    code = SCRIPT.replace("TEMPERATURE", repr(temperature)).replace("ENTROPY", repr(entropy))
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


STRIDED = textwrap.dedent(
    """
    import torch
    from verl_engine import vocab_kernels
    from verl_engine.logprobs import vocab_parallel_log_probs_and_entropy

    def grads(kernels):
        g = torch.Generator().manual_seed(0)
        logits = (3 * torch.randn(7, 4096 + 5, generator=g)).requires_grad_()
        labels = torch.randint(0, logits.shape[1], (7,), generator=g)
        weights = torch.randn(2, 7, generator=g)
        with vocab_kernels.torch_ops_only() if not kernels else torch.enable_grad():
            log_probs, entropy = vocab_parallel_log_probs_and_entropy(logits, labels, compute_entropy=True)
        # the engine's merge moves both as columns of one [T, 2] tensor: the gradients that come back to
        # the log-prob function are then views with stride 2
        both = torch.cat([log_probs[:, None], entropy[:, None]], dim=1)
        lp, ent = both.split([1, 1], dim=1)
        (weights[0] * lp.reshape(-1) + weights[1] * ent.reshape(-1)).sum().backward()
        return logits.grad

    torch.testing.assert_close(grads(True), grads(False), rtol=1e-5, atol=1e-7)
    print("ok")
    """
)


def test_gradients_that_arrive_as_strided_views() -> None:
    """The kernels read the per-row gradients by row index: a strided view (the engine's one-gather merge of
    log-probs and entropy hands back stride-2 gradients) must reach them as unit-stride rows. Before the fix
    the entropy gradient went to the kernel as a stride-2 view and every other row read the wrong value
    (GPU suite at 28e7597: PP, CP and MTP parity failures on NCCL)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-c", STRIDED], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
