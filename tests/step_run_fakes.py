"""The scripted fake host of the StepRun tests (tests/test_step_run*.py): a StepHost whose answers are set per
method, logging every call in order, with no Ray runtime and no torch.distributed group."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from cpattn.cluster.client_run import BegunStep, PendingCommit
from cpattn.cluster.messages import EndStepReply
from cpattn.cluster.step_run import StepRun
from cpattn.errors import InvalidRequestError

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
        self.ended = False   # close() / shutdown() of the client (read by the public Step's attend)
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
