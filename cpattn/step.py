"""A step: one set of sequences advancing together, attended layer by layer.

The client's Gateway does the per-layer work (remote shards over the data plane, shards on the
client's GPU in-process, merge on the client's device); the step's life (begin, recoveries after a shard
loss, commit or rollback: cluster/step_run.StepRun) is owned in cluster/. A Step is the public face of one:
it checks the caller's inputs (cpattn/step_inputs.py) before StepRun sends anything.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import torch

from cpattn.cluster.step_run import MAX_RECOVERIES, StepRun
from cpattn.errors import InvalidRequestError
from cpattn.step_inputs import check_layer, check_qkv, checked_sinks

if TYPE_CHECKING:
    from cpattn.cluster.client_run import BegunStep
    from cpattn.cluster.gateway import Gateway

__all__ = ["Step", "MAX_RECOVERIES"]


class Step:
    """One step of a set of sequences; commits when every layer was attended, else rolls back.

    With kv_replicas=2 a step survives a shard loss: the coordinator replaces and refills the shard,
    this client rebuilds its group, begins the step again and replays the layers already attended
    (their outputs are identical, since the restored KV is), so the caller sees only latency.
    """

    def __init__(self, gateway: Gateway, request: dict[str, int], sync_commit: bool = False):
        self._gw = gateway
        self._run = StepRun(gateway, request, sync_commit=sync_commit)
        self._thread: int | None = None
        self.timings = self._run.timings
        """Seconds: plan_s (begin_step + the shards' planning), begin_s (the caller's wall time to open the step:
        the previous commit settled, the plan fetched or taken from the decode run, in-process shards planned;
        ``begin_parts``: the same seconds by phase, benchmarks/profile_begin.py), end_s (the caller's time in ending
        it: the device waited for, the commit sent),
        data_plane_s (host time in attend: wire,
        in-process shards, merge); attention_s (the slowest remote shard's kernel time; its launch time on
        CUDA) is added when the commit is read (at the next call of this client with async_commit)."""

    @property
    def recoveries(self) -> int:
        """Shard losses this step survived (kv_replicas=2: rejoined, begun again, its layers replayed), a loss
        found by its commit (sent without waiting) included once that commit is read (the client's next call)."""
        return self._run.recoveries + self._run.timings.get("commit_replays", 0)

    @property
    def _info(self) -> BegunStep | None:
        return self._run.info

    @property
    def num_tokens(self) -> int:
        return self._run.info.num_tokens if self._run.info else sum(self._run.request.values())

    @property
    def seq_ids(self) -> list[str]:
        return list(self._run.info.seq_ids) if self._run.info else list(self._run.request)

    def __enter__(self) -> "Step":
        self._run.open()
        self._thread = threading.get_ident()
        return self

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of this step's tokens for one layer: q [T, Hq, D], k/v [T, Hk, D] -> out [T, Hq, D].

        ``sinks`` [Hq]: learned attention-sink logits (gpt-oss style) of this layer, one extra softmax term
        per head with no value; it enters once, in the client's merge (never once per shard).
        """
        run = self._run
        if self._gw.ended:   # (its data-plane group is gone: the shards rolled the step back with the client)
            raise InvalidRequestError("this client was closed or shut down while the step was open: the step was "
                                      "rolled back; connect again with cpattn.connect() and run it again")
        run.require_open()
        if threading.get_ident() != self._thread:   # a client (and its step) is one-thread
            raise InvalidRequestError("attend() from a thread other than the one that opened the step: a client "
                                      "serves one thread (give each thread its own cpattn.connect())")
        cfg = self._gw.config
        check_layer(cfg, layer, run.attended, in_order=self._gw.runs_ahead)
        # On a CUDA gateway the NaN/inf check is one reduction per layer, read once at the end of the step (a read
        # here would stall the GPU every layer); a step that had NaN/inf is rolled back there.
        check_qkv(cfg, self.num_tokens, q, k, v, check_finite=cfg.nan_policy == "reject" and run.wire.norms is None)
        sinks = checked_sinks(cfg, sinks, self._gw.device)
        return run.attend(layer, q, k, v, sinks)

    def __exit__(self, exc_type, exc, tb) -> None:
        self._run.end(caller_failed=exc_type is not None)
