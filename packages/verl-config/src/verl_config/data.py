"""The ``data`` section: the prompt dataset and the step's batch size."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from verl_config.notes import adjusting, note
from verl_config.validation import check_choice, check_positive, check_positive_keys

__all__ = ["DataConfig"]


@dataclass
class DataConfig:
    """Prompt dataset and batch size (``train_batch_size`` prompts per step, before rollout.n)."""

    tokenizer: str | None = None
    use_shm: bool = False
    train_files: Any = "~/data/rlhf/gsm8k/train.parquet"
    val_files: Any = "~/data/rlhf/gsm8k/test.parquet"
    train_max_samples: int = -1
    val_max_samples: int = -1
    prompt_key: str = "prompt"
    reward_fn_key: str = "data_source"
    max_prompt_length: int = 512
    max_response_length: int = 512
    train_batch_size: int = 1024
    gen_batch_size: int | None = None
    val_batch_size: int | None = None
    tool_config_path: str | None = "${actor_rollout_ref.rollout.multi_turn.tool_config_path}"
    function_tool_path: str | None = "${actor_rollout_ref.rollout.multi_turn.function_tool_path}"
    return_raw_input_ids: bool = False
    return_raw_chat: bool = True
    return_full_prompt: bool = False
    shuffle: bool = True
    seed: int | None = None
    dataloader_num_workers: int = 8
    image_patch_size: int = 14
    validation_shuffle: bool = False
    filter_overlong_prompts: bool = False
    filter_overlong_prompts_workers: int = 1
    truncation: str = "error"
    image_key: str = "images"
    video_key: str = "videos"
    audio_key: str = "audios"
    trust_remote_code: bool = False
    custom_cls: dict[str, Any] = field(default_factory=lambda: {"path": None, "name": None})
    return_multi_modal_inputs: bool = True
    apply_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    mm_processor_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_positive_keys(
            self,
            "max_prompt_length",
            "max_response_length",
            "train_batch_size",
            "filter_overlong_prompts_workers",
            "image_patch_size",
        )
        check_positive("dataloader_num_workers", self.dataloader_num_workers, allow_zero=True)
        if self.gen_batch_size is not None:
            check_positive("gen_batch_size", self.gen_batch_size)
        if self.val_batch_size is not None:
            check_positive("val_batch_size", self.val_batch_size)
            if adjusting():
                note(
                    "val_batch_size",
                    "is deprecated in verl (validation sets go to the rollout engine as one batch)",
                )
        check_choice("truncation", self.truncation, ("error", "left", "right", "middle"))
