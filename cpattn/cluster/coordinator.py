"""Coordinator: the remote methods of a service, in the order their checks and effects happen.

A plain class; ``ray.remote`` is applied in ``cluster.service`` (to ``RemoteCoordinator``, which checks
every caller first). It orchestrates state owners, each tested alone: ClientRegistry (credentials,
leases), SequenceTable (sequences, pages, growth), OpenSteps (steps, shard threads), StepLedger (a step's
life on those, and end_step's answers), Generations (epoch, incarnation, the shard secret; the journal's
meta record), ShardSet (the shard actors) and ShardRecovery (replacing lost shards; each bumps the epoch).
Its sequence methods are in coordinator_sequences.py, extend_run in coordinator_runs.py. It plans each step
once and hands each shard its plan in a single Ray call; per-layer tensors never pass through here.
"""

from __future__ import annotations

import logging
import threading
import time

import ray

from cpattn.cluster import authority, decode_run, generations, step_outcome
from cpattn.cluster.client_registry import ClientRegistry
from cpattn.cluster.coordinator_runs import RunExtensionMethods
from cpattn.cluster.coordinator_sequences import SequenceMethods
from cpattn.cluster.generations import Generations
from cpattn.cluster.journal import CoordinatorJournal
from cpattn.cluster.messages import BeginStepReply, EndStepReply, Rejoin, ShardsReply
from cpattn.cluster.metrics import ServiceMetrics
from cpattn.cluster.open_steps import OpenSteps, check_local_ranks
from cpattn.cluster.prefix_sharing import PrefixSharing
from cpattn.cluster.sequence_table import SequenceTable
from cpattn.cluster.shard_recovery import ShardRecovery
from cpattn.cluster.shard_set import ShardSet
from cpattn.cluster.step_ledger import StepLedger
from cpattn.cluster.usage import usage_report
from cpattn.config import ServiceConfig
from cpattn.errors import CpattnError, InvalidRequestError

logger = logging.getLogger("cpattn.coordinator")

# A failed step ends within collective_timeout_s (the client's wire error) + this: the coordinator waits at most
# this long for a lost shard's replacement (else the step ends with a ServiceError, the replacement goes on).
END_STEP_SETTLE_S = 7.0


def _still_running(refs: list) -> list:
    return ray.wait(refs, num_returns=len(refs), timeout=0)[1]


