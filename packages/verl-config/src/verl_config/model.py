"""Model sections: ``actor_rollout_ref.model`` (with MTP) and ``critic.model`` (the same keys, both engines).

``lora`` is the canonical LoRA spelling on every model section (verl's dataclasses carry it on
both engines). The flat keys ``lora_rank`` / ``lora_alpha`` / ``target_modules`` /
``exclude_modules`` exist where verl's generated configs have them, with verl's defaults (0, 16,
``all-linear``, null). A value the user gave (the loader tracks the keys written in the YAML and the
overrides, see :func:`verl_config.explicit_keys_of`) is moved into ``lora`` with a warning when the config
is loaded (:mod:`verl_config.compose`), and the flat key goes back to its default, so there is one source of
truth for the adapter.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from verl_config.errors import ConfigValueError
from verl_config.lora import LoraConfig
from verl_config.validation import check_choice, check_positive, check_positive_keys

__all__ = [
    "BaseModelConfig",
    "CriticModelConfig",
    "ModelConfig",
    "MtpConfig",
    "TiledMLPConfig",
]


@dataclass
class MtpConfig:
    """Multi-token prediction (``actor_rollout_ref.model.mtp``): train the MTP heads, use them as drafts.

    ``enable`` says the model's MTP layers are built; ``enable_train`` adds their loss (scaled by
    ``mtp_loss_scaling_factor``) to the policy loss; ``enable_rollout`` uses them for speculative
    decoding. Training or rollout use without ``enable`` would silently do nothing, so it is an error.
    """

    enable: bool = False
    enable_train: bool = False
    enable_rollout: bool = False
    detach_encoder: bool = False
    mtp_loss_scaling_factor: float = 0.1
    speculative_algorithm: str = "EAGLE"
    speculative_num_steps: int = 3
    speculative_eagle_topk: int = 1
    speculative_num_draft_tokens: int = 4
    method: str = "mtp"
    num_speculative_tokens: int = 1

    def __post_init__(self) -> None:
        for key in ("enable_train", "enable_rollout"):
            if getattr(self, key) is True and self.enable is False:
                raise ConfigValueError(
                    key,
                    "is true but enable is false; the MTP layers are only built with enable=true: set"
                    " mtp.enable=true (the model must have MTP layers) or set the flag to false",
                )
        check_positive("mtp_loss_scaling_factor", self.mtp_loss_scaling_factor, allow_zero=True)
        check_positive_keys(
            self,
            "speculative_num_steps",
            "speculative_eagle_topk",
            "speculative_num_draft_tokens",
            "num_speculative_tokens",
        )


@dataclass
class TiledMLPConfig:
    """Memory-efficient tiled MLP of the FSDP engine (``model.tiled_mlp``)."""

    enabled: bool = False
    num_shards: int = 4

    def __post_init__(self) -> None:
        check_positive("num_shards", self.num_shards)


@dataclass
class BaseModelConfig:
    """Keys every model section has: where the model is and how to load it."""

    path: str = "~/models/deepseek-llm-7b-chat"
    tokenizer_path: str | None = None
    override_config: dict[str, Any] = field(default_factory=dict)
    external_lib: str | None = None
    trust_remote_code: bool = False
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class ModelConfig(BaseModelConfig):
    """The Hugging Face model of actor / rollout / ref (``actor_rollout_ref.model``)."""

    hf_config_path: str | None = None
    use_shm: bool = False
    custom_chat_template: str | None = None
    enable_gradient_checkpointing: bool = True
    enable_activation_offload: bool = False
    use_remove_padding: bool = True
    lora_rank: int | None = 0
    lora_alpha: float | None = 16
    target_modules: Any = "all-linear"
    exclude_modules: Any = None
    lora_adapter_path: str | None = None
    use_liger: bool = False
    use_fused_kernels: bool = False
    fused_kernel_options: dict[str, Any] = field(default_factory=lambda: {"impl_backend": "torch"})
    tiled_mlp: TiledMLPConfig = field(default_factory=TiledMLPConfig)
    mtp: MtpConfig = field(default_factory=MtpConfig)

    def __post_init__(self) -> None:
        impl = (
            self.fused_kernel_options.get("impl_backend")
            if isinstance(self.fused_kernel_options, dict)
            else None
        )
        if impl is not None:
            check_choice("fused_kernel_options.impl_backend", impl, ("torch", "triton"))


@dataclass
class CriticModelConfig(ModelConfig):
    """The critic's model (``critic.model``, both engines): a full model section with verl's own defaults.

    As in verl, it does not follow the actor's model: ``path`` is verl's placeholder, so a config that uses the
    critic must set ``critic.model.path`` (:func:`verl_config.compose.load_config` refuses it otherwise), e.g.
    ``critic.model.path=${actor_rollout_ref.model.path}`` for a critic started from the actor's model."""
