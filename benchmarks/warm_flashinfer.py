"""Compile FlashInfer's JIT modules for one (dtype, head size) ahead of the tests: python warm_flashinfer.py bfloat16:128

FlashInfer builds a decode and a prefill module per dtype and head size on first use (14 s and
89 s on the H200); several of these run in parallel before the GPU tests need them.
"""

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cpattn.attention import AttentionSpec, make_causal_metadata  # noqa: E402
from cpattn.attention.backends.flashinfer import FlashInferBackend  # noqa: E402

dtype_name, head = sys.argv[1].split(":")
dtype, head = getattr(torch, dtype_name), int(head)
t0 = time.time()
spec = AttentionSpec(num_q_heads=8, num_kv_heads=2, head_size=head, dtype=dtype, block_size=16, device="cuda")
table = torch.arange(8).reshape(2, 4)
for causal_lens in (([1, 5], [20, 30]),):
    md = make_causal_metadata(*causal_lens, table, 16).to("cuda")
    kv = torch.randn(2, 8, 16, 2, head, device="cuda", dtype=dtype)
    q = torch.randn(6, 8, head, device="cuda", dtype=dtype)
    k = torch.randn(6, 2, head, device="cuda", dtype=dtype)
    plan = FlashInferBackend.get_builder_cls()(spec).build(0, md)
    FlashInferBackend.get_impl_cls()(spec).forward(0, q, k, k, kv, plan)
torch.cuda.synchronize()
print(f"warm {sys.argv[1]} in {time.time() - t0:.1f} s")
