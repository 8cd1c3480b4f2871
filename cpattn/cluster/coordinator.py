"""Coordinator: the remote methods of a service, in the order their checks and effects happen.

A plain class; ``ray.remote`` is applied in ``cluster.service`` (to ``RemoteCoordinator``, which checks
every caller first). It orchestrates state owners, each tested alone: ClientRegistry (credentials,
leases), SequenceTable (sequences, pages, growth), OpenSteps (steps, shard threads), ShardSet (the shard
actors) and ShardRecovery (replacing lost shards; each replacement bumps ``epoch``). It plans each step
once and hands each shard its plan in a single Ray call; per-layer tensors never pass through here.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time

import ray

from cpattn.cluster import authority, decode_run, step_outcome
from cpattn.cluster.client_registry import ClientRegistry
from cpattn.cluster.journal import CoordinatorJournal
from cpattn.cluster.metrics import ServiceMetrics
from cpattn.cluster.ids import new_sequence_id
from cpattn.cluster.open_steps import STEP_ID_RESERVE, OpenStep, OpenSteps, check_local_ranks, check_step_size
from cpattn.cluster.prefix_sharing import PrefixSharing
from cpattn.cluster.sequence_table import SequenceTable
from cpattn.cluster.shard_recovery import ShardRecovery
from cpattn.cluster.shard_set import ShardSet
from cpattn.cluster.usage import usage_report
from cpattn.cluster.step_planner import StepRequest, plan_step
from cpattn.config import ServiceConfig
from cpattn.errors import CpattnError, InvalidRequestError, ShardLostError

logger = logging.getLogger("cpattn.coordinator")

# A failed step ends within collective_timeout_s (the client's wire error) + this: the coordinator waits at most
# this long for a lost shard's replacement (else the step ends with a ServiceError, the replacement goes on).
END_STEP_SETTLE_S = 7.0


def _still_running(refs: list) -> list:
    return ray.wait(refs, num_returns=len(refs), timeout=0)[1]


class Coordinator:
    def __init__(self, config: ServiceConfig, backend_registry: dict | None = None,
                 operator_digest: str | None = None):
        self.config = config
        self._lock = threading.RLock()
        # Proves to shards that a call (KV reads/writes, plans, fencing) or a group join comes from this service.
        self._shard_secret = secrets.token_hex(32)
        # SHA-256 of the operator credential made by whoever started the service (cluster.authority).
        self._operator_digest = operator_digest
        self._started = False
        self.shard_set = ShardSet(config, backend_registry, self._shard_secret, operator_digest)
        # A detached service persists its committed state so Ray can restart this actor without loss.
        self.journal = CoordinatorJournal(config.namespace, config.name) if config.detached else None
        self.clients = ClientRegistry()
        self.table = SequenceTable(config, self.journal)
        self.steps = OpenSteps(config.max_open_steps, _still_running)
        self.sharing = PrefixSharing(self.table, lambda: self._shard_secret)
        self.recovery = ShardRecovery(self.shard_set, self.table, self._lock, self._shard_replaced)
        self.epoch = 0                       # bumped by every shard replacement; clients rejoin on a new one
        # Bumped by every coordinator restart; every plan carries it and shards refuse older ones once fenced.
        self.incarnation = 1
        self.num_shards_replaced = 0
        self._stop = threading.Event()
        self.metrics = ServiceMetrics(config.name)
        self.restored = False
        if self.journal is not None:
            self._restore(*self.journal.load())

    def _restore(self, meta: dict, records: dict) -> None:
        """Restarted by Ray (the journal holds ``meta``): re-attach to the detached shards, rebuild sequences."""
        if meta is None:
            return
        self._shard_secret = meta.get("shard_secret", self._shard_secret)
        self.shard_set.secret = self._shard_secret
        self.shard_set.attach(meta["bundles"])
        self.table.restore(records)
        self.clients.restore(meta)
        self.table.dropped = dict(meta["dropped"])
        self.steps = OpenSteps(self.config.max_open_steps, _still_running, meta["next_step"])
        self.incarnation = meta.get("incarnation", 1) + 1
        self.epoch = meta["epoch"] + 1   # every client rebuilds its data-plane group (old ones may hold fenced steps)
        self._persist_meta()    # a restart during the fence below must not reuse this incarnation
        self.recovery.fence(self.incarnation)
        self.restored = True
        self.recovery.start_watching(self._stop, self.expire_clients)
        logger.warning("coordinator %r restarted: restored %d sequences, %d clients", self.config.name, len(records),
                       len(self.clients))

    def _persist_meta(self) -> None:
        if self.journal is not None:
            self.journal.put_meta({"epoch": self.epoch, "dropped": dict(self.table.dropped), **self.clients.to_meta(),
                                   "incarnation": self.incarnation, "shard_secret": self._shard_secret,
                                   "next_step": self.steps.next_step + STEP_ID_RESERVE,   # never reused after restart
                                   "bundles": self.shard_set.bundles})

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
                "epoch": self.epoch, "restored": self.restored, "incarnation": self.incarnation,
                "coordinator_node_id": ray.get_runtime_context().get_node_id()}

    def get_shards(self, credential: str) -> dict:
        """Shard handles for the caller's data-plane group (their join and leave methods need its tickets)."""
        with self._lock:
            return {"epoch": self.epoch, "shards": list(self.shard_set.handles), "infos": list(self.shard_set.infos)}

    def shutdown(self, operator_credential: str) -> None:
        self._stop.set()
        self.shard_set.teardown()
        if self.journal is not None:
            self.journal.clear()

    def _shard_replaced(self) -> None:
        """Under the lock, after a replacement: clients rebuild their groups on the new epoch."""
        self.epoch += 1
        self.num_shards_replaced += 1
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
            return authority.make_ticket(self._shard_secret, group_name, client_id, time.time())

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
            rolled_back = self.steps.held_by(client_id)
            for step in rolled_back:
                self._close(step, committed=False, drain=True)
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

    # Sequences ------------------------------------------------------------------------------------
    def add_sequence(self, credential: str) -> str:
        with self._lock:
            client_id = self.clients.check(credential)
            return self.table.add(client_id, new_sequence_id()).seq_id   # the id is the capability

    def free(self, credential: str, seq_id: str) -> None:
        with self._lock:
            self.table.free(seq_id, self.clients.check(credential))
            self._publish_blocks_used()

    def fork(self, credential: str, seq_id: str, num_tokens: int | None = None) -> str:
        """A new sequence of the caller sharing the first ``num_tokens`` of its ``seq_id`` (cluster/prefix_sharing.py)."""
        with self._lock:
            return self.sharing.fork(self.clients.check(credential), seq_id, num_tokens)

    def share(self, credential: str, seq_id: str, num_tokens: int | None = None, ttl_s: float = 3600.0) -> str:
        """A token another client passes to fork_shared to fork the caller's ``seq_id``."""
        with self._lock:
            return self.sharing.share(self.clients.check(credential), seq_id, num_tokens, ttl_s)

    def fork_shared(self, credential: str, token: str) -> str:
        """A new sequence of the caller holding the prefix a share token grants."""
        with self._lock:
            return self.sharing.fork_shared(self.clients.check(credential), token)

    def list_sequences(self, credential: str) -> dict[str, int]:
        with self._lock:
            return self.table.lengths_of(self.clients.check(credential))

    def sequence_length(self, credential: str, seq_id: str) -> int:
        with self._lock:
            client_id = self.clients.check(credential)
            self.table.raise_if_unavailable([seq_id], client_id)
            return self.table.get(seq_id, client_id).length

    def fill_synthetic(self, credential: str, seq_id: str, num_tokens: int, seed: int) -> int:
        """Append ``num_tokens`` of seeded random KV to a sequence without attention (benchmarks, load tests)."""
        with self._lock:
            client_id = self.clients.check(credential)
            self.table.raise_if_unavailable([seq_id], client_id)
            seq = self.table.get(seq_id, client_id)
            if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**40:
                raise InvalidRequestError(f"seed {seed!r} must be an int in 0..2**40")
            self.table.check_growth(seq, num_tokens, "num_tokens", "in")
            self.table.check_quota(client_id, num_tokens)
            growth = self.table.grow([seq], [seq.length + num_tokens])
            plans = plan_step(self.table.allocator, [StepRequest(seq.rows, seq.length, num_tokens)], 0, False, 1,
                              self.incarnation, self._shard_secret, growth=growth)
            self.table.begin([seq], -1)
            shards = list(self.shard_set.handles)
        try:
            ray.get([h.fill_synthetic.remote(p, seed) for h, p in zip(shards, plans)], timeout=self.config.rpc_timeout_s)
        except BaseException:
            with self._lock:
                self.table.undo(growth, [seq.seq_id], -1)
            raise
        with self._lock:
            self.table.commit([seq.seq_id], [seq.length + num_tokens], seq.last_step)
            self.table.finish(growth)
            return seq.length

    # Steps ----------------------------------------------------------------------------------------
    def begin_step(self, credential: str, group_name: str, request: dict, epoch: int | None = None,
                   local_ranks: list[int] | tuple[int, ...] = (), held: dict | None = None, ahead: int = 1) -> dict:
        """Validate, allocate, plan once, and hand each remote shard its plan. Nothing changes if it raises.

        ``local_ranks``: shards on the client's GPU, whose share the client computes itself on their
        KV cache (opened by CUDA IPC); their plans come back in the reply instead of going to them, with
        block tables as deltas against ``held`` ({seq_id: {rank: (version, pages)}}, cluster/page_delta.py).
        ``ahead`` > 1 on a decode-only request plans a decode run of up to that many steps (cluster/decode_run.py):
        the reply's ``later`` holds the plans of its steps after the first.
        A client whose data-plane group predates a shard replacement gets ``{"rejoin": epoch}`` back
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
                if epoch is not None and epoch != self.epoch:
                    return {"rejoin": self.epoch}
                local = check_local_ranks(local_ranks, self.config.num_shards)
                seqs, request = self.table.admit(client_id, request)
                num_tokens = sum(request.values())
                check_step_size(num_tokens, self.config.max_tokens_per_step)
                self.table.check_quota(client_id, num_tokens)
                self.steps.check_can_open(client_id)
                num_steps = decode_run.run_length(request, ahead, self.steps.free_threads() - 1,
                                                  len(self.clients) - 1)
                lengths = [s.length for s in seqs]
                growth = self.table.grow(seqs, [n + t for n, t in zip(lengths, request.values())])   # raises first
            except CpattnError as exc:
                self.metrics.record_error(type(exc).__name__)
                raise
            later_growths = decode_run.grow_run(self.table, client_id, seqs, num_steps)
            step_ids = [self._new_step_id() for _ in range(1 + len(later_growths))]
            try:
                runs = decode_run.plan_steps(self.table.allocator, seqs, lengths, list(request.values()), step_ids,
                                             self.config, self.incarnation, self._shard_secret,
                                             [growth, *later_growths])
            except BaseException:
                for g in reversed([growth, *later_growths]):
                    self.table.undo(g, [s.seq_id for s in seqs], step_ids[0])
                raise
            self.table.begin(seqs, step_ids[0])
            new_lengths = [n + t + len(later_growths) for n, t in zip(lengths, request.values())]
            step = OpenStep(step_ids[0], client_id, [s.seq_id for s in seqs], new_lengths, growth,
                            runs[0][0].num_tokens, self.epoch, local, later_growths=later_growths)
            self.steps.open(step)
            shards = list(self.shard_set.handles)
        step.refs = [h.run_step.remote(group_name, runs[0][rank], decode_run.later_plans(runs, rank))
                     for rank, h in enumerate(shards) if rank not in local]
        step.plan_s = time.perf_counter() - t0
        # The client's in-process shards: one block table for the whole run (its last step's pages).
        local_pages = {r: self.table.page_deltas(r, seqs, runs[-1][r].metadata.block_table_tensor, held)
                       for r in local}
        first, later = decode_run.client_steps(runs, step_ids, sorted(local))
        return {**first, "num_tokens": runs[0][0].num_tokens, "seq_ids": step.seq_ids,
                "query_lens": list(request.values()), "plan_s": step.plan_s, "epoch": self.epoch,
                "local_pages": local_pages, "later": later}

    def _new_step_id(self) -> int:
        step_id, reserve = self.steps.new_id()
        if reserve:
            self._persist_meta()
        return step_id

    def end_step(self, step_id: int, commit: bool, data_plane_error: str | None = None,
                 credential: str | None = None, done: int | None = None, ends_run: bool = False) -> dict:
        """Commit (lengths advance) or roll back (pages return).

        A failed step is rolled back; lost shards are replaced. Returns ``recovered: True`` when
        every sequence of the step survived (the client may replay it); raises ShardLostError
        naming the sequences whose KV was lost otherwise. A decode run (``step_id`` its first step) says
        in ``done`` how many of its steps completed: a commit before its last one advances the lengths and
        returns at once unless ``ends_run`` (the client left the run: the rest of its pages return);
        ``commit=False`` keeps the first ``done`` steps and rolls back the one in flight.
        """
        with self._lock:
            client_id = self.clients.check(credential)
            step = self.steps.of(step_id, client_id)
            if step is None:
                return self._unknown_step(step_id)
            kept = int(commit) if step.num_substeps == 1 else decode_run.check_done(done, step.num_substeps)
            if commit and kept < step.num_substeps and not ends_run:   # a run goes on: nothing to wait for
                if kept > step.done:
                    step.done = kept
                    self.table.advance(step.seq_ids, step.lengths_after(kept), step_id + kept - 1)
                return {"advanced": kept}
        reports, failure = self.recovery.step_failure(step, data_plane_error, lambda: self.epoch)
        if failure is not None:
            kept = min(kept, step.num_substeps - 1)   # the step in flight (a plain step: the step) failed
            self.recovery.settle(time.monotonic() + END_STEP_SETTLE_S)
        with self._lock:
            if not self.steps.is_open(step):   # rolled back meanwhile: the client's lease lapsed
                raise InvalidRequestError(f"step {step_id} was rolled back: its client ended (closed, or its lease "
                                          "lapsed); connect again and run the step again")
            self.clients.touch(step.client_id)
            step.done = max(step.done, kept)
            self._close(step, committed=commit and failure is None, drain=failure is not None)
            self._publish_blocks_used()
        if failure is None:
            return step_outcome.shard_timings(reports)
        return self._after_failure(step, failure)

    def _unknown_step(self, step_id) -> dict:
        """Under the lock: end_step of a step this coordinator does not hold open."""
        before = self.steps.before_restart(step_id)
        if before and any(s.last_step == step_id for s in self.table.sequences.values()):
            return dict(step_outcome.COMMITTED_BEFORE_RESTART)   # journalled, then the old incarnation died
        if before:
            self.metrics.record_error("StepFencedError")
        raise step_outcome.unknown_step_error(step_id, before)

    def _close(self, step: OpenStep, committed: bool, drain: bool = False) -> None:
        """Under the lock: close an open step. Its first ``step.done`` steps (a plain step: all or none) keep
        their tokens; the pages of the rest return. ``committed``: the client ended it, nothing failed."""
        self.steps.close(step, committed=committed, drain=drain)
        if step.done:
            self.table.commit(step.seq_ids, step.lengths_after(step.done), step.step_id + step.done - 1, True)
        for growth in [step.growth, *step.later_growths][:step.done]:
            self.table.finish(growth)   # copy on write: the committed steps drop the shared pages they copied
        for growth in step.growths_from(step.done):
            self.table.undo(growth, step.seq_ids, step.step_id)
        if committed:
            self.metrics.record_step(time.perf_counter() - step.started, step.num_tokens)
        else:
            self.metrics.record_rollback()

    def _after_failure(self, step: OpenStep, failure: str) -> dict:
        """A rolled-back step: say whether to run it again now, later, or (its KV lost) never."""
        lost, silent = dict(self.shard_set.lost), self.shard_set.silent
        if lost or step.epoch == self.epoch:   # else: a shard was replaced meanwhile; did this step's KV survive?
            self.metrics.record_error("ServiceError")
            raise step_outcome.failed_step_error(step.step_id, failure, silent, lost,
                                                 self.config.shard_hang_timeout_s)
        self.recovery.recover()   # a no-op when the health thread already replaced the shard (epoch moved on)
        with self._lock:
            self.table.release_dropped(step.seq_ids)   # dropped while in this step: released now it is closed
            try:
                self.table.raise_if_unavailable(step.seq_ids, step.client_id)
            except ShardLostError as exc:
                self.metrics.record_error(type(exc).__name__)
                raise
        return {"recovered": True, "epoch": self.epoch, "failure": failure}

    # Stats ----------------------------------------------------------------------------------------
    def _publish_blocks_used(self) -> None:
        self.metrics.set_blocks_used(self.table.blocks_used())

    def stats(self, credential: str | None = None, admin: bool = False) -> dict:
        """Service-wide usage. ``clients`` lists only the caller's own client (by its credential); every other
        client is counted in ``other_clients`` (aggregate). ``admin=True`` (operators: ``cpattn status``) lists
        every client by its public id."""
        if admin and not authority.matches_digest(credential, self._operator_digest):
            raise authority.refuse(f"coordinator {self.config.name!r}", "stats(admin=True)",
                                   "it needs the operator credential (`cpattn status` finds it; see README Security)")
        with self._lock:
            return usage_report(self.config, self.table, self.shard_set, self.clients.client_of(credential), admin,
                                self.clients, self.steps, {"shards_replaced": self.num_shards_replaced,
                                                           "epoch": self.epoch})


RemoteCoordinator = authority.remote_surface(Coordinator, authority.COORDINATOR_METHODS, "RemoteCoordinator", __name__)
"""What Ray runs (cluster.service): only the methods of authority.COORDINATOR_METHODS, each checked."""
