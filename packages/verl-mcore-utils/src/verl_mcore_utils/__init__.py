"""verl_mcore_utils: megatron-core plumbing every trainer needs, across megatron-core 0.14 to 0.19.

Public API (this release): the compatibility layer (:mod:`compat`), the one DDP-config builder
(:func:`build_ddp_config` with :class:`WrapConfig`), Hugging Face config -> TransformerConfig,
GPTModel construction with the local layer spec and :class:`SDPACoreAttention` (no Transformer
Engine needed, CPU and CUDA), process-group set-up (:func:`init_parallel`, :class:`ParallelDims`),
tiny Qwen2 presets, and :func:`run_distributed` for multi-process tests on gloo or NCCL.
"""

from verl_mcore_utils.compat import ddp_config_fields, import_megatron_core, mcore_version

import_megatron_core()

from verl_mcore_utils.attention import SDPACoreAttention  # noqa: E402
from verl_mcore_utils.ddp import WrapConfig, build_ddp_config  # noqa: E402
from verl_mcore_utils.model import build_gpt_model, local_layer_spec  # noqa: E402
from verl_mcore_utils.parallel import ParallelDims, destroy_parallel, init_parallel  # noqa: E402
from verl_mcore_utils.presets import PRESETS, qwen2_preset  # noqa: E402
from verl_mcore_utils.rope import PortableRotaryEmbedding, make_rope_portable  # noqa: E402
from verl_mcore_utils.testing import run_distributed  # noqa: E402
from verl_mcore_utils.transformer_config import hf_to_transformer_config  # noqa: E402

__version__ = "0.1.0.dev0"

__all__ = [
    "PRESETS",
    "ParallelDims",
    "PortableRotaryEmbedding",
    "SDPACoreAttention",
    "WrapConfig",
    "build_ddp_config",
    "build_gpt_model",
    "ddp_config_fields",
    "destroy_parallel",
    "hf_to_transformer_config",
    "import_megatron_core",
    "init_parallel",
    "local_layer_spec",
    "make_rope_portable",
    "mcore_version",
    "qwen2_preset",
    "run_distributed",
]
