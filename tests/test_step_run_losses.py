"""A step's life on the client (cluster/step_run.StepRun) with a scripted fake host (tests/step_run_fakes.py):
shard lost with one or two replicas, the recovery bound, the wire failing after outputs, and that a refused
step leaves the client as it was. Commits and rollbacks: tests/test_step_run.py.
"""

from __future__ import annotations

import pytest
import torch

from conftest import service_config
from cpattn.cluster.data_plane import WireError
from cpattn.cluster.step_run import MAX_RECOVERIES, StepRun
from cpattn.errors import InvalidRequestError, ServiceError, ShardLostError
from cpattn.step import Step
from step_run_fakes import D, HK, HQ, LAYERS, RECOVERED, REQUEST, FakeHost, attend_all, opened, qkv


# Shard losses ---------------------------------------------------------------------------------------------------
def test_a_shard_lost_mid_step_with_two_replicas_is_replayed_rollback_before_rejoin():
    host = FakeHost(kv_replicas=2, attend=[None, WireError("peer died")])
    run = opened(host)
    attend_all(run)
    run.end()
    assert (run.state, run.recoveries) == ("committed", 1)
    names = host.names()
    assert names[names.index("end_step_of"):names.index("end_step_of") + 3] == ["end_step_of", "rejoin", "begin"]
    assert host.calls[5] == ("end_step_of", 101, False, True, False)   # rolled back, why given, shards not waiting
    # Layer 0 replayed from its sent message, layer 1 retried, layer 2 as usual, all in step 102.
    assert [(s, layer) for s, layer, _ in host.sent] == [(101, 0), (102, 0), (102, 1), (102, 2)]
    assert host.sent[0][2] == host.sent[1][2]


def test_a_shard_lost_with_one_replica_raises_shard_lost_naming_the_sequences():
    lost = ShardLostError("shard 1 was lost with the KV of sequences ['a']: free them", 1, ["a"])
    host = FakeHost(attend=[None, WireError("peer died")], end_step_of=[lost])
    run = opened(host)
    q, k, v = qkv(0)
    run.attend(0, q, k, v)
    with pytest.raises(ShardLostError, match=r"sequences \['a'\]") as info:
        run.attend(1, *qkv(1))
    assert info.value.sequences == ["a"]
    assert (run.state, run.ending) == ("rolled_back", "shard_lost") and host.open_step is None
    assert run.attended == {0}
    run.end()   # the `with` block's exit after the error: nothing more happens
    assert host.names()[-1] == "release"


def test_a_recovered_shard_loss_with_one_replica_rejoins_and_asks_for_the_step_again():
    host = FakeHost(attend=[WireError("peer died")], end_step_of=[RECOVERED])
    run = opened(host)
    with pytest.raises(ServiceError, match="step 101 was rolled back: peer died; the lost shard was replaced"):
        run.attend(0, *qkv(0))
    assert (run.state, run.ending) == ("rolled_back", "not_replayable")
    assert host.names()[-3:] == ["end_step_of", "release", "rejoin"]


def test_recoveries_are_bounded():
    host = FakeHost(kv_replicas=2, attend=[WireError("peer died")] * 10, end_step_of=[RECOVERED] * 10)
    run = opened(host)
    with pytest.raises(ServiceError, match=f"step gave up after {MAX_RECOVERIES} shard recoveries"):
        run.attend(0, *qkv(0))
    assert (run.state, run.ending, run.recoveries) == ("rolled_back", "gave_up", MAX_RECOVERIES + 1)
    assert host.names().count("begin") == MAX_RECOVERIES + 1 and host.open_step is None
    assert host.calls[-1] == ("end_step_of", 104, False, True, False)   # the last begun step is rolled back too


def test_a_service_that_keeps_moving_epochs_while_beginning_is_given_up_on():
    host = FakeHost(begin=[None] * (MAX_RECOVERIES + 1))
    run = StepRun(host, dict(REQUEST))
    with pytest.raises(ServiceError, match="kept replacing shards while this step began"):
        run.open()
    assert host.names().count("rejoin") == MAX_RECOVERIES + 1 and run.state == "new" and host.open_step is None


def test_the_wire_failing_after_outputs_rolls_back_and_rejoins_even_if_the_service_refuses():
    host = FakeHost(kv_replicas=2, wait_for_device=[WireError("a partial did not arrive whole")],
                    end_step_of=[ServiceError("shard 1 is being replaced")])
    run = opened(host)
    attend_all(run)
    with pytest.raises(ServiceError, match="shard 1 is being replaced"):
        run.end()
    assert host.names()[-4:] == ["wait_for_device", "release", "end_step_of", "rejoin"]
    assert (run.state, run.ending, run.recoveries) == ("rolled_back", "wire_after_outputs", 0)


def test_the_wire_failing_after_outputs_is_never_replayed_silently():
    host = FakeHost(kv_replicas=2, wait_for_device=[WireError("a partial did not arrive whole")],
                    end_step_of=[RECOVERED])
    run = opened(host)
    attend_all(run)
    with pytest.raises(ServiceError, match="its outputs are not valid and nothing was committed \\(the lost shard "
                                           "was replaced and refilled from replicas\\): run the step again"):
        run.end()
    assert host.names().count("begin") == 1


