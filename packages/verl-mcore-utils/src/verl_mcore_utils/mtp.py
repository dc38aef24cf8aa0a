"""megatron-core's multi-token-prediction (MTP) layers, built and stepped without GPTModel's MTP path.

Why not GPTModel's own MTP: GPTModel.forward rolls ``input_ids`` / labels by one position over the
whole local tensor to find "the next token" (0.14 to 0.16 refuse packed sequences outright; 0.17+ roll
within the static CP group only), and it scales the MTP gradient through a process-global autograd
scaler that the pipeline schedule sets (Megatron-LM PR #3959: that scale omits the CP size in every
release of our matrix). A packed batch split over a per-micro-batch (dynamic) CP group needs the next
tokens of every local token taken from the full sequence before the split, so the caller computes them
and this module only runs the layers: the block is megatron-core's ``MultiTokenPredictionBlock`` (same
parameters and names, ``mtp.layers.<i>.*``), attached to the last pipeline stage's GPTModel, which is
built without ``mtp_num_layers`` so its forward never touches it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec
from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionBlock
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from verl_mcore_utils.compat import mcore_version

__all__ = ["build_mtp_block", "build_mtp_embedding", "mtp_layer_forward", "sync_mtp_embedding"]


def build_mtp_block(
    *,
    tf_config: TransformerConfig,
    layer_spec: ModuleSpec,
    num_layers: int,
    vp_stage: int | None = None,
    device: torch.device | str = "cuda",
    pg_collection: Any = None,
) -> MultiTokenPredictionBlock:
    """megatron-core's MTP block of ``num_layers`` layers, each a copy of ``layer_spec``'s decoder layer.

    Build it on the last pipeline stage only (where the decoder's final hidden states are).
    ``tf_config`` is the model's config; the block gets a copy with ``mtp_num_layers`` set. Mixture-of-experts
    layers get what :func:`verl_mcore_utils.model.build_gpt_model` gives the decoder's: the padding-correct
    expert-bias count, and on a CPU ``device`` the portable routers and dispatchers (megatron-core's move
    router weights to CUDA) with expert-bias buffers made on the CPU. Returned on ``device``.
    With sequence parallelism the layers' own norms are :class:`~verl_mcore_utils.sp_norm.SequenceParallelNorm`
    (their weights' gradients summed over TP like the decoder's), so MTP works with SP without Transformer Engine.
    ``pg_collection``: the GPTModel's process groups (megatron-core >= 0.19; pass ``model.pg_collection``).
    Without it 0.19's block takes the TP and CP groups only, and its MoE layers, finding no expert group, hold
    every expert on every rank at EP > 1 (no dispatch over EP; the experts' gradients are then reduced over
    an expert-data-parallel group that does not hold their other shares).
    """
    from verl_mcore_utils.moe import make_moe_portable
    from verl_mcore_utils.moe_layers import add_expert_bias, cpu_expert_bias

    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1 for an MTP block, got {num_layers}")
    config = dataclasses.replace(tf_config, mtp_num_layers=num_layers)
    spec = get_gpt_mtp_block_spec(config, layer_spec, use_transformer_engine=False, vp_stage=vp_stage)
    if spec is None:
        raise ValueError(
            "megatron-core builds no MTP layers on this pipeline stage; build the MTP block on the last stage only"
        )
    if config.sequence_parallel:
        from verl_mcore_utils.sp_norm import mtp_spec_with_sequence_parallel_norms

        spec = mtp_spec_with_sequence_parallel_norms(spec)
    if torch.device(device).type == "cpu" and config.tensor_model_parallel_size > 1:
        from verl_mcore_utils.sp_portable import install_portable_sequence_parallel

        install_portable_sequence_parallel()  # megatron-core's TP gathers allocate on CUDA
    with cpu_expert_bias(config, device):
        groups = {} if pg_collection is None else {"pg_collection": pg_collection}
        block = MultiTokenPredictionBlock(config=config, spec=spec, vp_stage=vp_stage, **groups)
    add_expert_bias(block, config)
    make_moe_portable(block, device)
    _initialise(block, std=tf_config.init_method_std)
    return block.to(device)


@torch.no_grad()
def _initialise(block: MultiTokenPredictionBlock, *, std: float) -> None:
    """Fresh MTP weights that do not depend on the parallel layout.

    Most checkpoints carry no MTP tensors (a GLM-4.5 checkpoint's MTP layer is loaded over this afterwards), so
    the layers start from initialisation;
    megatron-core's own init draws from the global RNG after the decoder layers of *this* stage, so the
    result would change with the pipeline split and the TP size. Here every parameter is drawn whole from a
    generator seeded with the process's torch seed (in name order), and each TP rank keeps its slice:
    matrices normal(0, ``init_method_std``), norm weights 1, biases 0. Experts (MoE MTP layers) are drawn per
    global expert from their own generators (:func:`_init_expert`), so that EP and ETP do not change them either.
    """
    from megatron.core import parallel_state

    from verl_mcore_utils.weights.experts import expert_groups

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    experts = expert_groups()
    glu = block.config.gated_linear_unit
    seed = torch.initial_seed()
    generator = torch.Generator().manual_seed(seed)

    def draw(shape: list[int]) -> torch.Tensor:  # the shared generator, in name order
        return torch.empty(shape, dtype=torch.float32).normal_(0.0, std, generator=generator)

    for name, param in sorted(block.named_parameters()):
        if param.ndim == 1:
            param.fill_(0.0 if name.endswith("bias") else 1.0)
            continue
        if ".experts." in name:
            _init_expert(name, param, std=std, seed=seed, experts=experts, config=block.config)
            continue
        param.copy_(_whole_then_slice(param, name=name, glu=glu, rank=tp_rank, size=tp_size, draw=draw))


def _init_expert(
    name: str, param: torch.nn.Parameter, *, std: float, seed: int, experts: Any, config: Any
) -> None:
    """One expert parameter of this rank, cut from the whole tensor of its global expert(s).

    SequentialMLP (``...local_experts.<i>....``): its global expert (``experts``: this rank's
    :class:`~verl_mcore_utils.weights.experts.ExpertGroups`), split over ETP along its ``partition_dim``. Grouped
    experts (``...experts.linear_fc<n>_weight``, [local experts, ...]): row ``i`` is that global expert's whole
    matrix. Each global expert's matrix is drawn by its SequentialMLP name, so grouped and sequential experts, EP
    and ETP all start from the same weights.
    """
    import re

    from verl_mcore_utils.weights.experts import expert_index

    if expert_index(name) is not None:
        global_name = experts.global_name(name, num_experts=config.num_moe_experts)
        full = _whole_then_slice(
            param,
            name=name,
            glu=config.gated_linear_unit,
            rank=experts.tp_rank,
            size=experts.tp_size,
            draw=lambda shape: _draw(global_name, shape, std=std, seed=seed),
        )
        param.copy_(full)
        return
    grouped = re.match(r"^(.*\.experts\.)linear_fc([12])_weight$", name)
    if grouped is None:
        raise ValueError(f"MTP initialisation: unknown expert parameter {name!r}")
    local = config.num_moe_experts // experts.size
    for i in range(param.shape[0]):
        global_name = f"{grouped[1]}local_experts.{experts.rank * local + i}.linear_fc{grouped[2]}.weight"
        param[i].copy_(_draw(global_name, list(param.shape[1:]), std=std, seed=seed))


def _draw(name: str, shape: list[int], *, std: float, seed: int) -> torch.Tensor:
    """normal(0, std) of ``shape`` from a generator of its own, seeded by ``seed`` and ``name``."""
    import zlib

    generator = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (1 << 63))
    return torch.empty(shape, dtype=torch.float32).normal_(0.0, std, generator=generator)


def _whole_then_slice(
    param: torch.nn.Parameter, *, name: str, glu: bool, rank: int, size: int, draw: Any
) -> torch.Tensor:
    """``draw(shape)`` of ``param``'s whole tensor (its split dim x ``size`` when it is tensor-parallel) and this
    rank's slice of it in megatron-core's layout (a gated fc1 holds ``[gate shard; up shard]``)."""
    from verl_mcore_utils.weights.fused import tp_slice

    shape = list(param.shape)
    if not (getattr(param, "tensor_model_parallel", False) and size > 1):
        return draw(shape)
    shape[param.partition_dim] *= size  # type: ignore[attr-defined]  # megatron's dynamic parameter attribute
    gate_up = glu and name.endswith("linear_fc1.weight")
    return tp_slice(
        draw(shape),
        dim=param.partition_dim,  # type: ignore[attr-defined]  # megatron's dynamic parameter attribute
        gate_up=gate_up,
        rank=rank,
        size=size,
    )


def mtp_layer_forward(
    layer: torch.nn.Module,
    *,
    hidden_states: torch.Tensor,
    decoder_input: torch.Tensor,
    packed_seq_params: Any,
    padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """One MTP depth: norm(embedding of token t+k) ++ norm(hidden of depth k-1) -> projection -> layer -> norm.

    ``decoder_input`` is the word embedding of the token each local position must see at this depth
    (taken by the caller within its sequence); ``hidden_states`` the previous depth's output ([s, b, h]).
    megatron-core 0.14 to 0.19 all have ``_proj_and_transformer_layer`` with these keywords; its public
    ``forward`` is not used because it re-derives the next tokens by rolling the local tensor.
    ``padding_mask`` ([b, s], True at padding; megatron-core >= 0.16): an MoE MTP layer's router then
    neither balances nor counts those positions, as the decoder's routers do with GPTModel's mask. Under
    sequence parallelism ``hidden_states`` and ``decoder_input`` are this TP rank's sequence shard (as the
    decoder's output and the embedding give them) while ``padding_mask`` covers the whole sequence: it is cut
    to the rank's shard here, as GPTModel does for the decoder.
    """
    step = getattr(layer, "_proj_and_transformer_layer", None)
    if step is None:
        raise NotImplementedError(
            f"megatron-core {mcore_version()}: MultiTokenPredictionLayer has no _proj_and_transformer_layer;"
            " MTP is supported with megatron-core 0.14 to 0.19"
        )
    if padding_mask is not None and layer.config.sequence_parallel:  # type: ignore[union-attr]  # a plain attribute
        from megatron.core import parallel_state

        size = parallel_state.get_tensor_model_parallel_world_size()
        rank = parallel_state.get_tensor_model_parallel_rank()
        shard = padding_mask.shape[1] // size
        padding_mask = padding_mask[:, rank * shard : (rank + 1) * shard]
    extra = {} if padding_mask is None else {"padding_mask": padding_mask}
    return step(
        hidden_states=hidden_states,
        decoder_input=decoder_input,
        attention_mask=None,
        packed_seq_params=packed_seq_params,
        **extra,
    )


def build_mtp_embedding(gpt: Any, *, tf_config: TransformerConfig) -> torch.nn.Module:
    """A second word embedding for the MTP layers of a last stage that is not also the first stage.

    MTP depth ``k`` embeds token ``t + k``; with pipeline stages the word embedding lives on the first
    stage, so the last stage gets its own copy (megatron-core does the same for its MTP path). Keep it
    equal to the first stage's with :func:`sync_mtp_embedding` (weights once after loading, gradients
    after every backward).
    """
    from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding

    return LanguageModelEmbedding(
        config=tf_config,
        vocab_size=gpt.vocab_size,
        max_sequence_length=gpt.max_sequence_length,
        position_embedding_type="none",
    )


def _mtp_embedding_member(chunks: Any) -> torch.nn.Parameter | None:
    """This rank's member of the pair (first stage's word embedding, last stage's MTP copy), if any."""
    from verl_mcore_utils.module import unwrap_model

    for chunk in chunks:
        gpt = unwrap_model(chunk)
        copy = getattr(gpt, "mtp_embedding", None)
        if copy is not None:
            return copy.word_embeddings.weight
    for chunk in chunks:
        gpt = unwrap_model(chunk)
        if gpt.pre_process:
            return gpt.embedding.word_embeddings.weight
    return None


def sync_mtp_embedding(chunks: Any, *, grads: bool) -> None:
    """Make the last stage's MTP embedding equal to the first stage's word embedding.

    ``grads=False``: weights (the first stage's values win: the copy is zeroed, then both are summed over
    the embedding group). ``grads=True``: the two gradients are summed (``main_grad`` under megatron-core's
    DDP, else ``.grad``; a missing one counts as zero), so both copies take the same optimizer step. Call it
    on every rank when the model has MTP layers and pipeline stages (ranks outside the first and last stage
    return at once); it is a collective over megatron-core's embedding group.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not parallel_state.is_rank_in_embedding_group(ignore_virtual=True):
        return
    member = _mtp_embedding_member(chunks)
    if member is None:
        raise RuntimeError(
            "this rank is on the first or last pipeline stage but holds neither the word embedding nor the MTP"
            " embedding copy; build the model with verl_dyncp's provider (mtp_num_layers) on every stage"
        )
    group = parallel_state.get_embedding_group()
    if not grads:
        with torch.no_grad():
            if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
                member.zero_()
            dist.all_reduce(member.data, group=group)
        return
    attr = "main_grad" if hasattr(member, "main_grad") else "grad"
    grad = getattr(member, attr)
    if grad is None:
        grad = torch.zeros_like(member)
        setattr(member, attr, grad)
    dist.all_reduce(grad, group=group)
