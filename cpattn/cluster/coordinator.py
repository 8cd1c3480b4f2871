"""Coordinator: owns sequences, lengths and block allocation per shard; plans each step once.

A plain class; ``ray.remote`` is applied in ``cluster.service``. Its ShardSet places and watches the
shard actors; the coordinator builds one ShardStepPlan per rank per step and hands it to each
shard with a single Ray call; per-layer tensors never pass through here.

Shard loss: a health thread pings shards; a dead or silent shard is replaced in its bundle. With
kv_replicas=2 the replacement is refilled from the replicas and every sequence continues; with 1
the sequences that had tokens on it are dropped (using them raises ShardLostError naming them) and
all others continue. Each replacement bumps ``epoch``: clients then rebuild their data-plane group.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import threading
import time
from dataclasses import dataclass, field

import ray
import torch

from cpattn.cluster import authority
from cpattn.cluster.authority import digest as _digest
from cpattn.cluster.ids import canonical_id, canonical_request
from cpattn.cluster.journal import CoordinatorJournal, SequenceUpdate
from cpattn.cluster.lease import ON_LAPSE
from cpattn.cluster.metrics import ServiceMetrics
from cpattn.cluster.recovery import refill_copies
from cpattn.cluster.shard_set import CONTROL_GROUP, ShardSet
from cpattn.cluster.page_delta import row_deltas
from cpattn.cluster.step_planner import StepRequest, plan_step
from cpattn.config import ServiceConfig
from cpattn.errors import (AccessDeniedError, CapacityError, CpattnError, InvalidRequestError, ServiceError,
                           ShardLostError, StepFencedError)
from cpattn.kvstore.sharded_allocator import Growth, SequenceRows, ShardedKVAllocator, restore_allocator

logger = logging.getLogger("cpattn.coordinator")

# A failed step ends within collective_timeout_s (the client's wire error) + this: the coordinator waits at most
# this long for a lost shard's replacement (else the step ends with a ServiceError, the replacement goes on).
END_STEP_SETTLE_S = 7.0
END_STEP_PING_S = 2.0   # one round of pings within it
SETTLE_POLL_S = 0.25

@dataclass
class Sequence:
    seq_id: str
    owner: str
    rows: SequenceRows
    length: int = 0
    in_step: int | None = None
    persisted_pages: int = -1   # pages the journal holds for this sequence (-1: none yet)
    last_step: int = 0          # the step that committed ``length`` (journalled with it)
    pages_version: int = 0      # +1 whenever pages a client may hold are taken back (cluster/page_delta.py)


@dataclass
class OpenStep:
    step_id: int
    client_id: str
    seq_ids: list[str]
    new_lengths: list[int]
    growth: Growth
    num_tokens: int
    epoch: int
    local_ranks: tuple[int, ...] = ()   # shards whose share the client computes in its own process
    refs: list = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)
    plan_s: float = 0.0


# Open steps one client may hold at once: a client is one thread with one step, so more is a tenant trying to
# hold the shards' step threads (each open step holds one on every shard) that other clients need.
MAX_OPEN_STEPS_PER_CLIENT = 1


class Coordinator:
    def __init__(self, config: ServiceConfig, backend_registry: dict | None = None,
                 operator_digest: str | None = None):
        self.config = config
        self._lock = threading.RLock()
        self._recovery_lock = threading.Lock()
        # Proves to shards that a call (KV reads/writes, plans, fencing) or a group join comes from this service.
        self._shard_secret = secrets.token_hex(32)
        # SHA-256 of the operator credential made by whoever started the service (cluster.authority).
        self._operator_digest = operator_digest
        self._started = False
        self.shard_set = ShardSet(config, backend_registry, self._shard_secret, operator_digest)
        self.allocator = ShardedKVAllocator(config.num_shards, config.blocks_per_shard(), config.block_size,
                                            config.dcp_interleave, config.max_sequences, config.kv_replicas)
        self.sequences: dict[str, Sequence] = {}
        self.dropped: dict[str, tuple[int, str]] = {}   # seq_id -> (rank, why): KV lost with a shard
        self.clients: dict[str, dict] = {}   # public client id -> lease, on_lapse, credential hash
        self._by_credential: dict[str, str] = {}   # sha256(credential) -> public client id
        self.steps: dict[int, OpenStep] = {}
        self._next_step = 1
        self._draining: list[list] = []      # shard calls of rolled-back steps still holding a thread
        self.epoch = 0                       # bumped by every shard replacement; clients rejoin on a new one
        # Bumped by every coordinator restart; every plan carries it and shards refuse older ones once fenced.
        self.incarnation = 1
        self._first_step = 1                 # steps numbered below this were begun by an earlier incarnation
        self.num_steps_committed = 0
        self.num_steps_rolled_back = 0
        self.num_shards_replaced = 0
        self._stop = threading.Event()
        self.metrics = ServiceMetrics(config.name)
        # A detached service persists its committed state so Ray can restart this actor without loss.
        self.journal = CoordinatorJournal(config.namespace, config.name) if config.detached else None
        self.restored = False
        if self.journal is not None:
            meta, records = self.journal.load()
            if meta is not None:
                self._restore(meta, records)

    def _restore(self, meta: dict, records: dict) -> None:
        """Restarted by Ray: re-attach to the detached shards and rebuild sequences from the journal."""
        cfg = self.config
        self._shard_secret = meta.get("shard_secret", self._shard_secret)
        self.shard_set.secret = self._shard_secret
        self.shard_set.attach(meta["bundles"])
        restore_allocator(self.allocator, [(SequenceRows(r.primary, r.replica), r.length, r.pages)
                                           for r in records.values()])
        for seq_id, r in records.items():
            seq = Sequence(seq_id, r.owner, SequenceRows(r.primary, r.replica), r.length, last_step=r.last_step)
            seq.persisted_pages = sum(len(p) for p in self.allocator.pages_of(seq.rows).values())
            self.sequences[seq_id] = seq
        clients = meta["clients"] if isinstance(meta["clients"], dict) else dict.fromkeys(meta["clients"], "free")
        # Every restored client gets a fresh lease: it could not renew while the coordinator was down.
        self.clients = {c: {"restored": True, "renewed": time.monotonic(), "on_lapse": on_lapse}
                        for c, on_lapse in clients.items()}
        self._by_credential = {h: c for h, c in meta.get("credentials", {}).items() if c in self.clients}
        self.epoch, self.dropped, self._next_step = meta["epoch"], dict(meta["dropped"]), meta["next_step"]
        self._first_step = self._next_step
        self.incarnation = meta.get("incarnation", 1) + 1
        self.epoch += 1         # every client rebuilds its data-plane group (old groups may hold fenced steps)
        self._persist_meta()    # a restart during the fence below must not reuse this incarnation
        self._fence_shards()
        self.restored = True
        threading.Thread(target=self._health_loop, daemon=True, name="cpattn-health").start()
        logger.warning("coordinator %r restarted: restored %d sequences, %d clients", cfg.name, len(records),
                       len(self.clients))

    def _fence_shards(self) -> None:
        """Before any page is handed out again: no step of an earlier incarnation may write on any shard.

        The steps open when the previous incarnation died are not in the journal, so their pages are free
        here; each shard refuses their remaining layers and returns once none of them is mid-write. A shard
        that cannot confirm is treated as lost (the health check replaces it, killing the old process).
        """
        cfg = self.config
        handles = self.shard_set.handles
        refs = {rank: h.fence.options(concurrency_group=CONTROL_GROUP).remote(self.incarnation, cfg.rpc_timeout_s,
                                                                              self._shard_secret)
                for rank, h in enumerate(handles) if h is not None and rank not in self.shard_set.lost}
        for rank, ref in refs.items():
            try:
                ray.get(ref, timeout=cfg.rpc_timeout_s + 5)
            except Exception as exc:
                self.shard_set.lost[rank] = f"could not be fenced after a coordinator restart ({type(exc).__name__})"
                logger.error("shard %d: %s", rank, self.shard_set.lost[rank])

    def _persist_meta(self) -> None:
        if self.journal is not None:
            self.journal.put_meta({"epoch": self.epoch, "dropped": dict(self.dropped),
                                   "clients": {c: i.get("on_lapse", "free") for c, i in self.clients.items()},
                                   "incarnation": self.incarnation, "shard_secret": self._shard_secret,
                                   "credentials": dict(self._by_credential),
                                   "next_step": self._next_step + 1000,   # never reuse a step id after restart
                                   "bundles": self.shard_set.bundles})

    def _persist_sequence(self, seq: Sequence) -> None:
        self._persist_commit([seq])

    def _persist_commit(self, seqs: list[Sequence]) -> None:
        """After a commit: lengths (with the committing step) always, page lists only when they changed;
        atomic over the step's sequences."""
        if self.journal is None or not seqs:
            return
        updates = []
        for seq in seqs:
            pages = self.allocator.pages_of(seq.rows)
            num_pages = sum(len(p) for p in pages.values())
            value = None
            if num_pages != seq.persisted_pages:
                value = self.journal.pages_value(seq.owner, seq.rows.primary, seq.rows.replica, pages)
            updates.append(SequenceUpdate(seq.seq_id, value, seq.length, seq.last_step))
        self.journal.commit(updates)
        for seq, u in zip(seqs, updates):
            if u.pages is not None:
                seq.persisted_pages = sum(len(p) for p in u.pages[3].values())

    # Authority (the remote surface calls this before every method: cluster.authority) ----------------
    def authorize(self, rule: authority.Rule, proof, arguments: dict, method: str) -> None:
        who = f"coordinator {self.config.name!r}"
        if rule.who == authority.OPEN:
            return
        operator = authority.matches_digest(proof, self._operator_digest)
        if rule.who == authority.OPERATOR:
            if not operator:
                raise authority.refuse(who, method, "it needs the operator credential (printed by `cpattn serve`, "
                                                    "Service.operator_credential of cpattn.start)")
            return
        if rule.who == authority.CLIENT_OR_OPERATOR and operator:
            return
        with self._lock:
            known = self._client_of(proof) in self.clients
        if not known:
            raise AccessDeniedError(
                f"{method}: unknown client credential (closed, or its lease lapsed after client_lease_s without a "
                "call or heartbeat): connect again with cpattn.connect()" +
                (", or pass the operator credential" if rule.who == authority.CLIENT_OR_OPERATOR else ""))

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
        threading.Thread(target=self._health_loop, daemon=True, name="cpattn-health").start()
        first = self.shard_set.infos[0]
        logger.info("cpattn service %r: %d shards, backend %s (%s)", self.config.name, self.config.num_shards,
                    first["backend"], first["kernel_version"])
        return self.shard_set.infos

    def describe(self, credential: str) -> dict:
        return {"config": self.config.model_dump(), "shards": self.shard_set.infos, "lost": dict(self.shard_set.lost),
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

    # Health and recovery --------------------------------------------------------------------------
    def _health_loop(self) -> None:
        while not self._stop.wait(self.config.health_check_interval_s):
            try:
                if self.check_shards(timeout_s=self.config.shard_hang_timeout_s):
                    self.recover()
            except Exception:   # never let the watchdog die; the next round retries
                logger.exception("health check failed")
            try:
                self.expire_clients()
            except Exception:
                logger.exception("client lease check failed")

    def check_shards(self, timeout_s: float | None = None) -> dict[int, str]:
        """Ping every shard; returns rank -> why for the lost ones."""
        return self.shard_set.check(timeout_s if timeout_s is not None else self.config.rpc_timeout_s)

    def recover(self) -> None:
        """Replace every lost shard in its bundle; refill from replicas or drop the sequences it held."""
        with self._recovery_lock:
            for rank in sorted(self.shard_set.lost):
                self._replace(rank)

    def _replace(self, rank: int) -> None:
        cfg = self.config
        lost = self.shard_set.lost
        why = lost[rank]
        new, info = self.shard_set.start_replacement(rank)
        with self._lock:
            live = list(self.sequences.values())
            sources = {self.allocator.replica_holder(rank), self.allocator.primary_of(rank)} - {rank}
            if cfg.kv_replicas == 2 and not sources & set(lost):
                copies = refill_copies(self.allocator, [s.rows for s in live], rank)
            else:
                copies = None
                for s in live:
                    if self.allocator.local_tokens(s.length, rank) > 0:
                        self.dropped[s.seq_id] = (rank, why, s.owner)
                        if s.in_step is None:
                            self.allocator.release(s.rows)
                            del self.sequences[s.seq_id]
        for copy in copies or []:
            pages = self.shard_set.handles[copy.src].read_blocks.remote(copy.src_blocks, self._shard_secret)
            ray.get(new.write_blocks.remote(copy.dst_blocks, pages, self._shard_secret), timeout=cfg.rpc_timeout_s)
        ray.get(new.mark_ready.remote(self._shard_secret), timeout=cfg.rpc_timeout_s)
        with self._lock:
            self.shard_set.install(rank, new, info)
            self.epoch += 1
            self.num_shards_replaced += 1
            for seq_id in self.dropped:
                if self.journal is not None and seq_id not in self.sequences:
                    self.journal.delete_sequence(seq_id)
            self._persist_meta()
        logger.warning("shard %d replaced (%s); %s", rank, why,
                       "refilled from replicas" if copies is not None else "its sequences were dropped")

    def _settle(self, deadline: float) -> None:
        """After a failed step, until ``deadline``: wait for silent shards to answer or be declared lost, and for
        lost ones to be replaced (in the background, as the health thread does). Returns early once settled."""
        cfg = self.config
        ping_s = min(cfg.rpc_timeout_s, cfg.shard_hang_timeout_s, END_STEP_PING_S)
        while True:
            lost = self.check_shards(timeout_s=max(0.1, min(ping_s, deadline - time.monotonic())))
            if lost and not self._recovery_lock.locked():
                threading.Thread(target=self._recover_quietly, daemon=True, name="cpattn-recover").start()
            if not lost and not self.shard_set.silent:
                return
            if time.monotonic() + SETTLE_POLL_S > deadline:
                return
            time.sleep(SETTLE_POLL_S)

    def _recover_quietly(self) -> None:
        try:
            self.recover()
        except Exception:   # the health thread tries again
            logger.exception("shard recovery failed")

    def _raise_if_unavailable(self, seq_ids: list[str], client_id: str | None = None) -> None:
        seq_ids = [canonical_id(s) for s in seq_ids]
        dropped = [s for s in seq_ids if isinstance(s, str) and s in self.dropped   # ids may be hostile/unhashable
                   and self._dropped_owner(s) in (None, client_id)]                 # others' ids stay unknown
        if dropped:
            rank, why = self.dropped[dropped[0]][:2]
            raise ShardLostError(
                f"shard {rank} {why}: sequences {dropped} lost KV held there; start them again as new sequences "
                "(replay the prompt), or run with kv_replicas=2 to survive shard loss", shard=rank, sequences=dropped)

    def _dropped_owner(self, seq_id: str) -> str | None:
        entry = self.dropped[seq_id]
        return entry[2] if len(entry) > 2 else None   # journals before issue 12 did not record owners

    # Clients and sequences ------------------------------------------------------------------------
    def register_client(self, on_lapse: str = "free", credential: str | None = None) -> dict:
        """A new client, or (with the credential of one that ended keeping its sequences) that client again."""
        if on_lapse not in ON_LAPSE:
            raise InvalidRequestError(f"on_lapse {on_lapse!r}: use 'free' (a client that dies frees its sequences) "
                                      "or 'keep'")
        if credential is not None:
            with self._lock:
                client_id = self._client_of(credential)
                if client_id is None:
                    raise InvalidRequestError("unknown credential: its client ended and no sequence of it was kept "
                                              "(connect without a credential for a new client)")
                if client_id in self.clients:
                    raise InvalidRequestError("the client of this credential is still connected: close() it first "
                                              "(a credential serves one client at a time)")
                self.clients[client_id] = {"created": time.time(), "renewed": time.monotonic(), "on_lapse": on_lapse}
                self._persist_meta()
            return {"client_id": client_id, "credential": credential, "config": self.config.model_dump()}
        client_id = "c-" + secrets.token_hex(6)            # public: group names, stats, logs
        credential = secrets.token_urlsafe(32)              # secret: every call of this client proves it
        with self._lock:
            self.clients[client_id] = {"created": time.time(), "renewed": time.monotonic(), "on_lapse": on_lapse}
            self._by_credential[_digest(credential)] = client_id
            self._persist_meta()
        return {"client_id": client_id, "credential": credential, "config": self.config.model_dump()}

    def _client_of(self, credential) -> str | None:
        return self._by_credential.get(_digest(credential)) if isinstance(credential, str) else None

    def renew(self, credential: str) -> bool:
        """A client's heartbeat; False when the client has ended (its lease lapsed): it must connect again."""
        with self._lock:
            client_id = self._client_of(credential)
            if client_id is None or client_id not in self.clients:
                return False
            self.clients[client_id]["renewed"] = time.monotonic()
            return True

    def unregister_client(self, credential: str) -> None:
        """close(): end the client (open step rolled back, groups dropped); its sequences stay."""
        with self._lock:
            client_id = self._client_of(credential)
        if client_id is not None:
            self._end_client(client_id, "closed", free_sequences=False)

    def group_ticket(self, credential: str, group_name: str) -> str:
        """What a client shows a shard to join (or leave) a data-plane group named after itself: one join per
        group, within client_lease_s, and void once the client ends (authority.make_ticket)."""
        with self._lock:
            client_id = self._check_client(credential)
            if not isinstance(group_name, str) or not group_name.startswith(f"{client_id}-"):
                raise InvalidRequestError(f"group {group_name!r} is not this client's: name it {client_id}-...")
            return authority.make_ticket(self._shard_secret, group_name, client_id, time.time())

    def expire_clients(self) -> list[str]:
        """End every client whose lease lapsed (no call or heartbeat for client_lease_s)."""
        lease = self.config.client_lease_s
        now = time.monotonic()
        with self._lock:
            lapsed = [c for c, i in self.clients.items() if now - i.get("renewed", now) > lease]
        for client_id in lapsed:
            self._end_client(client_id, f"its lease lapsed (no call or heartbeat for {lease:g}s)")
        return lapsed

    def _end_client(self, client_id: str, why: str, free_sequences: bool | None = None) -> None:
        """Roll back the client's open steps, free (or keep) its sequences, drop its groups on every shard."""
        with self._lock:
            info = self.clients.pop(client_id, None) if isinstance(client_id, str) else None
            if info is None:
                return
            rolled_back = [s for s in self.steps.values() if s.client_id == client_id]
            for step in rolled_back:
                self._roll_back_open_step(step)
            if free_sequences is None:
                free_sequences = info.get("on_lapse", "free") == "free"
            freed = []
            if free_sequences:
                for seq in [s for s in self.sequences.values() if s.owner == client_id and s.in_step is None]:
                    self.allocator.release(seq.rows)
                    del self.sequences[seq.seq_id]
                    self.dropped.pop(seq.seq_id, None)
                    if self.journal is not None:
                        self.journal.delete_sequence(seq.seq_id)
                    freed.append(seq.seq_id)
            if not any(s.owner == client_id for s in self.sequences.values()):
                # Nothing kept: the credential is forgotten. Otherwise connect(credential=...) resumes the client.
                self._by_credential = {h: c for h, c in self._by_credential.items() if c != client_id}
            self._persist_meta()
            self._publish_blocks_used()
            shards = [h for h in self.shard_set.handles if h is not None]
            ended_at = time.time()   # tickets issued before this are void on every shard
        refs = [h.drop_client.remote(self._shard_secret, client_id, ended_at) for h in shards]
        try:
            ray.get(refs, timeout=self.config.rpc_timeout_s)
        except Exception as exc:   # a lost shard's groups went with it
            logger.warning("dropping client %s's groups: %s", client_id, exc)
        if why != "closed" or rolled_back:
            logger.warning("client %s ended: %s; rolled back %d open step(s), freed %d sequence(s)", client_id, why,
                           len(rolled_back), len(freed))

    def _pages_taken_back(self, seq_ids: list[str]) -> None:
        """A rolled-back step's pages return to the pool: clients holding them must get whole rows again."""
        for seq_id in seq_ids:
            seq = self.sequences.get(seq_id)
            if seq is not None:
                seq.pages_version += 1

    def _roll_back_open_step(self, step: OpenStep) -> None:
        """Under the lock: close an open step without committing (its pages return)."""
        self.steps.pop(step.step_id, None)
        for seq_id in step.seq_ids:
            seq = self.sequences.get(seq_id)
            if seq is not None and seq.in_step == step.step_id:
                seq.in_step = None
        self.allocator.undo(step.growth)
        self._pages_taken_back(step.seq_ids)
        self.num_steps_rolled_back += 1
        self.metrics.record_rollback()
        if step.refs:
            self._draining.append(list(step.refs))

    def add_sequence(self, credential: str) -> str:
        with self._lock:
            client_id = self._check_client(credential)
            if not self.allocator.can_add_row():
                raise InvalidRequestError(
                    f"the service holds max_sequences={self.config.max_sequences} sequences: free some or raise max_sequences")
            seq_id = "seq-" + secrets.token_urlsafe(16)   # unguessable: the id is the capability
            seq = Sequence(seq_id, client_id, self.allocator.add_rows())
            self.sequences[seq_id] = seq
            self._persist_sequence(seq)
            return seq_id

    def free(self, credential: str, seq_id: str) -> None:
        seq_id = canonical_id(seq_id)
        with self._lock:
            client_id = self._check_client(credential)
            if (isinstance(seq_id, str) and seq_id in self.dropped and seq_id not in self.sequences
                    and self._dropped_owner(seq_id) in (None, client_id)):
                del self.dropped[seq_id]
                return
            seq = self._get_sequence(seq_id, client_id)
            if seq.in_step is not None:
                raise InvalidRequestError(f"sequence {seq_id} is in open step {seq.in_step}: finish the step first")
            self.allocator.release(seq.rows)
            del self.sequences[seq_id]
            self.dropped.pop(seq_id, None)
            if self.journal is not None:
                self.journal.delete_sequence(seq_id)
            self._publish_blocks_used()

    def list_sequences(self, credential: str) -> dict[str, int]:
        with self._lock:
            client_id = self._check_client(credential)
            return {s.seq_id: s.length for s in self.sequences.values() if s.owner == client_id}

    def sequence_length(self, credential: str, seq_id: str) -> int:
        with self._lock:
            client_id = self._check_client(credential)
            self._raise_if_unavailable([seq_id], client_id)
            return self._get_sequence(seq_id, client_id).length

    def _check_client(self, credential: str) -> str:
        """The public id of the client holding ``credential``; renews its lease (every call does)."""
        client_id = self._client_of(credential)
        info = self.clients.get(client_id) if client_id is not None else None
        if info is None:
            raise InvalidRequestError("unknown client credential (closed, or its lease lapsed after client_lease_s "
                                      "without a call or heartbeat): connect again with cpattn.connect()")
        info["renewed"] = time.monotonic()
        return client_id

    def _get_sequence(self, seq_id, client_id: str | None = None) -> Sequence:
        """The caller's sequence; another client's id is exactly as unknown as an id that never existed."""
        seq_id = canonical_id(seq_id)
        seq = self.sequences.get(seq_id) if isinstance(seq_id, str) else None
        if seq is None or (client_id is not None and seq.owner != client_id):
            raise InvalidRequestError(
                f"unknown or freed sequence {seq_id!r}: use an id returned by add_sequence() that was not freed")
        return seq

    # Steps ----------------------------------------------------------------------------------------
    def begin_step(self, credential: str, group_name: str, request: dict, epoch: int | None = None,
                   local_ranks: list[int] | tuple[int, ...] = (), held: dict | None = None) -> dict:
        """Validate, allocate, plan once, and hand each remote shard its plan. Nothing changes if it raises.

        ``local_ranks``: shards on the client's GPU, whose share the client computes itself on their
        KV cache (opened by CUDA IPC); their plans come back in the reply instead of going to them, with
        block tables as deltas against ``held`` ({seq_id: {rank: (version, pages)}}, cluster/page_delta.py).
        A client whose data-plane group predates a shard replacement gets ``{"rejoin": epoch}`` back
        (nothing planned) and rebuilds its group first.
        """
        t0 = time.perf_counter()
        if self.shard_set.lost:
            self.recover()
        with self._lock:
            try:
                client_id = self._check_client(credential)
                if not isinstance(group_name, str) or not group_name.startswith(f"{client_id}-"):
                    raise InvalidRequestError(f"data-plane group {group_name!r} is not this client's")
                if epoch is not None and epoch != self.epoch:
                    return {"rejoin": self.epoch}
                if not isinstance(local_ranks, (list, tuple)) or not all(
                        type(r) is int and 0 <= r < self.config.num_shards for r in local_ranks):
                    raise InvalidRequestError(f"local_ranks {local_ranks!r} must be shard ranks in "
                                              f"0..{self.config.num_shards - 1}")
                local = tuple(sorted(set(local_ranks)))
                if not isinstance(request, dict) or not request:
                    raise InvalidRequestError(
                        f"a step needs a non-empty {{seq_id: num_new_tokens}} dict, got {request!r}")
                request = canonical_request(request)
                self._raise_if_unavailable(list(request), client_id)
                seqs, growths, requests = [], [], []
                for seq_id, n in request.items():
                    seq = self._get_sequence(seq_id, client_id)
                    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                        raise InvalidRequestError(f"sequence {seq_id}: num_new_tokens {n!r} must be an int >= 1")
                    self._check_fits(seq, n)
                    if seq.in_step is not None:
                        raise InvalidRequestError(f"sequence {seq_id} is already in open step {seq.in_step}")
                    seqs.append(seq)
                    growths.append((seq.rows, seq.length + n))
                    requests.append(StepRequest(seq.rows, seq.length, n))
                self._check_step_size(sum(request.values()))
                self._check_quota(client_id, sum(request.values()))
                self._check_client_steps(client_id)
                self._check_open_steps()
                growth = self.allocator.grow(growths)        # raises CapacityError before changing anything
            except CpattnError as exc:
                self.metrics.record_error(type(exc).__name__)
                raise
            step_id = self._next_step
            self._next_step += 1
            if self.journal is not None and step_id % 1000 == 0:
                self._persist_meta()
            try:
                plans = plan_step(self.allocator, requests, step_id, self.config.pcp_enabled,
                                  self.config.pcp_min_tokens, self.incarnation)
            except BaseException:
                self.allocator.undo(growth)
                raise
            for plan in plans:
                plan.auth = self._shard_secret
            for seq in seqs:
                seq.in_step = step_id
            step = OpenStep(step_id, client_id, [s.seq_id for s in seqs], [g[1] for g in growths], growth,
                            plans[0].num_tokens, self.epoch, local)
            self.steps[step_id] = step
            shards = list(self.shard_set.handles)
        step.refs = [h.run_step.remote(group_name, plan) for rank, (h, plan) in enumerate(zip(shards, plans))
                     if rank not in local]
        step.plan_s = time.perf_counter() - t0
        local_plans, local_pages = {}, {}
        for r in local:
            local_pages[r] = self._page_deltas(r, seqs, plans[r].metadata.block_table_tensor, held)
            md = dataclasses.replace(plans[r].metadata, block_table_tensor=torch.empty(len(seqs), 0, dtype=torch.int64))
            # The shard secret stays with the shards: the client computes those ranks, it never calls them.
            local_plans[r] = dataclasses.replace(plans[r], auth=None, metadata=md)
        return {"step_id": step_id, "num_tokens": plans[0].num_tokens, "seq_ids": step.seq_ids,
                "query_lens": [r.num_new for r in requests], "plan_s": step.plan_s, "epoch": self.epoch,
                "local_plans": local_plans, "local_pages": local_pages,
                "remote_rows": {r: p.rows for r, p in enumerate(plans) if r not in local and p.num_rows}}

    def _page_deltas(self, rank: int, seqs: list[Sequence], table_BW: torch.Tensor, held) -> list:
        """The rank's block-table rows as deltas against what the client says it holds (page_delta.py)."""
        held = held if isinstance(held, dict) else {}
        claims = [held.get(s.seq_id) for s in seqs]
        claims = [c.get(rank) if isinstance(c, dict) else None for c in claims]
        pages = [self.allocator.tables[rank].num_blocks[s.rows.primary[rank]] for s in seqs]
        return row_deltas(table_BW, pages, [s.pages_version for s in seqs], claims)

    def _publish_blocks_used(self) -> None:
        for rank in range(self.config.num_shards):
            self.metrics.set_blocks_used(rank, self.allocator.pools[rank].num_used_blocks)

    def _check_fits(self, seq: Sequence, extra: int) -> None:
        # Also keeps absurd counts (>= 2**63) away from the int64 allocator math.
        capacity = self.config.num_shards * self.config.blocks_per_shard() * self.config.block_size
        if seq.length + extra > capacity:
            raise CapacityError(f"sequence {seq.seq_id}: {seq.length} + {extra} tokens exceed the whole KV cache "
                                f"({capacity} tokens over {self.config.num_shards} shards): shorten the request or "
                                "raise num_blocks_per_shard / num_shards", needed=seq.length + extra, free=capacity)

    def _check_step_size(self, num_tokens: int) -> None:
        cap = self.config.max_tokens_per_step
        if num_tokens > cap:
            raise InvalidRequestError(
                f"a step of {num_tokens} new tokens exceeds max_tokens_per_step={cap}: split the prefill into chunks "
                f"of at most {cap} tokens (or raise max_tokens_per_step if the shards have the memory)")

    def _check_open_steps(self) -> None:
        """Each open step holds a thread on every shard: refuse one more than max_open_steps (issue 12).

        Rolled-back steps whose shard calls have not returned yet (a client that died mid-step, until its
        group breaks) still hold their threads and count too.
        """
        cap = self.config.max_open_steps
        if len(self.steps) + len(self._draining) < cap:
            return
        if self._draining:
            still = []
            for refs in self._draining:
                _, pending = ray.wait(refs, num_returns=len(refs), timeout=0)
                if pending:
                    still.append(pending)
            self._draining = still
        held = len(self.steps) + len(self._draining)
        if held >= cap:
            raise CapacityError(
                f"{held} steps are open on the shards, the most they serve at once (max_open_steps={cap}): finish "
                "open steps first (a client holds one at a time), retry later, or raise max_open_steps",
                needed=held + 1, free=0)

    def _check_client_steps(self, client_id: str) -> None:
        held = sum(1 for s in self.steps.values() if s.client_id == client_id)
        if held >= MAX_OPEN_STEPS_PER_CLIENT:
            raise CapacityError(f"this client already holds {held} open step(s), the most one client may: end it "
                                "first (a client is one thread with one step; use another client for concurrent "
                                "steps)", needed=held + 1, free=0)

    def _check_quota(self, client_id: str, extra: int) -> None:
        quota = self.config.max_tokens_per_client
        if quota is None:
            return
        held = sum(s.length for s in self.sequences.values() if s.owner == client_id)
        if held + extra > quota:
            raise CapacityError(f"client quota: holding {held} tokens, this step adds {extra}, max_tokens_per_client "
                                f"is {quota}: free sequences or raise the quota", needed=held + extra, free=quota - held)

    def end_step(self, step_id: int, commit: bool, data_plane_error: str | None = None,
                 credential: str | None = None) -> dict:
        """Commit (lengths advance) or roll back (pages return).

        A failed step is rolled back; lost shards are replaced. Returns ``recovered: True`` when
        every sequence of the step survived (the client may replay it); raises ShardLostError
        naming the sequences whose KV was lost otherwise.
        """
        with self._lock:
            client_id = self._check_client(credential)
            step = self.steps.get(step_id) if isinstance(step_id, int) else None
            if step is not None and step.client_id != client_id:
                step = None   # another client's step is as unknown as one that never existed
            if step is None:
                if isinstance(step_id, int) and not isinstance(step_id, bool) and 0 < step_id < self._first_step:
                    if any(s.last_step == step_id for s in self.sequences.values()):
                        # The previous incarnation committed it (journalled) and died before answering.
                        return {"shard_plan_s": 0.0, "attention_s": 0.0, "shard_wire_s": 0.0,
                                "committed_before_restart": True}
                    self.metrics.record_error("StepFencedError")
                    raise StepFencedError(
                        f"step {step_id} was open when the coordinator restarted: the shards stopped writing it and "
                        "it was rolled back (none of its tokens were committed); run the step again")
                raise InvalidRequestError(f"step {step_id} is not open")
        reports, failure = [], data_plane_error
        if failure is None:
            try:
                # The client received every partial, so the shards' calls have ended or are about to: a call that
                # does not return within a collective timeout is cut off (a partition), not waited for.
                reports = ray.get(step.refs, timeout=min(self.config.rpc_timeout_s, self.config.collective_timeout_s))
                broken = [r["error"] for r in reports if r.get("outcome") == "broken"]
                if broken:
                    failure = f"data plane broke on a shard: {broken[0]}"
            except (ray.exceptions.RayError, CpattnError) as exc:
                failure = f"{type(exc).__name__}: {exc}"
        if failure is None and step.local_ranks:
            # The client wrote those shards' KV itself: commit only if they are still the same, live
            # processes (a replacement would not hold what was written into its predecessor).
            lost = self.check_shards(timeout_s=min(self.config.rpc_timeout_s, self.config.shard_hang_timeout_s))
            if step.epoch != self.epoch or set(lost) & set(step.local_ranks):
                failure = f"a shard the client computed in-process was lost: {lost}"
        if failure is not None:
            commit = False
            self._settle(time.monotonic() + END_STEP_SETTLE_S)
        with self._lock:
            if self.steps.get(step_id) is not step:   # rolled back meanwhile: the client's lease lapsed
                raise InvalidRequestError(f"step {step_id} was rolled back: its client ended (closed, or its lease "
                                          "lapsed); connect again and run the step again")
            if step.client_id in self.clients:
                self.clients[step.client_id]["renewed"] = time.monotonic()
            self.steps.pop(step_id, None)
            committed = []
            for seq_id, new_len in zip(step.seq_ids, step.new_lengths):
                seq = self.sequences.get(seq_id)
                if seq is None:
                    continue
                seq.in_step = None
                if commit:
                    seq.length, seq.last_step = new_len, step_id
                    committed.append(seq)
            self._persist_commit(committed)
            if commit:
                self.num_steps_committed += 1
                self.metrics.record_step(time.perf_counter() - step.started, step.num_tokens)
            else:
                self.allocator.undo(step.growth)
                self._pages_taken_back(step.seq_ids)
                self.num_steps_rolled_back += 1
                if failure is not None and step.refs:
                    self._draining.append(list(step.refs))
                self.metrics.record_rollback()
            self._publish_blocks_used()
        if failure is None:
            return {"shard_plan_s": max((r.get("plan_s", 0.0) for r in reports), default=0.0),
                    "attention_s": max((r.get("attention_s", 0.0) for r in reports), default=0.0),
                    "shard_wire_s": max((r.get("wire_s", 0.0) for r in reports), default=0.0)}
        silent = self.shard_set.silent
        if not self.shard_set.lost and step.epoch == self.epoch:
            self.metrics.record_error("ServiceError")
            if silent:
                raise ServiceError(
                    f"step {step_id} failed and was rolled back: {failure}; shard(s) {sorted(silent)} have not answered "
                    f"for {max(silent.values()):.0f}s (a network partition?) and are replaced only after "
                    f"shard_hang_timeout_s={self.config.shard_hang_timeout_s:g}s; no KV was lost: run the step again "
                    "once they answer")
            raise ServiceError(f"step {step_id} failed and was rolled back: {failure}; no shard was lost: run the step "
                               "again (the client rebuilds its data-plane group first)")
        if self.shard_set.lost:   # not replaced within END_STEP_SETTLE_S: its node is unreachable or full
            lost = dict(self.shard_set.lost)
            self.metrics.record_error("ServiceError")
            raise ServiceError(
                f"step {step_id} failed and was rolled back: {failure}; shard(s) {sorted(lost)} were lost "
                f"({'; '.join(lost.values())}) and are being replaced (a replacement starts once its node is reachable "
                "again): run the step again; the next step waits for the replacement. With kv_replicas=2 the "
                "replacement is refilled from the replicas; with 1, sequences that had KV there raise ShardLostError")
        self.recover()   # a no-op when the health thread already replaced the shard (epoch moved on)
        with self._lock:
            # Sequences dropped while in this step are released now that the step is closed.
            for seq_id in step.seq_ids:
                seq = self.sequences.get(seq_id)
                if seq_id in self.dropped and seq is not None:
                    self.allocator.release(seq.rows)
                    del self.sequences[seq_id]
            try:
                self._raise_if_unavailable(step.seq_ids, step.client_id)
            except ShardLostError as exc:
                self.metrics.record_error(type(exc).__name__)
                raise
        return {"recovered": True, "epoch": self.epoch, "failure": failure}

    def fill_synthetic(self, credential: str, seq_id: str, num_tokens: int, seed: int) -> int:
        """Append ``num_tokens`` of seeded random KV to a sequence without attention (benchmarks, load tests)."""
        with self._lock:
            client_id = self._check_client(credential)
            self._raise_if_unavailable([seq_id], client_id)
            seq = self._get_sequence(seq_id, client_id)
            if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
                raise InvalidRequestError(f"num_tokens {num_tokens!r} must be an int >= 1")
            if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**40:
                raise InvalidRequestError(f"seed {seed!r} must be an int in 0..2**40")
            self._check_fits(seq, num_tokens)
            self._check_quota(client_id, num_tokens)
            if seq.in_step is not None:
                raise InvalidRequestError(f"sequence {seq_id} is in open step {seq.in_step}")
            growth = self.allocator.grow([(seq.rows, seq.length + num_tokens)])
            plans = plan_step(self.allocator, [StepRequest(seq.rows, seq.length, num_tokens)], 0, False, 1,
                              self.incarnation)
            for plan in plans:
                plan.auth = self._shard_secret
            seq.in_step = -1
            shards = list(self.shard_set.handles)
        try:
            ray.get([h.fill_synthetic.remote(p, seed) for h, p in zip(shards, plans)], timeout=self.config.rpc_timeout_s)
        except BaseException:
            with self._lock:
                self.allocator.undo(growth)
                seq.in_step = None
            raise
        with self._lock:
            seq.in_step = None
            seq.length += num_tokens
            self._persist_sequence(seq)
            return seq.length

    # Stats ----------------------------------------------------------------------------------------
    def stats(self, credential: str | None = None, admin: bool = False) -> dict:
        """Service-wide usage. ``clients`` lists only the caller's own client (by its credential); every other
        client is counted in ``other_clients`` (aggregate). ``admin=True`` (operators: ``cpattn status``) lists
        every client by its public id."""
        if admin and not authority.matches_digest(credential, self._operator_digest):
            raise authority.refuse(f"coordinator {self.config.name!r}", "stats(admin=True)",
                                   "it needs the operator credential (`cpattn status` finds it; see README Security)")
        with self._lock:
            me = self._client_of(credential)
            bytes_per_block = self.config.bytes_per_block()
            shards = []
            for rank in range(self.config.num_shards):
                pool = self.allocator.pools[rank]
                tokens = sum(self.allocator.local_tokens(s.length, rank) for s in self.sequences.values())
                infos = self.shard_set.infos
                info = infos[rank] if rank < len(infos) else {}
                shards.append({"rank": rank, "blocks_used": pool.num_used_blocks, "blocks_free": pool.num_free_blocks,
                               "blocks_total": pool.num_blocks,
                               "token_capacity": pool.num_blocks * self.config.block_size, "tokens": tokens, "bytes": pool.num_used_blocks * bytes_per_block,
                               "node_ip": info.get("node_ip"), "node_id": info.get("node_id"),
                               "device": info.get("device"), "backend": info.get("backend"),
                               "alive": rank not in self.shard_set.lost})
            per_client: dict[str, dict] = {}
            others = {"clients": len([c for c in self.clients if c != me]), "sequences": 0, "tokens": 0}
            for s in self.sequences.values():
                if admin or s.owner == me:
                    c = per_client.setdefault(s.owner, {"sequences": 0, "tokens": 0})
                    c["sequences"] += 1
                    c["tokens"] += s.length
                else:
                    others["sequences"] += 1
                    others["tokens"] += s.length
            return {"shards": shards, "num_sequences": len(self.sequences), "clients": per_client,
                    "other_clients": others,
                    "steps_committed": self.num_steps_committed, "steps_rolled_back": self.num_steps_rolled_back,
                    "shards_replaced": self.num_shards_replaced, "epoch": self.epoch,
                    "open_steps": len(self.steps), "num_clients": len(self.clients),
                    "kv_replicas": self.config.kv_replicas, "kv_cache_dtype": self.config.kv_cache_format,
                    "kv_bytes_per_block": bytes_per_block,
                    "backend": self.shard_set.infos[0]["backend"] if self.shard_set.infos else None,
                    "kernel_version": self.shard_set.infos[0]["kernel_version"] if self.shard_set.infos else None}


RemoteCoordinator = authority.remote_surface(Coordinator, authority.COORDINATOR_METHODS, "RemoteCoordinator", __name__)
"""What Ray runs (cluster.service): only the methods of authority.COORDINATOR_METHODS, each checked."""
