"""verl_mcore_utils: megatron-core plumbing every trainer needs, across megatron-core 0.14 to 0.19.

:mod:`compat` is the only module that knows megatron-core versions; model construction, weights, LoRA
(``verl_mcore_utils.lora``, extra ``[peft]``), offload, optimizer kernels and test helpers are listed in the
package README. Submodules load on first use (below).
"""

from importlib import metadata as _metadata
from typing import TYPE_CHECKING

# Only the version helpers load eagerly. The rest is imported on first use (PEP 562), so that
# ``import verl_mcore_utils.testing`` (the spawned-rank runner) or the compat helpers do not pull in
# megatron-core (10-25 s per process on a small CPU machine). prepare_megatron_import() checks the installed
# release and sets the environment megatron-core 0.15 needs on a GPU-less machine; Python runs this file
# before any submodule, so the submodules import megatron-core at their top.
from verl_mcore_utils.compat import (
    ddp_config_fields,
    import_megatron_core,
    mcore_version,
    prepare_megatron_import,
)
from verl_mcore_utils.lazy import lazy_attributes

prepare_megatron_import()

if TYPE_CHECKING:  # the lazy names, re-exported explicitly (`X as X`) for type checkers and IDEs
    from verl_mcore_utils.attention import SDPACoreAttention as SDPACoreAttention
    from verl_mcore_utils.ddp import WrapConfig as WrapConfig
    from verl_mcore_utils.ddp import build_ddp_config as build_ddp_config
    from verl_mcore_utils.ddp import describe_ddp_config as describe_ddp_config
    from verl_mcore_utils.ddp_graph_hooks import ddp_hook_is_on_parameter as ddp_hook_is_on_parameter
    from verl_mcore_utils.ddp_graph_hooks import ddp_hooks_on_parameters as ddp_hooks_on_parameters
    from verl_mcore_utils.ddp_graph_hooks import run_ddp_hook as run_ddp_hook
    from verl_mcore_utils.fused_adam import use_fused_torch_adam as use_fused_torch_adam
    from verl_mcore_utils.model import build_gpt_model as build_gpt_model
    from verl_mcore_utils.model import local_layer_spec as local_layer_spec
    from verl_mcore_utils.module import GPTModelProvider as GPTModelProvider
    from verl_mcore_utils.module import ModelProvider as ModelProvider
    from verl_mcore_utils.module import SpecProvider as SpecProvider
    from verl_mcore_utils.module import ValueHead as ValueHead
    from verl_mcore_utils.module import attach_training_hooks as attach_training_hooks
    from verl_mcore_utils.module import get_model_config as get_model_config
    from verl_mcore_utils.module import make_megatron_module as make_megatron_module
    from verl_mcore_utils.module import unwrap_model as unwrap_model
    from verl_mcore_utils.moe import PortableTopKRouter as PortableTopKRouter
    from verl_mcore_utils.moe import make_moe_portable as make_moe_portable
    from verl_mcore_utils.mtp import build_mtp_block as build_mtp_block
    from verl_mcore_utils.mtp import mtp_layer_forward as mtp_layer_forward
    from verl_mcore_utils.multi_tensor import (
        use_sync_free_multi_tensor_fallbacks as use_sync_free_multi_tensor_fallbacks,
    )
    from verl_mcore_utils.offload import OffloadStateError as OffloadStateError
    from verl_mcore_utils.offload import OffloadStats as OffloadStats
    from verl_mcore_utils.offload import offload_megatron_model as offload_megatron_model
    from verl_mcore_utils.offload import offload_megatron_optimizer as offload_megatron_optimizer
    from verl_mcore_utils.offload import onload_megatron_model as onload_megatron_model
    from verl_mcore_utils.offload import onload_megatron_optimizer as onload_megatron_optimizer
    from verl_mcore_utils.parallel import ParallelDims as ParallelDims
    from verl_mcore_utils.parallel import destroy_parallel as destroy_parallel
    from verl_mcore_utils.parallel import init_parallel as init_parallel
    from verl_mcore_utils.parallel import seed_cuda_rng_tracker as seed_cuda_rng_tracker
    from verl_mcore_utils.presets import PRESETS as PRESETS
    from verl_mcore_utils.presets import qwen2_preset as qwen2_preset
    from verl_mcore_utils.rope import PortableRotaryEmbedding as PortableRotaryEmbedding
    from verl_mcore_utils.rope import make_rope_portable as make_rope_portable
    from verl_mcore_utils.testing import run_distributed as run_distributed
    from verl_mcore_utils.transformer_config import hf_to_transformer_config as hf_to_transformer_config
    from verl_mcore_utils.weights import export_hf_weights as export_hf_weights
    from verl_mcore_utils.weights import load_hf_weights as load_hf_weights
    from verl_mcore_utils.weights import save_hf_weights as save_hf_weights
    from verl_mcore_utils.wgrad_fusion import (
        enable_wgrad_accumulation_fusion as enable_wgrad_accumulation_fusion,
    )
    from verl_mcore_utils.wgrad_fusion import with_wgrad_fusion as with_wgrad_fusion

