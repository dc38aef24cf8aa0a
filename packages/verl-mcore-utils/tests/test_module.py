"""make_megatron_module on CPU (gloo): providers, hook order, mixed precision, value head, unwrapping.

DDP wrapping itself needs CUDA (megatron-core allocates its buffers there); the GPU tests in
tests/test_gpu_construction.py cover it for every path.
"""

from __future__ import annotations

import torch

from verl_mcore_utils.presets import qwen2_preset
from verl_mcore_utils.testing import run_distributed


def _checks(rank: int, world_size: int) -> dict[str, object]:
    from verl_mcore_utils.ddp import WrapConfig
    from verl_mcore_utils.model import local_layer_spec
    from verl_mcore_utils.module import (
        GPTModelProvider,
        SpecProvider,
        ValueHead,
        get_model_config,
        make_megatron_module,
        unwrap_model,
    )
    from verl_mcore_utils.parallel import init_parallel
    from verl_mcore_utils.transformer_config import hf_to_transformer_config

    init_parallel(device="cpu")
    hf = qwen2_preset("tiny", vocab_size=128)
    out: dict[str, object] = {}
    no_ddp = WrapConfig(wrap_with_ddp=False)
    tokens = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(8).expand(2, 8)

    fp32 = hf_to_transformer_config(hf, dtype="float32")
    seen: list[str] = []

    def hook(chunks: list[torch.nn.Module]) -> None:
        seen.extend(type(c).__name__ for c in chunks)
        for c in chunks:
            c.embedding.word_embeddings.weight.requires_grad_(False)

    chunks = make_megatron_module(
        GPTModelProvider(hf_config=hf, transformer_config=fp32, device="cpu"),
        wrap_config=no_ddp,
        pre_wrap_hooks=[hook],
    )
    out["fp32_types"] = [type(c).__name__ for c in chunks]
    out["hook_saw"] = seen
    out["hook_effect"] = chunks[0].embedding.word_embeddings.weight.requires_grad
    out["logits_shape"] = tuple(chunks[0](input_ids=tokens, position_ids=pos, attention_mask=None).shape)

    bf16 = hf_to_transformer_config(hf, dtype="bfloat16")
    wrapped = make_megatron_module(
        GPTModelProvider(hf_config=hf, transformer_config=bf16, device="cpu"), wrap_config=no_ddp
    )
    out["bf16_types"] = [type(c).__name__ for c in wrapped]
    out["unwrapped"] = type(unwrap_model(wrapped[0])).__name__
    out["config_is_same"] = get_model_config(wrapped) is bf16

    value = make_megatron_module(
        GPTModelProvider(hf_config=hf, transformer_config=fp32, device="cpu"),
        wrap_config=WrapConfig(wrap_with_ddp=False, is_value_model=True),
    )
    out["value_head"] = isinstance(value[0].output_layer, ValueHead)
    out["value_shape"] = tuple(value[0](input_ids=tokens, position_ids=pos, attention_mask=None).shape)
    try:
        tied = {**hf, "tie_word_embeddings": True}
        make_megatron_module(
            GPTModelProvider(hf_config=tied, transformer_config=fp32, device="cpu"),
            wrap_config=WrapConfig(wrap_with_ddp=False, is_value_model=True),
        )
    except ValueError as err:
        out["tied_value_error"] = str(err)

    # the three construction paths give the same model: provider + our loader, mbridge, plain spec
    from verl_mcore_utils.bridges import MBridgeProvider
    from verl_mcore_utils.hf_testing import save_tiny_hf_model
    from verl_mcore_utils.weights import load_hf_weights

    ckpt = save_tiny_hf_model("qwen2", f"/tmp/verl_test_module_{rank}")
    import transformers

    hf_cfg = transformers.AutoConfig.from_pretrained(ckpt)
    ours = make_megatron_module(
        GPTModelProvider(
            hf_config=hf_cfg,
            transformer_config=hf_to_transformer_config(hf_cfg, dtype="float32"),
            device="cpu",
        ),
        wrap_config=no_ddp,
    )
    load_hf_weights(ours, ckpt, hf_config=hf_cfg)
    via_mbridge = make_megatron_module(
        MBridgeProvider(ckpt, device="cpu", dtype="float32"), wrap_config=no_ddp
    )
    a = ours[0](input_ids=tokens, position_ids=pos, attention_mask=None)
    b = via_mbridge[0](input_ids=tokens, position_ids=pos, attention_mask=None)
    out["provider_vs_mbridge_max_abs"] = float((a - b).abs().max())

    plain = make_megatron_module(
        SpecProvider(
            transformer_config=fp32,
            layer_spec=local_layer_spec(fp32),
            vocab_size=64,
            max_sequence_length=32,
            device="cpu",
        ),
        wrap_config=no_ddp,
    )
    out["plain_vocab"] = plain[0].output_layer.weight.shape[0]
    try:
        make_megatron_module(object(), wrap_config=no_ddp)  # type: ignore[arg-type]
    except TypeError as err:
        out["not_a_provider"] = str(err)
    try:
        make_megatron_module(
            GPTModelProvider(hf_config=hf, transformer_config=fp32, device="cpu"),
            wrap_config=WrapConfig(use_megatron_fsdp=True),
        )
    except NotImplementedError as err:
        out["fsdp_error"] = str(err)
    return out


def test_make_megatron_module_without_ddp_on_cpu() -> None:
    out = run_distributed(_checks, world_size=1, backend="gloo", timeout_s=240)[0]
    assert out["fp32_types"] == ["GPTModel"]
    assert out["hook_saw"] == ["GPTModel"]  # hooks run before any wrapper
    assert out["hook_effect"] is False
    assert out["logits_shape"] == (2, 8, 128)
    assert out["bf16_types"] == ["Float16Module"] and out["unwrapped"] == "GPTModel" and out["config_is_same"]
    assert out["value_head"] and out["value_shape"] == (2, 8, 1)
    assert "cannot share its output layer" in out["tied_value_error"]
    assert out["plain_vocab"] == 64
    assert out["provider_vs_mbridge_max_abs"] == 0.0  # same spec, same weights, same kernels
    assert "is not a model provider" in out["not_a_provider"]
    assert "verl-mfsdp" in out["fsdp_error"]


def test_mbridge_path_ddp_defaults_never_decide_the_optimizer() -> None:
    """mbridge's own default use_distributed_optimizer=True must not survive (verl PR #5775)."""
    from verl_mcore_utils.bridges import MBridgeProvider
    from verl_mcore_utils.ddp import WrapConfig, build_ddp_config

    assert "use_distributed_optimizer" not in MBridgeProvider.ddp_defaults
    for value in (True, False):
        ddp = build_ddp_config(
            wrap_config=WrapConfig(use_distributed_optimizer=value),
            path_defaults=MBridgeProvider.ddp_defaults,
        )
        assert ddp.use_distributed_optimizer is value and ddp.grad_reduce_in_fp32 is True
    ddp = build_ddp_config(
        wrap_config=WrapConfig(use_distributed_optimizer=False),
        path_defaults=MBridgeProvider.ddp_defaults,
        override_ddp_config={"use_distributed_optimizer": True, "grad_reduce_in_fp32": False},
    )
    assert (
        ddp.use_distributed_optimizer is True and ddp.grad_reduce_in_fp32 is False
    )  # explicit override wins


def test_provider_protocol_is_structural() -> None:
    from verl_mcore_utils.module import GPTModelProvider, ModelProvider

    assert isinstance(GPTModelProvider(hf_config={}, transformer_config=None), ModelProvider)  # type: ignore[arg-type]
    assert not isinstance(object(), ModelProvider)
