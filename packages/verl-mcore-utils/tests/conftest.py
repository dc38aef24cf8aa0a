"""Loaded by pytest before the test modules: they import megatron-core at their top, after this prepared it.

(Our packages do the same in their ``__init__``; a test module's own imports put megatron-core first.)
"""

from verl_mcore_utils.compat import prepare_megatron_import

prepare_megatron_import()
