"""Pure parts of the service tested alone: rank assignment, per-shard KV shares, config validation."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cpattn
from cpattn.cluster.placement import ShardLocation, assign_ranks
from cpattn.errors import ConfigError
from service_oracle import local_tokens


def test_assign_ranks_sorts_by_node_then_gpu_then_bundle():
    locs = [
        ShardLocation(0, "10.0.0.2", "nodeB", ("1",)),
        ShardLocation(1, "10.0.0.1", "nodeA", ("1",)),
        ShardLocation(2, "10.0.0.2", "nodeB", ("0",)),
        ShardLocation(3, "10.0.0.1", "nodeA", ("0",)),
        ShardLocation(4, "10.0.0.1", "nodeA", ("10",)),   # numeric, not string, GPU order
        ShardLocation(5, "10.0.0.1", "nodeA", ("2",)),
    ]
    assert assign_ranks(locs) == [5, 1, 4, 0, 3, 2]


def test_assign_ranks_cpu_shards_on_one_node_follow_bundles():
    locs = [ShardLocation(i, "127.0.0.1", "n", ()) for i in (3, 0, 2, 1)]
    assert assign_ranks(locs) == [3, 0, 2, 1]
    assert assign_ranks([]) == []


def test_assign_ranks_shared_gpu_keeps_bundle_order():
    locs = [ShardLocation(1, "h", "n", ("0",)), ShardLocation(0, "h", "n", ("0",)),
            ShardLocation(2, "h", "n", ("1",))]
    assert assign_ranks(locs) == [1, 0, 2]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["10.0.0.1", "10.0.0.2", "10.0.0.3"]), st.integers(0, 7)),
                min_size=1, max_size=12), st.randoms())
def test_assign_ranks_is_a_sorting_permutation(places, rnd):
    locs = [ShardLocation(i, ip, "node-" + ip, (str(g),)) for i, (ip, g) in enumerate(places)]
    rnd.shuffle(locs)
    ranks = assign_ranks(locs)
    assert sorted(ranks) == list(range(len(locs)))
    by_rank = [loc for _, loc in sorted(zip(ranks, locs), key=lambda p: p[0])]
    keys = [(loc.node_ip, int(loc.gpu_ids[0]), loc.bundle_index) for loc in by_rank]
    assert keys == sorted(keys)
    assert assign_ranks(locs) == ranks   # deterministic


# --- local share arithmetic used by the service checks ----------------------------------------

@pytest.mark.parametrize("num_shards,interleave", [(1, 1), (2, 1), (3, 4), (4, 2)])
def test_local_token_counts_partition_the_sequence(num_shards, interleave):
    rng = random.Random(num_shards * 7 + interleave)
    for _ in range(20):
        length = rng.randint(0, 200)
        shares = [local_tokens(length, num_shards, r, interleave) for r in range(num_shards)]
        assert sum(shares) == length
        assert max(shares) - min(shares) <= interleave


# --- config validation -----------------------------------------------------------------------

def test_config_rejects_q_heads_not_multiple_of_kv_heads():
    with pytest.raises(ConfigError, match=r"num_q_heads 12 is not a multiple of num_kv_heads 8: pick num_kv_heads "
                                          r"dividing 12"):
        cpattn.ServiceConfig(num_q_heads=12, num_kv_heads=8)


def test_config_rejects_block_size_not_multiple_of_interleave():
    with pytest.raises(ConfigError, match=r"block_size 16 is not a multiple of dcp_interleave 3"):
        cpattn.ServiceConfig(block_size=16, dcp_interleave=3)


def test_config_rejects_malformed_backend_with_valid_options():
    with pytest.raises(ConfigError, match=r"backend 'no such!' is not a backend name: use one of auto, TORCH, "
                                          r"FLASHINFER, FLASH_ATTN, TRITON"):
        cpattn.ServiceConfig(backend="no such!")


@pytest.mark.parametrize("field,value,match", [
    ("num_shards", 0, r"num_shards=0"),
    ("head_size", 100, r"head_size 100 must be a multiple of 8"),
    ("dtype", "int8", r"dtype='int8'"),
    ("rpc_timeout_s", 0, r"rpc_timeout_s=0"),
    ("num_blocks", 4, r"unknown field 'num_blocks'"),
])
def test_config_errors_name_field_and_value(field, value, match):
    with pytest.raises(ConfigError, match=match):
        cpattn.ServiceConfig(**{field: value})
    assert issubclass(ConfigError, ValueError)


def test_a_start_timeout_of_gpu_shards_names_their_kernel_compiling():
    from cpattn.cluster.shard_set import _starting_gpu_note

    assert _starting_gpu_note(cpattn.ServiceConfig(num_gpus_per_shard=0)) == ""
    note = _starting_gpu_note(cpattn.ServiceConfig(num_gpus_per_shard=1, device="cuda"))
    assert "compiles its kernels while it starts" in note and "FlashInfer's JIT" in note
