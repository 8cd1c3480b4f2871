"""What a StepRun (cluster/step_run.py) asks of the client around it: the Gateway in the service, fakes in tests.

A small protocol, so a step's states and endings are tested without Ray or torch.distributed
(tests/test_step_run.py): the coordinator's calls (begin, end_step, the commit sent without waiting), the
data plane (a layer, the abort, the wait for the device) and the group (rejoin).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from cpattn.cluster.client_run import BegunStep, PendingCommit
    from cpattn.cluster.messages import EndStepReply
    from cpattn.cluster.wire_messages import LayerMessage
    from cpattn.config import ServiceConfig


class StepWireLike(Protocol):
    """The per-step wire the host hands out with a begun step (gateway.StepWire)."""

    step_id: int
    norms: Any

    def saw_nonfinite(self) -> bool: ...


class StepHost(Protocol):
    config: ServiceConfig
    device: torch.device
    open_step: Any
    """The step holding this client's one-step claim (None when none does)."""
    ended: bool
    """The client was closed or shut down: a step still open is refused at its next attend (cpattn/step.py)."""

    # The client's one open step ---------------------------------------------------------------------------------
    def claim(self, owner) -> None:
        """Take the client's one-step claim for ``owner``; raises InvalidRequestError if another holds it."""

    def release(self, owner) -> None: ...

    def flush(self, end_run: bool = False, continuing: dict | None = None) -> None:
        """Settle the previous step's commit (a decode run goes on when ``continuing`` continues it)."""

    # The coordinator ------------------------------------------------------------------------------------------------
    def begin(self, request: dict[str, int]) -> BegunStep | None:
        """Plan the step; None when the service moved to a new epoch (rejoin, then begin again)."""

    def end_step_of(self, step_id: int, commit: bool, why: str | None, shards_waiting: bool = False
                    ) -> EndStepReply:
        """Commit or roll back (raises StepFencedError, ShardLostError, ServiceError when it did not commit)."""

    def commit_async(self, step_id: int, request: dict, replay, timings: dict) -> None:
        """Send the commit without waiting: its answer is read by ``read_commit`` at the client's next call."""

    def read_commit(self, pending: PendingCommit) -> EndStepReply: ...

    def committed(self, timings: dict[str, float], report: EndStepReply, earlier: list[dict] = ()) -> None:
        """Complete a committed step's timings (in place) with what the shards reported."""

    # The data plane and the group ----------------------------------------------------------------------------------
    def attend(self, wire, layer: int, message: LayerMessage, sinks_Q: torch.Tensor | None = None) -> torch.Tensor:
        """One layer; raises data_plane.WireError when the wire failed (the group is then rebuilt by rejoin)."""

    def abort_wire(self, wire, remaining: int) -> None: ...

    def wait_for_device(self, wire) -> None:
        """The step's device work is done and every partial arrived whole, else WireError (bounded)."""

    def rejoin(self) -> None: ...