class Coordinator(SequenceMethods, RunExtensionMethods):
    def __init__(self, config: ServiceConfig, backend_registry: dict | None = None,
                 operator_digest: str | None = None):
        self.config = config
        self._lock = threading.RLock()
        self.gen = Generations()
        # SHA-256 of the operator credential made by whoever started the service (cluster.authority).
        self._operator_digest = operator_digest
        self._started = False
        self.shard_set = ShardSet(config, backend_registry, self.gen.shard_secret, operator_digest)
        # A detached service persists its committed state so Ray can restart this actor without loss.
        self.journal = CoordinatorJournal(config.namespace, config.name) if config.detached else None
        self.clients = ClientRegistry()
        self.table = SequenceTable(config, self.journal)
        self.steps = OpenSteps(config.max_open_steps, _still_running)
        self.metrics = ServiceMetrics(config.name)
        self.ledger = StepLedger(config, self.table, self.steps, self.metrics, self._new_step_id)
        self.sharing = PrefixSharing(self.table, lambda: self.gen.shard_secret, pending=self.steps.pending_lengths)
        self.recovery = ShardRecovery(self.shard_set, self.table, self._lock, self._shard_replaced)
        self._stop = threading.Event()
        self.restored = False
        if self.journal is not None:
            self._restore(*self.journal.load())

    def _restore(self, meta: dict, records: dict) -> None:
        """Restarted by Ray (the journal holds ``meta``): re-attach to the detached shards, rebuild sequences."""
        if meta is None:
            return
        generations.restore(meta, records, self.gen, self.table, self.clients, self.steps)
        self.shard_set.secret = self.gen.shard_secret
        self.shard_set.attach(meta["bundles"])
        self._persist_meta()    # a restart during the fence below must not reuse this incarnation
        self.recovery.fence(self.gen.incarnation)
        self.restored = True
        self.recovery.start_watching(self._stop, self.expire_clients)
        logger.warning("coordinator %r restarted: restored %d sequences, %d clients", self.config.name, len(records),
                       len(self.clients))

    def _persist_meta(self) -> None:
        if self.journal is not None:
            self.journal.put_meta(generations.meta_record(self.gen, self.table, self.clients, self.steps,
                                                          self.shard_set.bundles))

    def authorize(self, rule: authority.Rule, proof, arguments: dict, method: str) -> None:
        """The remote surface calls this before every method (cluster.authority)."""
        def is_client(p) -> bool:
            with self._lock:
                return self.clients.is_connected(p)
        authority.authorize_coordinator_call(rule, proof, method, f"coordinator {self.config.name!r}",
                                             self._operator_digest, is_client)

    # Lifecycle ------------------------------------------------------------------------------------
    def start(self, operator_credential: str) -> list[dict]:
        """Place and start the shards (ShardSet cleans up if any part fails), then watch them. Once."""
        with self._lock:
            if self._started or self.restored:
                raise InvalidRequestError(f"service {self.config.name!r} is already started")
            self._started = True
        self.shard_set.start()
        self._persist_meta()
        self._publish_blocks_used()
        self.recovery.start_watching(self._stop, self.expire_clients)
        first = self.shard_set.infos[0]
        logger.info("cpattn service %r: %d shards, backend %s (%s)", self.config.name, self.config.num_shards,
                    first.backend, first.kernel_version)
        return self.shard_set.infos

    def describe(self, credential: str) -> dict:
        return {"config": self.config.model_dump(), "shards": [i.as_dict() for i in self.shard_set.infos], "lost": dict(self.shard_set.lost),
                "epoch": self.gen.epoch, "restored": self.restored, "incarnation": self.gen.incarnation,
                "coordinator_node_id": ray.get_runtime_context().get_node_id()}

    def get_shards(self, credential: str) -> ShardsReply:
        """Shard handles for the caller's data-plane group (their join and leave methods need its tickets)."""
        with self._lock:
            return ShardsReply(self.gen.epoch, list(self.shard_set.handles), list(self.shard_set.infos))

    def shutdown(self, operator_credential: str) -> None:
        self._stop.set()
        self.shard_set.teardown()
        if self.journal is not None:
            self.journal.clear()

    def _shard_replaced(self) -> None:
        """Under the lock, after a replacement: clients rebuild their groups on the new epoch."""
        self.gen.shard_replaced()
        self._persist_meta()

    # Clients --------------------------------------------------------------------------------------
    def register_client(self, on_lapse: str = "free", credential: str | None = None) -> dict:
        """A new client, or (with the credential of one that ended keeping its sequences) that client again."""
        with self._lock:
            if credential is not None:
                client_id = self.clients.resume(credential, on_lapse)
            else:
                client_id, credential = self.clients.register(on_lapse)
            self._persist_meta()
        return {"client_id": client_id, "credential": credential, "config": self.config.model_dump()}

    def renew(self, credential: str) -> bool:
        """A client's heartbeat; False when the client has ended (its lease lapsed): it must connect again."""
        with self._lock:
            return self.clients.renew(credential)

    def unregister_client(self, credential: str) -> None:
        """close(): end the client (open step rolled back, groups dropped); its sequences stay."""
        with self._lock:
            client_id = self.clients.client_of(credential)
        if client_id is not None:
            self._end_client(client_id, "closed", free_sequences=False)

    def group_ticket(self, credential: str, group_name: str) -> str:
        """What a client shows a shard to join (or leave) a data-plane group named after itself: one join per
        group, within client_lease_s, and void once the client ends (authority.make_ticket)."""
        with self._lock:
            client_id = self.clients.check(credential)
            if not isinstance(group_name, str) or not group_name.startswith(f"{client_id}-"):
                raise InvalidRequestError(f"group {group_name!r} is not this client's: name it {client_id}-...")
            return authority.make_ticket(self.gen.shard_secret, group_name, client_id, time.time())

    def expire_clients(self) -> list[str]:
        """End every client whose lease lapsed (no call or heartbeat for client_lease_s)."""
        lease = self.config.client_lease_s
        with self._lock:
            lapsed = self.clients.lapsed(lease)
        for client_id in lapsed:
            self._end_client(client_id, f"its lease lapsed (no call or heartbeat for {lease:g}s)")
        return lapsed

    def _end_client(self, client_id: str, why: str, free_sequences: bool | None = None) -> None:
        """Roll back the client's open steps, free (or keep) its sequences, drop its groups on every shard."""
        with self._lock:
            lease = self.clients.end(client_id)
            if lease is None:
                return
            rolled_back = self.ledger.roll_back(client_id)
            if free_sequences is None:
                free_sequences = lease.on_lapse == "free"
            freed = self.table.free_idle_of(client_id) if free_sequences else []
            if not self.table.owned_by(client_id):
                # Nothing kept: the credential is forgotten. Otherwise connect(credential=...) resumes the client.
                self.clients.forget(client_id)
            self._persist_meta()
            self._publish_blocks_used()
            shards = [h for h in self.shard_set.handles if h is not None]
            ended_at = time.time()   # tickets issued before this are void on every shard
        self.shard_set.drop_client(shards, client_id, ended_at)
        if why != "closed" or rolled_back:
            logger.warning("client %s ended: %s; rolled back %d open step(s), freed %d sequence(s)", client_id, why,
                           len(rolled_back), len(freed))

    # Steps ----------------------------------------------------------------------------------------
    def begin_step(self, credential: str, group_name: str, request: dict, epoch: int | None = None,
                   local_ranks: list[int] | tuple[int, ...] = (), held: dict | None = None,
                   ahead: int = 1, wire: str | None = None) -> BeginStepReply | Rejoin:
        """Validate, allocate, plan once, and hand each remote shard its plan. Nothing changes if it raises.

        ``local_ranks``: shards on the client's GPU, whose share the client computes itself on their
        KV cache (opened by CUDA IPC); their plans come back in the reply instead of going to them, with
        block tables as deltas against ``held`` ({seq_id: {rank: (version, pages)}}, cluster/page_delta.py).
        ``ahead`` > 1 on a decode-only request plans a decode run of up to that many steps (cluster/decode_run.py):
        the reply's ``later`` holds the plans of its steps after the first. ``wire``: the client's data-plane
        backend (nccl, gloo; None without remote shards), which decides how a prefill's layers travel.
        A client whose data-plane group predates a shard replacement gets ``Rejoin(epoch)`` back
        (nothing planned) and rebuilds its group first.
        """
        t0 = time.perf_counter()
        if self.shard_set.lost:
            self.recovery.recover()
        with self._lock:
            try:
                client_id = self.clients.check(credential)
                if not isinstance(group_name, str) or not group_name.startswith(f"{client_id}-"):
                    raise InvalidRequestError(f"data-plane group {group_name!r} is not this client's")
                if epoch is not None and epoch != self.gen.epoch:
                    return Rejoin(self.gen.epoch)
                local = check_local_ranks(local_ranks, self.config.num_shards, self.config.in_process_refusal())
                admitted = self.ledger.admit(client_id, request, ahead, len(self.clients))
            except CpattnError as exc:
                self.metrics.record_error(type(exc).__name__)
                raise
            step, runs = self.ledger.open(admitted, local, self.gen, wire if wire in ("nccl", "gloo") else None,
                                          group_name)
            shards = list(self.shard_set.handles)
        step.refs = [h.run_step.remote(group_name, *decode_run.shard_plans(runs, rank))
                     for rank, h in enumerate(shards) if rank not in local]
        step.plan_s = time.perf_counter() - t0
        return self.ledger.reply(step, admitted.seqs, admitted.request, runs, held, self.gen.epoch)

    def _new_step_id(self, count: int = 1) -> int:
        step_id, reserve = self.steps.new_id(count)
        if reserve:
            self._persist_meta()
        return step_id

    def end_step(self, step_id: int, commit: bool, data_plane_error: str | None = None,
                 credential: str | None = None, done: int | None = None, ends_run: bool = False) -> EndStepReply:
        """Commit (lengths advance) or roll back (pages return).

        A failed step is rolled back; lost shards are replaced. Returns ``recovered=True`` when
        every sequence of the step survived (the client may replay it); raises ShardLostError
        naming the sequences whose KV was lost otherwise. A decode run (``step_id`` its first step) says
        in ``done`` how many of its steps completed: a commit before its last one advances the lengths and
        returns at once unless ``ends_run`` (the client left the run: the rest of its pages return);
        ``commit=False`` keeps the first ``done`` steps and rolls back the one in flight.
        """
        with self._lock:
            step = self.steps.of(step_id, self.clients.check(credential))
            if step is None:
                return self.ledger.unknown(step_id)
            kept = self.ledger.num_kept(step, commit, done)
            if commit and kept < step.num_substeps and not ends_run:   # a run goes on: nothing to wait for
                self.ledger.advance(step, kept)
                return EndStepReply(advanced=kept)
            self.ledger.start_ending(step)
        try:   # one end_step of a step waits for its shards at a time (ledger.start_ending)
            reports, failure = self.recovery.step_failure(step, data_plane_error, lambda: self.gen.epoch)
            if failure is not None:
                kept = min(kept, step.num_substeps - 1)   # the step in flight (a plain step: the step) failed
                self.recovery.settle(time.monotonic() + END_STEP_SETTLE_S)
            with self._lock:
                self.ledger.check_still_open(step)
                self.clients.touch(step.client_id)
                step.done = max(step.done, kept)
                self.ledger.close(step, committed=commit and failure is None, drain=failure is not None)
                self._publish_blocks_used()
            if failure is None:
                return step_outcome.shard_timings(reports)
            # Rolled back: run it again now or later, unless a shard was replaced meanwhile and this step's KV is lost.
            with self._lock:
                self.ledger.raise_unless_replaced(step, failure, dict(self.shard_set.lost), self.shard_set.silent,
                                                  self.gen.epoch)
            self.recovery.recover()   # a no-op when the health thread already replaced the shard (epoch moved on)
            with self._lock:
                self.ledger.check_survived(step)
            return EndStepReply(recovered=True, epoch=self.gen.epoch, failure=failure)
        finally:
            step.ending = False

    # Stats ----------------------------------------------------------------------------------------
    def stats(self, credential: str | None = None, admin: bool = False) -> dict:
        """Service-wide usage: ``clients`` lists the caller's own client only, ``other_clients`` counts the rest;
        ``admin=True`` (operators: ``cpattn status``) lists every client by its public id."""
        if admin and not authority.matches_digest(credential, self._operator_digest):
            raise authority.refuse(f"coordinator {self.config.name!r}", "stats(admin=True)",
                                   "it needs the operator credential (`cpattn status` finds it; see README Security)")
        with self._lock:
            return usage_report(self.config, self.table, self.shard_set, self.clients.client_of(credential), admin,
                                self.clients, self.steps, {"shards_replaced": self.gen.num_shards_replaced,
                                                           "epoch": self.gen.epoch})


RemoteCoordinator = authority.remote_surface(Coordinator, authority.COORDINATOR_METHODS, "RemoteCoordinator", __name__)
"""What Ray runs (cluster.service): only the methods of authority.COORDINATOR_METHODS, each checked."""
