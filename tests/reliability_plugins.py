"""Plugin attention backends for the LSE-base regression tests (imported by shard processes by path).

Both wrap the TORCH reference. ``Base2TorchBackend`` reports its LSE in base 2 and says so, like
FlashInfer: the service must convert it and stay exact. ``MislabelledBase2Backend`` returns the
natural-log LSE but declares base 2: if the service honours declarations, its merged outputs are
wrong, which is what proves the declared base is actually used.
"""

from __future__ import annotations

import math

from cpattn.attention import LseBase
from cpattn.attention.backends.torch_ref import TorchAttentionImpl, TorchReferenceBackend

LOG2E = 1.0 / math.log(2.0)


class Base2TorchImpl(TorchAttentionImpl):
    def forward(self, layer, q_TQD, k_TKD, v_TKD, kv_cache, attn_metadata):
        out, lse = super().forward(layer, q_TQD, k_TKD, v_TKD, kv_cache, attn_metadata)
        return out, lse * LOG2E   # log2(sum exp(s)) = ln(sum exp(s)) * log2(e); -inf stays -inf


class Base2TorchBackend(TorchReferenceBackend):
    name = "RELIA_BASE2"
    impl_cls = Base2TorchImpl
    lse_base = LseBase.TWO


class MislabelledBase2Backend(TorchReferenceBackend):
    name = "RELIA_MISLABELLED"
    lse_base = LseBase.TWO   # but forward() returns natural-log LSE


PLUGINS = {"RELIA_BASE2": "tests.reliability_plugins:Base2TorchBackend",
           "RELIA_MISLABELLED": "tests.reliability_plugins:MislabelledBase2Backend"}
