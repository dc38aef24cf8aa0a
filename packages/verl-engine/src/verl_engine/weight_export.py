"""The engine's weights under Hugging Face names: for a rollout engine (buckets, verl's per-tensor generator)
and as a Hugging Face or PEFT directory. Every method is a collective over TP and PP."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

__all__ = ["WeightExport"]


class WeightExport:
    """Mixin of :class:`~verl_engine.engine.RLEngine`: weight export (reads ``chunks``, ``hf_config``, ``lora``)."""

    chunks: list[torch.nn.Module]
    hf_config: Mapping[str, Any] | None
    lora: Any
    value_model: bool
    _tokenizer_path: str | None

    if TYPE_CHECKING:  # a property of RLEngine

        @property
        def megatron_fsdp(self) -> bool: ...

    def export_weight_buckets(
        self, *, bucket_bytes: int = 1 << 29, lora_mode: str | None = None
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The model's weights under Hugging Face names, gathered over TP and PP, in buckets of at most
        ``bucket_bytes`` (a bigger tensor alone): what a rollout engine (vLLM / SGLang) loads.

        With LoRA, ``lora_mode`` (default from ``lora.merge``): ``"merged"`` = the full weights with
        ``W + alpha / r * B @ A`` for the adapted projections (computed on the exported copies: the model is
        not changed), ``"adapter"`` = only the adapter tensors, under PEFT's names
        (``base_model.model.model.layers.<i>...lora_A.weight``), for a rollout engine that serves the base
        model plus a LoRA adapter (see :meth:`peft_config`).

        Tensors are copies owned by each bucket; the extra memory is one bucket plus the tensor being
        gathered. A collective: every rank iterates to the end, in step (each gets every bucket). MTP layers
        are not included (the supported architectures have no Hugging Face names for them).
        """
        from verl_mcore_utils.weights import bucket_tensors

        self._check_exportable()
        mode = self._lora_mode(lora_mode)
        pairs = self._hf_weight_pairs(mode)
        # verl-mfsdp's gathered tensors are fresh copies: the bucket takes them as they are
        yield from bucket_tensors(pairs, bucket_bytes=bucket_bytes, owned=self.megatron_fsdp and mode is None)

    def _hf_weight_pairs(self, mode: str | None) -> Iterable[tuple[str, torch.Tensor]]:
        """The one place that picks the weight source: (HF name, tensor) pairs of ``mode`` (None: no LoRA)."""
        if mode == "adapter":
            from verl_mcore_utils.lora import export_hf_adapter

            return export_hf_adapter(self.chunks, hf_config=self.hf_config).items()
        if mode == "merged":
            from verl_mcore_utils.lora import export_merged_hf_weights

            return export_merged_hf_weights(self.chunks, hf_config=self.hf_config)
        if self.megatron_fsdp:
            from verl_mfsdp.export import export_megatron_fsdp_hf_weights

            return export_megatron_fsdp_hf_weights(self.chunks, hf_config=self.hf_config)
        from verl_mcore_utils.weights import export_hf_weights

        return export_hf_weights(self.chunks, hf_config=self.hf_config)

    def get_per_tensor_param(
        self, *, bucket_bytes: int = 1 << 29, lora_mode: str | None = None
    ) -> tuple[Iterator[tuple[str, torch.Tensor]], dict[str, Any] | None]:
        """verl's shape: ``((hf_name, tensor) generator, peft_config)``; the PEFT config (a dict) only when
        the adapter alone is sent (``lora_mode="adapter"``, or ``lora.merge=false``), else None."""
        mode = self._lora_mode(lora_mode)
        config = self.peft_config() if mode == "adapter" else None

        def pairs() -> Iterator[tuple[str, torch.Tensor]]:
            for bucket in self.export_weight_buckets(bucket_bytes=bucket_bytes, lora_mode=mode):
                yield from bucket

        return pairs(), config

    def peft_config(self) -> dict[str, Any]:
        """The adapter's PEFT ``adapter_config.json`` content (HF module names); a collective over TP and PP."""
        from verl_mcore_utils.lora import export_hf_adapter_with_config

        if self.lora is None:
            raise ValueError("this engine has no LoRA adapters (model.lora.rank is 0)")
        return export_hf_adapter_with_config(
            self.chunks, hf_config=self.hf_config, base_model_name_or_path=self._tokenizer_path
        )[1]

    def save_hf(self, path: str, *, merged: bool = False) -> Any:
        """A Hugging Face directory of the model (every rank calls; global rank 0 writes).

        Without LoRA: ``config.json`` + safetensors that ``transformers`` loads. With LoRA: a PEFT adapter
        directory (``adapter_config.json`` + ``adapter_model.safetensors``) that
        ``peft.PeftModel.from_pretrained(base, path)`` loads, or, with ``merged=True``, the full model with the
        adapter merged in.
        """
        from verl_mcore_utils.weights import save_hf_weights

        self._check_exportable()
        if self.lora is not None and not merged:
            from verl_mcore_utils.lora import save_hf_adapter

            return save_hf_adapter(
                self.chunks,
                path,
                hf_config=self.hf_config,
                lora=self.lora,
                base_model_name_or_path=self._tokenizer_path,
            )
        # megatron's own export path when it applies (save_hf_weights streams it); else the merged / FSDP pairs
        plain = self.lora is None and not self.megatron_fsdp
        weights = None if plain else self._hf_weight_pairs("merged" if self.lora is not None else None)
        return save_hf_weights(self.chunks, path, hf_config=self.hf_config, weights=weights)

    def _check_exportable(self) -> None:
        if self.value_model:
            raise ValueError(
                "a value model (critic) has no language-model weights to send to a rollout engine or save as one"
            )
        if self.hf_config is None:
            raise ValueError(
                "this engine was built without a Hugging Face config; it cannot name its weights"
            )

    def _lora_mode(self, lora_mode: str | None) -> str | None:
        if self.lora is None:
            if lora_mode is not None:
                raise ValueError(
                    f"lora_mode={lora_mode!r} but this engine has no LoRA adapters (model.lora.rank is 0)"
                )
            return None
        if lora_mode is None:
            return "merged" if self.lora.merge else "adapter"
        if lora_mode not in ("merged", "adapter"):
            raise ValueError(
                f"lora_mode must be 'merged' or 'adapter' (or None: from lora.merge); got {lora_mode!r}"
            )
        return lora_mode
