"""The LoRA block: one canonical spelling, the legacy flat keys mapped into it, module names per engine.

The ``lora`` block is canonical, with one alpha default (32) for both engines; the flat keys move into it
with a warning. :func:`translate_target_modules` turns Hugging Face or megatron-core module names into the
engine's (megatron fuses q/k/v and gate/up). Why alpha is 32: the package README, section LoRA.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from verl_config.errors import ConfigValueError
from verl_config.validation import check_choice, check_positive, check_unit_interval

__all__ = [
    "DEFAULT_LORA_ALPHA",
    "HF_LINEAR_MODULES",
    "HF_TO_MCORE",
    "LEGACY_FLAT_LORA_ALPHA",
    "MCORE_LINEAR_MODULES",
    "LoraConfig",
    "translate_target_modules",
]

DEFAULT_LORA_ALPHA = 32
LEGACY_FLAT_LORA_ALPHA = 16  # verl's old implicit default for the flat ``lora_alpha`` key

MCORE_LINEAR_MODULES: tuple[str, ...] = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
HF_TO_MCORE: dict[str, str] = {
    "q_proj": "linear_qkv",
    "k_proj": "linear_qkv",
    "v_proj": "linear_qkv",
    "o_proj": "linear_proj",
    "gate_proj": "linear_fc1",
    "up_proj": "linear_fc1",
    "down_proj": "linear_fc2",
}
HF_LINEAR_MODULES: tuple[str, ...] = tuple(HF_TO_MCORE)
_MCORE_TO_HF: dict[str, tuple[str, ...]] = {
    m: tuple(h for h, mm in HF_TO_MCORE.items() if mm == m) for m in MCORE_LINEAR_MODULES
}
ALL_LINEAR = "all-linear"


def translate_target_modules(
    modules: Iterable[str], *, engine: str, key: str = "target_modules"
) -> list[str]:
    """Return ``modules`` (Hugging Face or megatron-core names, or ``all-linear``) in ``engine``'s names.

    megatron: the four megatron-core linear names; a fused group must be named completely
    (q_proj, k_proj and v_proj together; gate_proj and up_proj together); unknown names are an
    error, since only these projections have LoRA support on megatron-core.
    fsdp: Hugging Face names; megatron-core names expand to their projections; other names pass
    through unchanged (custom Hugging Face modules are legitimate peft targets).
    """
    names = list(modules)
    out: list[str] = []

    def add(name: str) -> None:
        if name not in out:
            out.append(name)

    if engine == "megatron":
        hf_seen: set[str] = set()
        for name in names:
            if name == ALL_LINEAR:
                for m in MCORE_LINEAR_MODULES:
                    add(m)
            elif name in MCORE_LINEAR_MODULES:
                add(name)
            elif name in HF_TO_MCORE:
                hf_seen.add(name)
            else:
                raise ConfigValueError(
                    key,
                    f"{name!r} is not a linear layer that LoRA supports on the megatron engine; use megatron-core names"
                    f" {list(MCORE_LINEAR_MODULES)}, Hugging Face names {list(HF_LINEAR_MODULES)} or 'all-linear'",
                )
        for fused, parts in _MCORE_TO_HF.items():
            given = [p for p in parts if p in hf_seen]
            if given and len(given) != len(parts):
                missing = [p for p in parts if p not in hf_seen]
                raise ConfigValueError(
                    key,
                    f"{given} without {missing}: megatron-core fuses {list(parts)} into {fused!r}, so LoRA can only"
                    f" target them together; list all of {list(parts)} or write {fused!r}",
                )
            if given:
                add(fused)
        return [m for m in MCORE_LINEAR_MODULES if m in out]
    if engine == "fsdp":
        for name in names:
            if name in _MCORE_TO_HF:
                for h in _MCORE_TO_HF[name]:
                    add(h)
            else:
                add(name)
        if ALL_LINEAR in out:
            return [ALL_LINEAR]
        return out
    raise ConfigValueError("model_engine", f"must be 'fsdp' or 'megatron'; got {engine!r}")


@dataclass
class LoraConfig:
    """LoRA adapters (canonical spelling). ``rank: 0`` means LoRA is off.

    ``alpha`` defaults to 32 for both engines (module docstring says why); the effective scale is
    alpha / rank. ``target_modules`` / ``exclude_modules`` may be written with Hugging Face or
    megatron-core names; after loading they hold the selected engine's names.
    """

    type: str = "lora"
    merge: bool = False
    rank: int = 0
    alpha: float = DEFAULT_LORA_ALPHA
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: list(MCORE_LINEAR_MODULES))
    exclude_modules: list[str] = field(default_factory=list)
    dropout_position: str = "pre"
    lora_A_init_method: str = "xavier"
    lora_B_init_method: str = "zero"
    a2a_experimental: bool = False
    dtype: str | None = None
    adapter_path: str | None = None
    freeze_vision_model: bool = True
    freeze_vision_projection: bool = True
    freeze_language_model: bool = True
    # vLLM's fully sharded LoRA kernels for the rollout; verl reads it with .get() (its yaml lacks it, scripts
    # add it with '+')
    fully_sharded_loras: bool = False

    def __post_init__(self) -> None:
        check_choice("type", self.type, ("lora", "canonical_lora", "dora"))
        check_positive("rank", self.rank, allow_zero=True)
        if self.rank > 0:  # alpha only scales adapters that exist; with LoRA off any value is accepted
            check_positive("alpha", self.alpha)
        check_unit_interval("dropout", self.dropout, open_high=True)
        check_choice("dropout_position", self.dropout_position, ("pre", "post"))
        check_choice("lora_A_init_method", self.lora_A_init_method, ("xavier", "normal", "kaiming", "zero"))
        check_choice("lora_B_init_method", self.lora_B_init_method, ("zero", "normal", "xavier", "kaiming"))
        if self.dtype is not None:
            check_choice("dtype", self.dtype, ("float32", "bfloat16", "float16"))
        if self.rank > 0 and not self.target_modules:
            raise ConfigValueError(
                "target_modules", "is empty but rank > 0; name the layers to adapt or 'all-linear'"
            )
        if self.adapter_path is not None and self.rank == 0:
            raise ConfigValueError(
                "adapter_path",
                f"is set ({self.adapter_path!r}) but rank is 0 (LoRA off); set lora.rank to the adapter's rank",
            )

    @property
    def enabled(self) -> bool:
        """True when adapters are inserted (rank > 0)."""
        return self.rank > 0


def flat_target_modules(value: str | Sequence[str]) -> list[str]:
    """The legacy flat ``target_modules`` is a string (``all-linear``) or a list."""
    return [value] if isinstance(value, str) else list(value)
