"""verl_mcore_utils: megatron-core plumbing every trainer needs, across megatron-core 0.14 to 0.19.

Public API:

* :mod:`compat`: what the installed megatron-core offers (the only place that knows versions).
* Construction: :func:`make_megatron_module` over a :class:`ModelProvider` (our
  :class:`GPTModelProvider` from a Hugging Face config, :class:`SpecProvider` for a plain layer spec,
  ``verl_mcore_utils.bridges.MBridgeProvider`` for mbridge, or your own), with the one DDP-config
  builder :func:`build_ddp_config` / :class:`WrapConfig`, value heads, :func:`unwrap_model`,
  :func:`get_model_config`, :func:`attach_training_hooks`.
* Weights: :func:`load_hf_weights`, :func:`export_hf_weights`, :func:`save_hf_weights` (TP/PP aware).
* Offload: :func:`offload_megatron_model` / :func:`onload_megatron_model` and the optimizer pair.
* No Transformer Engine needed: :class:`SDPACoreAttention`, portable RoPE, local layer spec.
* Optional extras (import the submodule): ``verl_mcore_utils.bridges`` (``[mbridge]``) and
  ``verl_mcore_utils.lora`` (``[peft]``: LoRA pre-wrap hook, Hugging Face PEFT adapters).
* Tests: :func:`run_distributed`, tiny Qwen2 presets, :mod:`hf_testing` (tiny random HF checkpoints).
"""

from verl_mcore_utils.compat import ddp_config_fields, import_megatron_core, mcore_version

import_megatron_core()

from verl_mcore_utils.attention import SDPACoreAttention  # noqa: E402
from verl_mcore_utils.ddp import WrapConfig, build_ddp_config  # noqa: E402
from verl_mcore_utils.model import build_gpt_model, local_layer_spec  # noqa: E402
from verl_mcore_utils.module import (  # noqa: E402
    GPTModelProvider,
    ModelProvider,
    SpecProvider,
    ValueHead,
    attach_training_hooks,
    get_model_config,
    make_megatron_module,
    unwrap_model,
)
from verl_mcore_utils.offload import (  # noqa: E402
    OffloadStateError,
    OffloadStats,
    offload_megatron_model,
    offload_megatron_optimizer,
    onload_megatron_model,
    onload_megatron_optimizer,
)
from verl_mcore_utils.parallel import ParallelDims, destroy_parallel, init_parallel  # noqa: E402
from verl_mcore_utils.presets import PRESETS, qwen2_preset  # noqa: E402
from verl_mcore_utils.rope import PortableRotaryEmbedding, make_rope_portable  # noqa: E402
from verl_mcore_utils.testing import run_distributed  # noqa: E402
from verl_mcore_utils.transformer_config import hf_to_transformer_config  # noqa: E402
from verl_mcore_utils.weights import export_hf_weights, load_hf_weights, save_hf_weights  # noqa: E402

__version__ = "0.1.0.dev0"

__all__ = [
    "PRESETS",
    "GPTModelProvider",
    "ModelProvider",
    "OffloadStateError",
    "OffloadStats",
    "ParallelDims",
    "PortableRotaryEmbedding",
    "SDPACoreAttention",
    "SpecProvider",
    "ValueHead",
    "WrapConfig",
    "attach_training_hooks",
    "build_ddp_config",
    "build_gpt_model",
    "ddp_config_fields",
    "destroy_parallel",
    "export_hf_weights",
    "get_model_config",
    "hf_to_transformer_config",
    "import_megatron_core",
    "init_parallel",
    "load_hf_weights",
    "local_layer_spec",
    "make_megatron_module",
    "make_rope_portable",
    "mcore_version",
    "offload_megatron_model",
    "offload_megatron_optimizer",
    "onload_megatron_model",
    "onload_megatron_optimizer",
    "qwen2_preset",
    "run_distributed",
    "save_hf_weights",
    "unwrap_model",
]
