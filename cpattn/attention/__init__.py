"""The attention-backend layer: backends, selection, metadata; ops/ below them holds the shared math.

torch only; never imports Ray, cluster/ or launch/.
"""

from cpattn.attention.backend import (AttentionBackend, AttentionCGSupport, AttentionImpl,
                                      AttentionMetadataBuilder, AttentionSelectorConfig, AttentionSpec,
                                      write_kv_cache)
from cpattn.attention.metadata import (CommonAttentionMetadata, make_causal_metadata,
                                       make_dcp_context_metadata)
from cpattn.attention.ops.lse import LseBase, to_natural_lse
from cpattn.attention.ops.merge import apply_sinks, merge_attn_states, merge_partials, merge_rows
from cpattn.attention.registry import AttentionBackendEnum, register_backend
from cpattn.attention.selector import get_attn_backend, select_backend, select_prefill_backend

__all__ = [
    "AttentionBackend", "AttentionBackendEnum", "AttentionCGSupport", "AttentionImpl", "AttentionMetadataBuilder",
    "AttentionSelectorConfig", "AttentionSpec", "apply_sinks", "CommonAttentionMetadata", "LseBase", "get_attn_backend",
    "make_causal_metadata", "make_dcp_context_metadata", "merge_attn_states", "merge_partials", "merge_rows", "register_backend",
    "select_backend", "select_prefill_backend", "to_natural_lse", "write_kv_cache",
]
