"""The client's side of the service: coordinator handle, data-plane group, local shards, epoch, rejoin.

Legend: T tokens of a step, Q query heads, K kv heads, D head size, N partials.
Per layer the gateway (rank 0 of its group) broadcasts q|k|v to the *remote* shards (a prefill step: each its
own rows, cluster/wire_select.py), computes the share of every *local* shard itself while those sends are in
flight, receives each remote shard's computed rows and merges on its own device. A shard is local when it lives on this process's GPU: the client opens that shard's
KV cache once per connection by CUDA IPC and runs the shard's kernels in its own process, because
two processes taking turns on one GPU pay a context switch each way (~320 us per round trip on an
H200) and NCCL cannot put two ranks on one GPU. Remote shards talk NCCL when every rank has a GPU
of its own, gloo otherwise (CPU, or remote shards sharing a GPU).

A step's commit is sent without waiting (``async_commit``): the coordinator's answer is collected
by the next call this client makes, so a steady decode loop pays one Ray round trip per step
(begin_step), not two.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from cpattn.attention.ops.merge import merge_rows
from cpattn.cluster.client_graphs import ClientLayerGraphs, use_client_graphs
from cpattn.cluster.client_device import choose_data_plane, client_device
from cpattn.cluster.client_group import GroupMembership
from cpattn.cluster.client_run import (FIRST_RUN_STEPS, RUN_IDLE_S, BegunStep, DecodeRun, PendingCommit, Phases,
                                       RunControl, RunReaper)
from cpattn.cluster.data_plane import CMD_ABORT, CMD_ATTEND, DataPlane, LocalWorkError, WireError, partial_tag
from cpattn.cluster.decode_graphs import DecodeGraphs
from cpattn.cluster.decode_run_plans import use_block_tables
from cpattn.cluster.lease import LeaseKeeper
from cpattn.cluster.messages import EndStepReply, Rejoin, StepPlans
from cpattn.cluster.page_delta import PageCache
from cpattn.cluster.step_run import finish_deferred_commit
from cpattn.cluster.wire_messages import LayerMessage
from cpattn.cluster.wire_select import blank_layer, post_layer, post_partials, rows_disjoint, selection_of
from cpattn.cluster.layer_runner import PlannedStep, ShardLayerRunner, lse_wire_dtype
from cpattn.cluster.rpc import call, call_across_restart
from cpattn.config import ServiceConfig
from cpattn.errors import CpattnError

logger = logging.getLogger("cpattn")

RUN_KEEPING_CALLS = ("sequence_length", "list_sequences", "add_sequence", "describe")
"""Coordinator calls that only read (or add a sequence): a decode run goes on across them."""


@dataclass
class StepWire:
    """What one open step needs per layer: local plans and the rows each remote rank returns."""

    step_id: int
    num_tokens: int
    local: dict[int, PlannedStep]
    remote_rows: dict[int, torch.Tensor | None]
    """rank -> (R,) int64 rows on the gateway's device (None = all T); ranks with no rows are absent."""
    norms: torch.Tensor | None = None
    """(L,) float32 on a CUDA gateway with nan_policy 'reject': max |q|k|v| of each attended layer, NaN or
    inf when they held one; read once, at the end of the step (a read per layer would stall the GPU)."""
    broken: list[torch.Tensor] = field(default_factory=list)
    """Per received partial: a 0-dim bool, True if it did not arrive whole (read once, at the end)."""
    graphs: ClientLayerGraphs | None = None
    """Set when every layer of this step replays the client's captured graph (cluster.client_graphs)."""
    selection: dict[int, tuple[torch.Tensor | None, torch.Tensor | None]] | None = None
    """A selected step (cluster/wire_select.py): remote rank -> (its query rows, its K/V rows) on the gateway's
    device (None: all T); each gets its own message instead of the broadcast. None: broadcast."""
    sent_bytes: int = 0
    """Bytes of layer messages this client sent to remote shards in the step, each counted once (a broadcast too;
    not what a replayed client graph sends: cluster/client_graphs.py)."""
    disjoint: bool = False
    """Every row is computed by exactly one shard (a prefill split across them): the merge is a scatter."""

    def saw_nonfinite(self) -> bool:
        return self.norms is not None and not bool(torch.isfinite(self.norms).all())


