"""Device diagnosis: one FLASH_ATTN service step with worker logs shown (why does a shard die?)."""
import logging
import sys

import ray
import torch

import cpattn

ray.init(num_cpus=8, include_dashboard=False, log_to_driver=True, logging_level=logging.INFO)
num_shards = int(sys.argv[1]) if len(sys.argv) > 1 else 1
cfg = cpattn.ServiceConfig(num_shards=num_shards, num_layers=1, num_q_heads=8, num_kv_heads=2, head_size=128,
                           block_size=16, dtype="bfloat16", backend="FLASH_ATTN", device="cuda",
                           num_gpus_per_shard=1.0 / num_shards, num_cpus_per_shard=0.5, num_blocks_per_shard=64,
                           rpc_timeout_s=120, collective_timeout_s=120, name=f"diag{num_shards}")
svc = cpattn.start(cfg)
a = svc.add_sequence()
for n in (17, 1):
    with svc.step({a: n}) as step:
        out = step.attend(0, *(torch.randn(n, h, 128, dtype=torch.bfloat16) for h in (8, 2, 2)))
    print("step ok", n, out.shape, flush=True)
svc.shutdown()
