"""Typed cross-process messages (cluster/messages.py): a shard's info()."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from cpattn.cluster.messages import ShardInfo


def test_shard_info_is_typed_pickles_and_publishes_a_dict():
    info = ShardInfo(bundle_index=2, node_id="n1", node_ip="10.0.0.1", gpu_ids=("0",), pid=42, device="cpu",
                     backend="TORCH", kernel_version="torch", lse_base="E", num_blocks=8, kernel_block_size=16,
                     kv_cache_dtype="float32", kv_bytes=1024)
    ranked = info.with_rank(1)
    assert (ranked.rank, info.rank) == (1, None)                      # with_rank copies; the reply is frozen
    assert pickle.loads(pickle.dumps(ranked)) == ranked              # what Ray does between processes
    public = ranked.as_dict()
    assert public["backend"] == "TORCH" and public["rank"] == 1 and public["gpu_ids"] == ("0",)
    assert set(public) == {f.name for f in dataclasses.fields(ShardInfo)}
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.backend = "TRITON"


def test_a_shard_that_did_not_answer_is_known_by_its_bundle_and_rank():
    missing = ShardInfo(bundle_index=3, rank=0)
    assert missing.as_dict()["node_ip"] is None and missing.ready