class Gateway(RunControl, GroupMembership):
    """One client's side of the service. Its ``client_id`` is public (group names, stats); its ``credential``
    is the secret every coordinator call proves; a LeaseKeeper thread keeps the client alive between calls."""

    def __init__(self, coordinator, config: ServiceConfig, on_lapse: str = "free", credential: str | None = None,
                 registered: dict | None = None):
        self.coordinator = coordinator
        self.config = config
        self.device = client_device(config)
        self.plane: DataPlane | None = None
        self.plane_broken = False      # a collective failed: rebuild the group before the next step
        self.local: dict[int, ShardLayerRunner] = {}
        self.local_graphs: dict[int, DecodeGraphs | None] = {}
        self.pages = PageCache()   # pages of this client's sequences on its in-process shards
        self.client_graphs: ClientLayerGraphs | None = None
        self.user_graphs: weakref.WeakSet = weakref.WeakSet()   # the caller's decode graphs (cpattn.decode_graph)
        self.remote: list[int] = []
        self.shards: list = []
        self.pending: PendingCommit | None = None
        self.run: DecodeRun | None = None
        self.run_length = FIRST_RUN_STEPS   # steps the next decode run asks for (client_run.FIRST_RUN_STEPS)
        self._run_lock = threading.RLock()
        self._reaper: RunReaper | None = None
        self.open_step = None
        self.ended = False   # close() or shutdown(): a step still open then is refused at its next attend
        self.last_step_timings: dict[str, float] = {}
        self._guard = threading.Lock()
        self._reaped = threading.Condition(self._guard)
        self._store = None
        self._generation = 0
        self._ticket: str | None = None
        if registered is None:   # connect() registers first: only a client may read the service's config
            registered = call(coordinator.register_client.remote(on_lapse, credential), config.rpc_timeout_s,
                              "register_client")
        self.client_id: str = registered["client_id"]
        self.credential: str = registered["credential"]
        self.lease = LeaseKeeper(coordinator, self.credential, config.client_lease_s)
        self.lease.start()
        try:
            self.join()
        except BaseException:
            self.lease.stop()   # the lease lapses and the coordinator reclaims this half-made client
            raise

    # Coordinator calls ---------------------------------------------------------------------------
    def call(self, method: str, *args, timeout_s: float | None = None):
        """A coordinator call proving this client's credential, after its previous commit was confirmed (and
        its decode run ended, unless the call only reads)."""
        self.flush(end_run=method not in RUN_KEEPING_CALLS)
        return call(getattr(self.coordinator, method).remote(self.credential, *args),
                    timeout_s or self.config.rpc_timeout_s, method)

    def end_step(self, step_id: int, commit: bool, why: str | None, done: int | None = None,
                 ends_run: bool = False) -> EndStepReply:
        """end_step, asked again across a detached coordinator's restart (it knows from its journal whether
        the step committed, else raises StepFencedError: run the step again)."""
        cfg = self.config
        return call_across_restart(
            lambda: self.coordinator.end_step.remote(step_id, commit, why, self.credential, done, ends_run),
            cfg.rpc_timeout_s + cfg.start_timeout_s, "end_step", cfg.rpc_timeout_s if cfg.detached else 0.0)

    def end_step_async(self, step_id: int, done: int | None = None, ends_run: bool = False):
        return self.coordinator.end_step.remote(step_id, True, None, self.credential, done, ends_run)

    def flush(self, end_run: bool = False, continuing: dict | None = None) -> None:
        """Read the answers to commits sent without waiting; replay or report a step that failed after all.
        A decode run ends here (``end_run``) unless a step ``continuing`` it is about to begin."""
        with self._run_lock:
            run = self.run
            if run is not None and continuing is not None and run.continues(continuing):
                pass   # the run's commits are read when it ends (a read per step would be a round trip per step)
            elif run is not None and (continuing is not None or (end_run and self.open_step is None)):
                self.end_run()   # not under an open step of it: its shards wait for that step's layers
            elif run is not None and run.commits:
                commits, run.commits = run.commits, []
                call(commits, self.config.rpc_timeout_s, "end_step")
        pending, self.pending = self.pending, None
        if pending is not None:
            finish_deferred_commit(self, pending)

    def committed(self, timings: dict[str, float], report: EndStepReply, earlier: list[dict] = ()) -> None:
        """Completes a committed step's timings (the Step's own dict, in place) with what the shards reported;
        a decode run's shards report once for all its steps (``earlier`` and this one), shared out evenly."""
        steps = [*earlier, timings]
        for t in steps:
            t["plan_s"] += report.shard_plan_s / len(steps)
            t["attention_s"] = report.attention_s / len(steps)
        timings["shard_graphed_steps"] = report.shard_graphed_steps   # of the whole run
        self.last_step_timings = dict(timings)

    def wait_for_device(self, wire: StepWire) -> None:
        """Before a commit: the step's GPU work (KV writes included) is done and every partial arrived whole.

        Bounded by collective_timeout_s: a dead NCCL peer leaves our stream waiting, never the caller;
        then the group is aborted (releasing the stream) and WireError raised.
        """
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.device))
            deadline = time.monotonic() + self.config.collective_timeout_s
            while not done.query():
                if time.monotonic() > deadline:
                    if self.plane is not None:
                        self.plane.abort()
                    raise WireError(f"step {wire.step_id}: the data plane did not finish within collective_timeout_s="
                                    f"{self.config.collective_timeout_s}s (a shard died or hung)")
                time.sleep(0)
        if wire.broken and bool(torch.stack([b.any() for b in wire.broken]).any()):
            raise WireError(f"step {wire.step_id}: a shard's partial did not arrive whole (the shard died or its "
                            "collective was aborted)")

    def begin(self, request: dict[str, int]) -> BegunStep | None:
        """Plan a step (or take the next step of this client's decode run); None when the service moved to a
        new epoch (rejoin, then begin again)."""
        cfg = self.config
        phases = Phases()   # begin's time by phase (StepRun.timings["begin_parts"])
        with self._run_lock:
            run = self.run
            if run is not None and run.continues(request):
                begun = self._next_in_run(run, list(request), phases)
                if begun is not None:
                    return begun
            phases.mark("end_run", self.end_run())
        if self.plane_broken:
            self.rejoin()
        held = self.pages.held(list(request), sorted(self.local)) if self.local else None
        ahead = min(cfg.decode_run_steps, self.run_length) if cfg.async_commit and not cfg.detached else 1
        info = self.call("begin_step", self.group_name, request, self.epoch, sorted(self.local), held, ahead,
                         None if self.plane is None else self.plane.backend,
                         timeout_s=cfg.rpc_timeout_s + cfg.start_timeout_s)
        if phases.mark("begin_rpc", isinstance(info, Rejoin)):
            return None
        # Block tables came as deltas (cluster/page_delta.py), one for a whole run.
        tables = {r: self.pages.apply(r, info.seq_ids, info.local_pages[r]) for r in info.local_plans}
        use_block_tables([info], tables)
        use_block_tables(info.later, tables)
        if info.later:
            self.run = DecodeRun(dict(request), info, info.later, info.num_tokens, index=1)
            if self._reaper is None:
                self._reaper = RunReaper(self.end_idle_run, min(RUN_IDLE_S, cfg.collective_timeout_s / 4))
                self._reaper.start()
        phases.mark("tables")
        return self._open(info, info.num_tokens, info.seq_ids, info.plan_s, phases)

    def _open(self, info: StepPlans, num_tokens: int, seq_ids: list[str], plan_s: float, phases: Phases
              ) -> BegunStep:
        """The step's wire: its local shards planned (graph buffers refilled), remote rows on this device."""
        cfg = self.config
        phases.mark("local_plans", local := {r: self.local[r].plan(p, self.local_graphs.get(r))
                                             for r, p in info.local_plans.items()})
        remote_rows = {r: (None if rows is None else rows.to(self.device))
                       for r, rows in info.remote_rows.items()}
        norms = None
        if self.device.type == "cuda" and cfg.nan_policy == "reject":
            norms = torch.zeros(cfg.num_layers, dtype=torch.float32, device=self.device)
        wire = StepWire(info.step_id, num_tokens, local, remote_rows, norms,
                        selection=selection_of(info.remote_kv_rows, remote_rows, self.device),
                        disjoint=rows_disjoint([p.rows for p in info.local_plans.values()]
                                               + list(info.remote_rows.values()), num_tokens))
        phases.mark("wire")
        use_client_graphs(self.client_graphs, wire, norms)
        phases.mark("client_graphs")
        return BegunStep(info.step_id, num_tokens, seq_ids, plan_s, wire, phases)

    def attend(self, wire: StepWire, layer: int, message: LayerMessage, sinks_Q: torch.Tensor | None = None
               ) -> torch.Tensor:
        """One layer: broadcast to remote shards, compute the local ones, merge every partial here; ``sinks_Q`` (sink
        logits per query head) enter after the merge. A torch.distributed failure is a WireError, this process's own
        work's a LocalWorkError; either way the group is rebuilt before the next step (partials may be in flight)."""
        try:
            return self._attend(wire, layer, message, sinks_Q)
        except LocalWorkError:
            self.plane_broken = self.plane is not None
            raise
        except RuntimeError as exc:
            self.plane_broken = True
            raise WireError(f"data plane: {type(exc).__name__}: {exc}") from exc

    def _attend(self, wire: StepWire, layer: int, message: LayerMessage, sinks_Q: torch.Tensor | None
                ) -> torch.Tensor:
        cfg = self.config
        q, k, v = message.q, message.k, message.v
        if wire.graphs is not None and sinks_Q is None:
            return wire.graphs.run(layer, q, k, v)
        sending = post_layer(self.plane, wire, self.remote, cfg, self.device, CMD_ATTEND, layer, message)
        # NCCL: the remote partials' receives go first, so each lands while the in-process shards compute.
        posted = post_partials(self.plane, wire, self.remote, cfg, self.device) if self.runs_ahead else None
        # The in-process shards compute while the sends are in flight (gloo: its threads; NCCL: its stream).
        parts = _local_partials(self.local, wire, layer, q, k, v)
        if sending:
            self.plane.finish(sending)
        posted = iter(posted or ())
        for i, r in enumerate(self.remote):
            if r not in wire.remote_rows:
                continue
            rows = wire.remote_rows[r]
            if self.runs_ahead:
                one = next(posted)[1]
            else:   # gloo: one receive at a time, each waited for before the next is posted (as before NCCL's)
                n = wire.num_tokens if rows is None else rows.numel()
                one = self.plane.post_partial(i + 1, n, cfg.num_q_heads, cfg.head_size, cfg.torch_dtype,
                                              lse_wire_dtype(cfg.torch_dtype), self.device)
            out, lse, broken = self.plane.take_partial(one, self.device, partial_tag(wire.step_id, layer))
            wire.broken.append(broken)
            parts.append((rows, out, lse))
        return _merged(parts, wire, sinks_Q)

    def abort_wire(self, wire: StepWire, remaining: int) -> None:
        """Release the remote shards still waiting for this step's ``remaining`` layers (messages of a layer's size).

        gloo shards read each header, so one ABORT ends their step. NCCL shards enqueued every layer ahead
        (shard._serve_layers_ahead): each remaining layer gets its ABORT message, and the partials they
        compute from it are drained, so no operation is left waiting on either side.
        """
        if self.plane is None:
            return
        cfg = self.config
        unused = blank_layer(wire, cfg, self.device)
        if not self.runs_ahead:
            self.plane.finish(post_layer(self.plane, wire, self.remote, cfg, self.device, CMD_ABORT, -1, unused))
            return
        for _ in range(remaining):
            self.plane.finish(post_layer(self.plane, wire, self.remote, cfg, self.device, CMD_ABORT, -1, unused))
            for _rows, posted in post_partials(self.plane, wire, self.remote, cfg, self.device):
                self.plane.take_partial(posted, self.device, 0)

    @property
    def runs_ahead(self) -> bool:
        """Remote shards enqueue a step's layers ahead (NCCL): the step must attend layers in order."""
        return self.plane is not None and self.plane.backend == "nccl"

    def stop_threads(self) -> None:
        """The lease keeper and the run reaper end (the service ends this client's lease on its own)."""
        self.lease.stop()
        if self._reaper is not None:
            self._reaper.stop()

    def close(self) -> None:
        """End this client (its sequences stay); the service keeps running."""
        try:
            self.flush(end_run=True)
        except CpattnError as exc:
            logger.warning("closing client %s: %s", self.client_id, exc)
        self.stop_threads()
        self.leave()
        try:   # waited for, so what the client held is settled when close() returns
            call(self.coordinator.unregister_client.remote(self.credential), self.config.rpc_timeout_s,
                 "unregister_client")
        except CpattnError as exc:
            logger.warning("closing client %s: %s", self.client_id, exc)


