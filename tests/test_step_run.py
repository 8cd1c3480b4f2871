"""A step's life on the client (cluster/step_run.StepRun) with a scripted fake host (tests/step_run_fakes.py):
every way a step commits (waited for or sent, a deferred commit rolled back and replayed) and rolls back (the
caller's error, missing layers, NaN, fenced, lapsed lease), and the order of the calls it makes. Shard losses and
refusals: tests/test_step_run_losses.py.

Outputs are checked against q computed by hand (the fake's "attention" is 2 q, in float64).
"""

from __future__ import annotations

import pytest

from conftest import service_config
from cpattn.cluster.authority import UNKNOWN_CLIENT
from cpattn.cluster.step_run import StepRun, finish_deferred_commit
from cpattn.errors import (AccessDeniedError, IncompleteStepError, InvalidRequestError, ServiceError,
                           StepFencedError)
from cpattn.step import Step
from step_run_fakes import D, HK, HQ, LAYERS, RECOVERED, REQUEST, FakeHost, attend_all, opened, qkv


# Commits --------------------------------------------------------------------------------------------------------
def test_a_whole_step_commits_waiting_and_calls_its_host_in_order():
    host = FakeHost()
    run = opened(host)
    attend_all(run)
    run.end()
    assert (run.state, run.ending) == ("committed", "committed")
    assert host.calls == [("claim",), ("flush", REQUEST), ("begin",), *[("attend", 101, i) for i in range(LAYERS)],
                          ("wait_for_device",), ("end_step_of", 101, True, False, True), ("release",), ("committed",)]
    assert host.open_step is None and run.timings["plan_s"] == 0.25 and run.timings["data_plane_s"] > 0


def test_an_async_commit_is_sent_and_its_deferred_answer_completes_the_timings():
    host = FakeHost(async_commit=True)
    run = opened(host)
    attend_all(run)
    run.end()
    assert (run.state, run.ending) == ("committed", "commit_sent") and host.names()[-2:] == ["commit_async",
                                                                                             "release"]
    assert "attention_s" not in run.timings
    pending, host.pending = host.pending, None
    finish_deferred_commit(host, pending)
    assert host.names()[-2:] == ["read_commit", "committed"] and run.timings["attention_s"] == 0.5


def test_a_deferred_commit_rolled_back_after_all_is_replayed_from_the_messages_sent():
    host = FakeHost(kv_replicas=2, async_commit=True, read_commit=[RECOVERED])
    run = opened(host)
    attend_all(run)
    run.end()
    first_sent = list(host.sent)
    pending, host.pending = host.pending, None
    assert [layer for layer, _, _ in pending.replay] == list(range(LAYERS))
    host.calls.clear()
    finish_deferred_commit(host, pending)
    # The replay waits for its commit (a failure after it must be seen now), in a fresh step of its own.
    assert host.calls == [("read_commit", 101), ("rejoin",), ("claim",), ("flush", REQUEST), ("begin",),
                          *[("attend", 102, i) for i in range(LAYERS)], ("wait_for_device",),
                          ("end_step_of", 102, True, False, True), ("release",), ("committed",)]
    # q|k|v was packed once per layer: the replay sent the very buffers the first step sent.
    assert [ptr for _, _, ptr in host.sent[LAYERS:]] == [ptr for _, _, ptr in first_sent]


def test_a_loss_found_by_a_deferred_commit_counts_as_the_steps_recovery_once_read():
    """The flake seen on CI (test_killed_between_layers_replays_the_step): the killed shard answered every layer,
    the commit found it dead, the replay ran in a fresh step of its own, and the Step said 0 recoveries."""
    host = FakeHost(kv_replicas=2, async_commit=True, read_commit=[RECOVERED])
    host.config = service_config(num_layers=LAYERS, num_q_heads=HQ, num_kv_heads=HK, head_size=D, async_commit=True,
                                 kv_replicas=2)
    with Step(host, dict(REQUEST)) as step:
        for layer in range(LAYERS):
            step.attend(layer, *qkv(layer))
    assert step.recoveries == 0   # the commit's answer is not read yet
    pending, host.pending = host.pending, None
    finish_deferred_commit(host, pending)
    assert step.recoveries == 1


