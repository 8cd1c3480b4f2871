"""A step's life on the client (cluster/step_run.StepRun) with a scripted fake host: no Ray runtime, no
torch.distributed group. Every ending (commit waited for or sent, rollback, incomplete, NaN, fenced, shard
lost with one or two replicas, lapsed lease, the wire failing after outputs), the recovery bound, the order of
the calls it makes, and that a refused step leaves the client as it was.

Outputs are checked against q computed by hand (the fake's "attention" is 2 q, in float64).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from conftest import service_config
from cpattn.cluster.authority import UNKNOWN_CLIENT
from cpattn.cluster.client_run import BegunStep, PendingCommit
from cpattn.cluster.data_plane import WireError
from cpattn.cluster.messages import EndStepReply
from cpattn.cluster.step_run import MAX_RECOVERIES, StepRun, finish_deferred_commit
from cpattn.errors import (AccessDeniedError, IncompleteStepError, InvalidRequestError, ServiceError,
                           ShardLostError, StepFencedError)
from cpattn.step import Step

HQ, HK, D, LAYERS = 4, 2, 8, 3
REQUEST = {"a": 2, "b": 1}
T = sum(REQUEST.values())
RECOVERED = EndStepReply(recovered=True, failure="shard 1 died")


class FakeWire:
    def __init__(self, step_id: int, nonfinite: bool):
        self.step_id, self.norms, self._nonfinite = step_id, None, nonfinite
        self.sent_bytes = 0

    def saw_nonfinite(self) -> bool:
        return self._nonfinite


class FakeHost:
    """A StepHost whose answers are scripted per method (a value, or an exception to raise; then the default),
    logging every call in order. Its "attention" is 2 q, sent from the packed message as a gateway with a
    data plane does (so the buffer that went on the wire is recorded)."""

    def __init__(self, kv_replicas: int = 1, async_commit: bool = False, **script):
        self.config = SimpleNamespace(num_layers=LAYERS, kv_replicas=kv_replicas, async_commit=async_commit,
                                      detached=False, num_q_heads=HQ, num_kv_heads=HK)
        self.device = torch.device("cpu")
        self.runs_ahead = False   # read by the public Step's layer-order check
        self.open_step = None
        self.nonfinite = False
        self.script = {name: list(answers) for name, answers in script.items()}
        self.calls: list[tuple] = []
        self.sent: list[tuple[int, int, int]] = []   # (step_id, layer, data_ptr of the message sent)
        self.pending: PendingCommit | None = None
        self._next_id = 100

    def _answer(self, name: str, default):
        answers = self.script.get(name)
        answer = answers.pop(0) if answers else default
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]

    def claim(self, owner) -> None:
        self.calls.append(("claim",))
        if self.open_step is not None:
            raise InvalidRequestError("a step is already open on this client")
        self.open_step = owner

    def release(self, owner) -> None:
        self.calls.append(("release",))
        if self.open_step is owner:
            self.open_step = None

    def flush(self, end_run: bool = False, continuing: dict | None = None) -> None:
        self.calls.append(("flush", continuing))

    def begin(self, request):
        self.calls.append(("begin",))
        if self._answer("begin", "plan") is None:
            return None
        self._next_id += 1
        return BegunStep(self._next_id, sum(request.values()), list(request), 0.25,
                         FakeWire(self._next_id, self.nonfinite))

    def attend(self, wire, layer, message, sinks_Q=None):
        self.calls.append(("attend", wire.step_id, layer))
        self._answer("attend", None)
        self.sent.append((wire.step_id, layer, message.stamped(1, layer, wire.step_id).data_ptr()))
        return message.q.to(torch.float64) * 2

    def abort_wire(self, wire, remaining):
        self.calls.append(("abort_wire", wire.step_id, remaining))

    def wait_for_device(self, wire):
        self.calls.append(("wait_for_device",))
        self._answer("wait_for_device", None)

    def end_step_of(self, step_id, commit, why, shards_waiting=False):
        self.calls.append(("end_step_of", step_id, commit, why is not None, shards_waiting))
        return self._answer("end_step_of", EndStepReply())

    def commit_async(self, step_id, request, replay, timings):
        self.calls.append(("commit_async", step_id))
        self.pending = PendingCommit(step_id, request, replay, timings, ref=None)

    def read_commit(self, pending):
        self.calls.append(("read_commit", pending.step_id))
        return self._answer("read_commit", EndStepReply(attention_s=0.5))

    def committed(self, timings, report, earlier=()):
        self.calls.append(("committed",))
        timings["attention_s"] = report.attention_s

    def rejoin(self):
        self.calls.append(("rejoin",))
        self._answer("rejoin", None)


def qkv(layer: int):
    gen = torch.Generator().manual_seed(layer)
    return (torch.randn(T, HQ, D, dtype=torch.float64, generator=gen),
            torch.randn(T, HK, D, dtype=torch.float64, generator=gen),
            torch.randn(T, HK, D, dtype=torch.float64, generator=gen))


def opened(host: FakeHost, **kwargs) -> StepRun:
    run = StepRun(host, dict(REQUEST), **kwargs)
    run.open()
    return run


def attend_all(run: StepRun, layers=range(LAYERS)) -> None:
    for layer in layers:
        q, k, v = qkv(layer)
        out = run.attend(layer, q, k, v)
        assert out.dtype == q.dtype and torch.equal(out, 2 * q)


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