_LAZY: dict[str, str] = {
    "GPTModelProvider": "verl_mcore_utils.module",
    "ModelProvider": "verl_mcore_utils.module",
    "OffloadStateError": "verl_mcore_utils.offload",
    "OffloadStats": "verl_mcore_utils.offload",
    "PRESETS": "verl_mcore_utils.presets",
    "ParallelDims": "verl_mcore_utils.parallel",
    "PortableRotaryEmbedding": "verl_mcore_utils.rope",
    "PortableTopKRouter": "verl_mcore_utils.moe",
    "SDPACoreAttention": "verl_mcore_utils.attention",
    "SpecProvider": "verl_mcore_utils.module",
    "ValueHead": "verl_mcore_utils.module",
    "WrapConfig": "verl_mcore_utils.ddp",
    "attach_training_hooks": "verl_mcore_utils.module",
    "build_ddp_config": "verl_mcore_utils.ddp",
    "describe_ddp_config": "verl_mcore_utils.ddp",
    "ddp_hook_is_on_parameter": "verl_mcore_utils.ddp_graph_hooks",
    "ddp_hooks_on_parameters": "verl_mcore_utils.ddp_graph_hooks",
    "run_ddp_hook": "verl_mcore_utils.ddp_graph_hooks",
    "build_gpt_model": "verl_mcore_utils.model",
    "build_mtp_block": "verl_mcore_utils.mtp",
    "destroy_parallel": "verl_mcore_utils.parallel",
    "enable_wgrad_accumulation_fusion": "verl_mcore_utils.wgrad_fusion",
    "export_hf_weights": "verl_mcore_utils.weights",
    "with_wgrad_fusion": "verl_mcore_utils.wgrad_fusion",
    "use_fused_torch_adam": "verl_mcore_utils.fused_adam",
    "use_sync_free_multi_tensor_fallbacks": "verl_mcore_utils.multi_tensor",
    "get_model_config": "verl_mcore_utils.module",
    "hf_to_transformer_config": "verl_mcore_utils.transformer_config",
    "init_parallel": "verl_mcore_utils.parallel",
    "load_hf_weights": "verl_mcore_utils.weights",
    "local_layer_spec": "verl_mcore_utils.model",
    "make_megatron_module": "verl_mcore_utils.module",
    "make_moe_portable": "verl_mcore_utils.moe",
    "make_rope_portable": "verl_mcore_utils.rope",
    "mtp_layer_forward": "verl_mcore_utils.mtp",
    "offload_megatron_model": "verl_mcore_utils.offload",
    "offload_megatron_optimizer": "verl_mcore_utils.offload",
    "onload_megatron_model": "verl_mcore_utils.offload",
    "onload_megatron_optimizer": "verl_mcore_utils.offload",
    "qwen2_preset": "verl_mcore_utils.presets",
    "run_distributed": "verl_mcore_utils.testing",
    "save_hf_weights": "verl_mcore_utils.weights",
    "seed_cuda_rng_tracker": "verl_mcore_utils.parallel",
    "unwrap_model": "verl_mcore_utils.module",
}


__getattr__, __dir__ = lazy_attributes(module=__name__, lazy=_LAZY)

__version__ = _metadata.version("verl-mcore-utils")  # single source: pyproject.toml

# The public names: the eager helpers imported above and every lazy name (tests/test_packaging.py checks
# that the TYPE_CHECKING imports name the same lazy API).
__all__ = ["ddp_config_fields", "import_megatron_core", "mcore_version", "prepare_megatron_import", *_LAZY]