def test_an_unexpected_error_while_ending_rolls_back_and_frees_the_client():
    # A shard died after the last layer, and rebuilding the group failed: the step must not stay open.
    host = FakeHost(kv_replicas=2, end_step_of=[RECOVERED], rejoin=[ServiceError("could not rejoin")])
    run = opened(host)
    attend_all(run)
    with pytest.raises(ServiceError, match="could not rejoin"):
        run.end()
    assert (run.state, run.ending) == ("rolled_back", "failed") and host.open_step is None
    assert host.calls[-4:] == [("end_step_of", 101, True, False, True), ("rejoin",), ("release",),
                               ("end_step_of", 101, False, False, True)]
    assert "abort_wire" not in host.names()   # every layer was attended: the shards already left the step


# Refusals change nothing ----------------------------------------------------------------------------------------
def test_a_second_step_on_a_claimed_client_touches_nothing():
    host = FakeHost()
    first = opened(host)
    second = StepRun(host, dict(REQUEST))
    calls = len(host.calls)
    with pytest.raises(InvalidRequestError, match="already open"):
        second.open()
    assert host.names()[calls:] == ["claim"] and host.open_step is first and second.state == "new"


def test_a_step_opens_once_and_attends_only_while_open():
    host = FakeHost()
    run = opened(host)
    with pytest.raises(InvalidRequestError, match="this step is open: start a new one"):
        run.open()
    attend_all(run)
    run.end()
    calls = len(host.calls)
    with pytest.raises(InvalidRequestError, match=r"attend\(\) needs an open step \(this one is committed\)"):
        run.attend(0, *qkv(0))
    run.end()
    assert len(host.calls) == calls


def test_the_public_step_refuses_bad_inputs_before_its_run_sends_anything():
    host = FakeHost()
    host.config = service_config(num_layers=LAYERS, num_q_heads=HQ, num_kv_heads=HK, head_size=D, async_commit=False)
    with Step(host, dict(REQUEST)) as step:
        q, k, v = qkv(0)
        with pytest.raises(InvalidRequestError, match=r"q has shape \(2, 4, 8\), expected \(3, 4, 8\)"):
            step.attend(0, q[:2], k, v)
        with pytest.raises(InvalidRequestError, match="layer 7 out of range"):
            step.attend(7, q, k, v)
        bad = q.clone()
        bad[0, 0, 0] = float("nan")
        with pytest.raises(InvalidRequestError, match="q holds NaN or inf"):
            step.attend(0, bad, k, v)
        assert "attend" not in host.names() and step._run.attended == set()
        for layer in range(LAYERS):
            q, k, v = qkv(layer)
            assert torch.equal(step.attend(layer, q, k, v), 2 * q)
    assert (step._run.state, step.recoveries, step._info.step_id) == ("committed", 0, 101)
    assert step.timings is step._run.timings and step.timings["plan_s"] == 0.25   # one dict, completed in place


# This process's own work failing ----------------------------------------------------------------------------------
@pytest.mark.parametrize("cause, advice", [(torch.OutOfMemoryError("CUDA out of memory"), "max_tokens_per_step"),
                                           (RuntimeError("a kernel's own error"), "fix the cause")])
def test_a_local_failure_rolls_back_once_without_replay_or_rejoin_and_says_what_to_change(cause, advice):
    """Not a lost shard: nothing is replayed (it would fail alike, even with two replicas), the coordinator rolls
    the step back, and the error keeps the cause; the gateway rebuilds its group at the next begin."""
    from cpattn.cluster.data_plane import LocalWorkError

    local = LocalWorkError(f"merging the shards' partials: {type(cause).__name__}: {cause}")
    local.__cause__ = cause
    host = FakeHost(kv_replicas=2, attend=[None, local])
    run = opened(host)
    with pytest.raises(ServiceError) as info:
        attend_all(run)
    message = str(info.value)
    assert message.startswith("step 101, layer 1: merging the shards' partials") and advice in message, message
    assert "rolled back and none of its tokens were committed" in message and info.value.__cause__ is cause
    assert (run.state, run.ending) == ("rolled_back", "failed_here") and host.open_step is None
    assert host.names()[-2:] == ["release", "end_step_of"] and "rejoin" not in host.names()
    assert host.calls[-1] == ("end_step_of", 101, False, True, False)
    assert [layer for _, layer, _ in host.sent] == [0]   # layer 1 failed in the host, nothing replayed


def test_a_local_failure_while_replaying_after_a_shard_loss_is_the_same_service_error():
    """Raised by a layer replayed after a recovery (kv_replicas=2): also a ServiceError with its cause, never the
    internal LocalWorkError."""
    from cpattn.cluster.data_plane import LocalWorkError

    cause = torch.OutOfMemoryError("CUDA out of memory")
    local = LocalWorkError(f"in-process shard(s) [0] on cuda:0: OutOfMemoryError: {cause}")
    local.__cause__ = cause
    host = FakeHost(kv_replicas=2, attend=[None, WireError("peer died"), local])
    run = opened(host)
    with pytest.raises(ServiceError, match=r"step 102, layer 0: in-process shard\(s\) \[0\] on cuda:0") as info:
        attend_all(run)
    assert info.value.__cause__ is cause and (run.state, run.ending) == ("rolled_back", "failed_here")
    assert host.open_step is None