def test_a_deferred_commit_rolled_back_without_replicas_says_run_it_again():
    host = FakeHost(async_commit=True, read_commit=[RECOVERED])
    run = opened(host)
    attend_all(run)
    run.end()
    pending, host.pending = host.pending, None
    with pytest.raises(ServiceError, match="was rolled back after its last layer: shard 1 died.*run it again"):
        finish_deferred_commit(host, pending)
    assert host.names()[-2:] == ["read_commit", "rejoin"] and host.open_step is None


def test_a_shard_lost_after_the_last_layer_of_a_waited_commit_is_replayed():
    host = FakeHost(kv_replicas=2, end_step_of=[RECOVERED])
    run = opened(host)
    attend_all(run)
    run.end()
    assert (run.state, run.ending, run.recoveries) == ("committed", "committed", 1)
    tail = host.calls[host.names().index("wait_for_device"):]
    assert tail == [("wait_for_device",), ("end_step_of", 101, True, False, True), ("rejoin",), ("begin",),
                    *[("attend", 102, i) for i in range(LAYERS)], ("end_step_of", 102, True, False, True),
                    ("release",), ("committed",)]


# Rollbacks ------------------------------------------------------------------------------------------------------
def test_the_callers_error_rolls_back_silently_even_when_the_service_refuses():
    host = FakeHost(end_step_of=[ServiceError("coordinator gone")])
    run = opened(host)
    attend_all(run, [0])
    run.end(caller_failed=True)   # the caller's exception is the one to see
    assert (run.state, run.ending) == ("rolled_back", "rolled_back")
    assert host.calls[-3:] == [("abort_wire", 101, LAYERS - 1), ("release",), ("end_step_of", 101, False, False,
                                                                                          False)]
    assert "rejoin" not in host.names()


def test_missing_layers_roll_back_and_name_the_layers():
    host = FakeHost()
    run = opened(host)
    attend_all(run, [0])
    with pytest.raises(IncompleteStepError, match=r"step 101 ended with layers \[1, 2\] never attended") as info:
        run.end()
    assert info.value.missing == [1, 2]
    assert (run.state, run.ending) == ("rolled_back", "incomplete")
    assert host.calls[-3:] == [("abort_wire", 101, 2), ("release",), ("end_step_of", 101, False, False, False)]


def test_nan_seen_on_the_device_rolls_back_without_an_abort_message():
    host = FakeHost()
    host.nonfinite = True
    run = opened(host)
    attend_all(run)
    with pytest.raises(InvalidRequestError, match="held NaN or inf in this step: it was rolled back"):
        run.end()
    assert (run.state, run.ending) == ("rolled_back", "nonfinite")
    # Every layer was attended: the shards already left the step, so no ABORT (it would desynchronise them).
    assert "abort_wire" not in host.names() and host.calls[-1] == ("end_step_of", 101, False, False, True)


def test_a_fenced_step_is_rolled_back_and_says_so():
    fenced = StepFencedError("step 101 was open when the coordinator restarted: run the step again")
    host = FakeHost(end_step_of=[fenced])
    run = opened(host)
    attend_all(run)
    with pytest.raises(StepFencedError, match="run the step again"):
        run.end()
    assert (run.state, run.ending) == ("rolled_back", "fenced") and host.open_step is None
    assert "committed" not in host.names()


def test_a_lapsed_lease_refuses_the_begin_and_nothing_stays_claimed():
    host = FakeHost(begin=[AccessDeniedError(UNKNOWN_CLIENT)])
    run = StepRun(host, dict(REQUEST))
    with pytest.raises(AccessDeniedError, match="lease lapsed"):
        run.open()
    assert run.state == "new" and run.info is None and host.open_step is None
    assert host.names() == ["claim", "flush", "begin", "release"]


def test_a_lapsed_lease_at_the_commit_rolls_back():
    host = FakeHost(end_step_of=[AccessDeniedError(UNKNOWN_CLIENT)])
    run = opened(host)
    attend_all(run)
    with pytest.raises(AccessDeniedError, match="lease lapsed"):
        run.end()
    assert (run.state, run.ending) == ("rolled_back", "lease_lapsed") and host.open_step is None
