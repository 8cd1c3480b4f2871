"""Typed cross-process messages (cluster/messages.py): a shard's info(), the begin_step / end_step replies and a
shard's run_step report."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from cpattn.cluster import step_outcome
from cpattn.cluster.messages import (BeginStepReply, EndStepReply, Rejoin, ShardInfo, ShardsReply, ShardStepReport,
                                     StepPlans)


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


def test_step_replies_are_typed_and_pickle():
    later = StepPlans(8, {}, {1: None})
    reply = BeginStepReply(7, {}, {1: None}, num_tokens=3, seq_ids=["s"], query_lens=[3], plan_s=0.01, epoch=2,
                           local_pages={}, later=[later])
    again = pickle.loads(pickle.dumps(reply))                         # what Ray does between processes
    assert again == reply and isinstance(again, StepPlans) and again.later[0].step_id == 8
    assert pickle.loads(pickle.dumps(Rejoin(3))) == Rejoin(3)
    with pytest.raises(TypeError, match="unexpected keyword argument 'recoverd'"):
        EndStepReply(recoverd=True)                                 # a misspelt field fails where it is made


def test_end_step_reply_takes_the_slowest_shard():
    reports = [ShardStepReport.of({"plan_s": 0.1, "attention_s": 0.5, "wire_s": 0.2, "layers": 2, "steps": 1,
                                   "outcome": "served"}),
               ShardStepReport(plan_s=0.3, attention_s=0.4, wire_s=0.1)]
    assert step_outcome.shard_timings(reports) == EndStepReply(shard_plan_s=0.3, attention_s=0.5, shard_wire_s=0.2)
    assert step_outcome.shard_timings([]) == EndStepReply()
    before_restart = step_outcome.COMMITTED_BEFORE_RESTART
    assert before_restart.committed_before_restart and not before_restart.recovered
    broken = ShardStepReport.of({"plan_s": 0.0, "attention_s": 0.0, "wire_s": 0.0, "layers": 0, "steps": 0,
                                 "outcome": "broken", "error": "RuntimeError: peer gone"})
    assert pickle.loads(pickle.dumps(broken)).error == "RuntimeError: peer gone"


def test_get_shards_reply_is_typed_and_pickles():
    infos = [ShardInfo(bundle_index=0, rank=0, backend="TORCH"), ShardInfo(bundle_index=4, rank=1, ready=False)]
    reply = ShardsReply(epoch=3, shards=["handle-0", None], infos=infos)   # None: a lost shard not yet replaced
    again = pickle.loads(pickle.dumps(reply))                         # what Ray does between processes
    assert again == reply and again.epoch == 3 and again.shards == ["handle-0", None]
    assert [i.bundle_index for i in again.infos] == [0, 4] and not again.infos[1].ready
    assert [f.name for f in dataclasses.fields(ShardsReply)] == ["epoch", "shards", "infos"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        reply.epoch = 4
    with pytest.raises(TypeError, match="'ShardsReply' object is not subscriptable"):
        reply["epoch"]                                                # the dict it replaced: read fields instead