__all__ = ["Gateway", "StepWire", "PendingCommit", "choose_data_plane", "client_device"]


@contextmanager
def _local_work(what: str) -> Iterator[None]:
    """Errors of this process's own compute become LocalWorkError (an allocation on a full GPU, a kernel's error);
    a torch.distributed error raised in here (an NCCL kernel's failure surfacing late) stays the wire's."""
    try:
        yield
    except torch.distributed.DistError:
        raise
    except RuntimeError as exc:
        raise LocalWorkError(f"{what}: {type(exc).__name__}: {exc}") from exc


def _local_partials(local: dict[int, ShardLayerRunner], wire: StepWire, layer: int, q: torch.Tensor,
                    k: torch.Tensor, v: torch.Tensor) -> list[tuple]:
    """(rows, out, lse) of each in-process shard for this layer."""
    with _local_work(f"in-process shard(s) {sorted(wire.local)} on {q.device}"):
        return [(step.rows, *local[r].run_layer(step, layer, q, k, v)) for r, step in wire.local.items()]


def _merged(parts: list[tuple], wire: StepWire, sinks_Q: torch.Tensor | None) -> torch.Tensor:
    with _local_work("merging the shards' partials"):
        if len(parts) == 1 and sinks_Q is None and any(s.graphs is not None for s in wire.local.values()):
            return parts[0][1].clone()   # the graph's buffer is overwritten when this layer replays
        return merge_rows(parts, wire.num_tokens, sinks_Q, wire.disjoint)
