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

import logging
import secrets
import threading
import time
from dataclasses import dataclass, field

import ray

from cpattn.cluster.journal import CoordinatorJournal
from cpattn.cluster.metrics import ServiceMetrics
from cpattn.cluster.recovery import refill_copies
from cpattn.cluster.shard_set import ShardSet
from cpattn.cluster.step_planner import StepRequest, plan_step
from cpattn.config import ServiceConfig
from cpattn.errors import CapacityError, CpattnError, InvalidRequestError, ServiceError, ShardLostError
from cpattn.kvstore.sharded_allocator import Growth, SequenceRows, ShardedKVAllocator, restore_allocator

logger = logging.getLogger("cpattn.coordinator")

@dataclass
class Sequence:
    seq_id: str
    owner: str
    rows: SequenceRows
    length: int = 0
    in_step: int | None = None
    persisted_pages: int = -1   # pages the journal holds for this sequence (-1: none yet)


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


class Coordinator:
    def __init__(self, config: ServiceConfig, backend_registry: dict | None = None):
        self.config = config
        self._lock = threading.RLock()
        self._recovery_lock = threading.Lock()
        self.shard_set = ShardSet(config, backend_registry)
        self.allocator = ShardedKVAllocator(config.num_shards, config.blocks_per_shard(), config.block_size,
                                            config.dcp_interleave, config.max_sequences, config.kv_replicas)
        self.sequences: dict[str, Sequence] = {}
        self.dropped: dict[str, tuple[int, str]] = {}   # seq_id -> (rank, why): KV lost with a shard
        self.clients: dict[str, dict] = {}
        self.steps: dict[int, OpenStep] = {}
        self._next_step = 1
        self.epoch = 0                       # bumped by every shard replacement; clients rejoin on a new one
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
        self.shard_set.attach(meta["bundles"])
        restore_allocator(self.allocator, [(SequenceRows(r.primary, r.replica), r.length, r.pages)
                                           for r in records.values()])
        for seq_id, r in records.items():
            seq = Sequence(seq_id, r.owner, SequenceRows(r.primary, r.replica), r.length)
            seq.persisted_pages = sum(len(p) for p in self.allocator.pages_of(seq.rows).values())
            self.sequences[seq_id] = seq
        self.clients = {c: {"restored": True} for c in meta["clients"]}
        self.epoch, self.dropped, self._next_step = meta["epoch"], dict(meta["dropped"]), meta["next_step"]
        self.restored = True
        threading.Thread(target=self._health_loop, daemon=True, name="cpattn-health").start()
        logger.warning("coordinator %r restarted: restored %d sequences, %d clients", cfg.name, len(records),
                       len(self.clients))

    def _persist_meta(self) -> None:
        if self.journal is not None:
            self.journal.put_meta({"epoch": self.epoch, "clients": list(self.clients), "dropped": dict(self.dropped),
                                   "next_step": self._next_step + 1000,   # never reuse a step id after restart
                                   "bundles": self.shard_set.bundles})

    def _persist_sequence(self, seq: Sequence) -> None:
        """After a commit: the length always, the page lists only when they changed."""
        if self.journal is None:
            return
        pages = self.allocator.pages_of(seq.rows)
        num_pages = sum(len(p) for p in pages.values())
        if num_pages != seq.persisted_pages:
            self.journal.put_pages(seq.seq_id, seq.owner, seq.rows.primary, seq.rows.replica, pages)
            seq.persisted_pages = num_pages
        self.journal.put_length(seq.seq_id, seq.length)

    # Lifecycle ------------------------------------------------------------------------------------
    def start(self) -> list[dict]:
        """Place and start the shards (ShardSet cleans up if any part fails), then watch them."""
        self.shard_set.start()
        self._persist_meta()
        self._publish_blocks_used()
        threading.Thread(target=self._health_loop, daemon=True, name="cpattn-health").start()
        first = self.shard_set.infos[0]
        logger.info("cpattn service %r: %d shards, backend %s (%s)", self.config.name, self.config.num_shards,
                    first["backend"], first["kernel_version"])
        return self.shard_set.infos

    def describe(self) -> dict:
        return {"config": self.config.model_dump(), "shards": self.shard_set.infos, "lost": dict(self.shard_set.lost),
                "epoch": self.epoch, "restored": self.restored,
                "coordinator_node_id": ray.get_runtime_context().get_node_id()}

    def get_shards(self) -> dict:
        with self._lock:
            return {"epoch": self.epoch, "shards": list(self.shard_set.handles), "infos": list(self.shard_set.infos)}

    def shutdown(self) -> None:
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
                        self.dropped[s.seq_id] = (rank, why)
                        if s.in_step is None:
                            self.allocator.release(s.rows)
                            del self.sequences[s.seq_id]
        for copy in copies or []:
            pages = self.shard_set.handles[copy.src].read_blocks.remote(copy.src_blocks)
            ray.get(new.write_blocks.remote(copy.dst_blocks, pages), timeout=cfg.rpc_timeout_s)
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

    def _raise_if_unavailable(self, seq_ids: list[str]) -> None:
        dropped = [s for s in seq_ids if isinstance(s, str) and s in self.dropped]   # ids may be hostile/unhashable
        if dropped:
            rank, why = self.dropped[dropped[0]]
            raise ShardLostError(
                f"shard {rank} {why}: sequences {dropped} lost KV held there; start them again as new sequences "
                "(replay the prompt), or run with kv_replicas=2 to survive shard loss", shard=rank, sequences=dropped)

    # Clients and sequences ------------------------------------------------------------------------
    def register_client(self) -> str:
        client_id = secrets.token_hex(8)
        with self._lock:
            self.clients[client_id] = {"created": time.time()}
            self._persist_meta()
        return client_id

    def unregister_client(self, client_id: str) -> None:
        with self._lock:
            self.clients.pop(client_id, None)
            self._persist_meta()

    def add_sequence(self, client_id: str) -> str:
        with self._lock:
            self._check_client(client_id)
            if not self.allocator.can_add_row():
                raise InvalidRequestError(
                    f"the service holds max_sequences={self.config.max_sequences} sequences: free some or raise max_sequences")
            seq_id = "seq-" + secrets.token_urlsafe(16)   # unguessable: the id is the capability
            seq = Sequence(seq_id, client_id, self.allocator.add_rows())
            self.sequences[seq_id] = seq
            self._persist_sequence(seq)
            return seq_id

    def free(self, client_id: str, seq_id: str) -> None:
        with self._lock:
            self._check_client(client_id)
            if isinstance(seq_id, str) and seq_id in self.dropped and seq_id not in self.sequences:
                del self.dropped[seq_id]
                return
            seq = self._get_sequence(seq_id)
            if seq.in_step is not None:
                raise InvalidRequestError(f"sequence {seq_id} is in open step {seq.in_step}: finish the step first")
            self.allocator.release(seq.rows)
            del self.sequences[seq_id]
            self.dropped.pop(seq_id, None)
            if self.journal is not None:
                self.journal.delete_sequence(seq_id)
            self._publish_blocks_used()

    def list_sequences(self, client_id: str) -> dict[str, int]:
        with self._lock:
            return {s.seq_id: s.length for s in self.sequences.values() if s.owner == client_id}

    def sequence_length(self, seq_id: str) -> int:
        with self._lock:
            self._raise_if_unavailable([seq_id])
            return self._get_sequence(seq_id).length

    def _check_client(self, client_id: str) -> None:
        if client_id not in self.clients:
            raise InvalidRequestError(f"unknown client {client_id!r}: connect again with cpattn.connect()")

    def _get_sequence(self, seq_id) -> Sequence:
        if not isinstance(seq_id, str) or seq_id not in self.sequences:
            raise InvalidRequestError(
                f"unknown or freed sequence {seq_id!r}: use an id returned by add_sequence() that was not freed")
        return self.sequences[seq_id]

    # Steps ----------------------------------------------------------------------------------------
    def begin_step(self, client_id: str, group_name: str, request: dict, epoch: int | None = None,
                   local_ranks: list[int] | tuple[int, ...] = ()) -> dict:
        """Validate, allocate, plan once, and hand each remote shard its plan. Nothing changes if it raises.

        ``local_ranks``: shards on the client's GPU, whose share the client computes itself on their
        KV cache (opened by CUDA IPC); their plans come back in the reply instead of going to them.
        A client whose data-plane group predates a shard replacement gets ``{"rejoin": epoch}`` back
        (nothing planned) and rebuilds its group first.
        """
        t0 = time.perf_counter()
        if self.shard_set.lost:
            self.recover()
        with self._lock:
            try:
                self._check_client(client_id)
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
                self._raise_if_unavailable(list(request))
                seqs, growths, requests = [], [], []
                for seq_id, n in request.items():
                    seq = self._get_sequence(seq_id)
                    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                        raise InvalidRequestError(f"sequence {seq_id}: num_new_tokens {n!r} must be an int >= 1")
                    self._check_fits(seq, n)
                    if seq.in_step is not None:
                        raise InvalidRequestError(f"sequence {seq_id} is already in open step {seq.in_step}")
                    seqs.append(seq)
                    growths.append((seq.rows, seq.length + n))
                    requests.append(StepRequest(seq.rows, seq.length, n))
                self._check_quota(client_id, sum(request.values()))
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
                                  self.config.pcp_min_tokens)
            except BaseException:
                self.allocator.undo(growth)
                raise
            for seq in seqs:
                seq.in_step = step_id
            step = OpenStep(step_id, client_id, [s.seq_id for s in seqs], [g[1] for g in growths], growth,
                            plans[0].num_tokens, self.epoch, local)
            self.steps[step_id] = step
            shards = list(self.shard_set.handles)
        step.refs = [h.run_step.remote(group_name, plan) for rank, (h, plan) in enumerate(zip(shards, plans))
                     if rank not in local]
        step.plan_s = time.perf_counter() - t0
        return {"step_id": step_id, "num_tokens": plans[0].num_tokens, "seq_ids": step.seq_ids,
                "query_lens": [r.num_new for r in requests], "plan_s": step.plan_s, "epoch": self.epoch,
                "local_plans": {r: plans[r] for r in local},
                "remote_rows": {r: p.rows for r, p in enumerate(plans) if r not in local and p.num_rows}}

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

    def _check_quota(self, client_id: str, extra: int) -> None:
        quota = self.config.max_tokens_per_client
        if quota is None:
            return
        held = sum(s.length for s in self.sequences.values() if s.owner == client_id)
        if held + extra > quota:
            raise CapacityError(f"client quota: holding {held} tokens, this step adds {extra}, max_tokens_per_client "
                                f"is {quota}: free sequences or raise the quota", needed=held + extra, free=quota - held)

    def end_step(self, step_id: int, commit: bool, data_plane_error: str | None = None) -> dict:
        """Commit (lengths advance) or roll back (pages return).

        A failed step is rolled back; lost shards are replaced. Returns ``recovered: True`` when
        every sequence of the step survived (the client may replay it); raises ShardLostError
        naming the sequences whose KV was lost otherwise.
        """
        with self._lock:
            step = self.steps.get(step_id)
            if step is None:
                raise InvalidRequestError(f"step {step_id} is not open")
        reports, failure = [], data_plane_error
        if failure is None:
            try:
                reports = ray.get(step.refs, timeout=self.config.rpc_timeout_s)
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
            self.check_shards(timeout_s=min(self.config.rpc_timeout_s, self.config.shard_hang_timeout_s))
        with self._lock:
            self.steps.pop(step_id, None)
            for seq_id, new_len in zip(step.seq_ids, step.new_lengths):
                seq = self.sequences.get(seq_id)
                if seq is None:
                    continue
                seq.in_step = None
                if commit:
                    seq.length = new_len
                    self._persist_sequence(seq)
            if commit:
                self.num_steps_committed += 1
                self.metrics.record_step(time.perf_counter() - step.started, step.num_tokens)
            else:
                self.allocator.undo(step.growth)
                self.num_steps_rolled_back += 1
                self.metrics.record_rollback()
            self._publish_blocks_used()
        if failure is None:
            return {"shard_plan_s": max((r.get("plan_s", 0.0) for r in reports), default=0.0),
                    "attention_s": max((r.get("attention_s", 0.0) for r in reports), default=0.0),
                    "shard_wire_s": max((r.get("wire_s", 0.0) for r in reports), default=0.0)}
        if not self.shard_set.lost and step.epoch == self.epoch:
            self.metrics.record_error("ServiceError")
            raise ServiceError(f"step {step_id} failed and was rolled back: {failure}")
        self.recover()   # a no-op when the health thread already replaced the shard (epoch moved on)
        with self._lock:
            # Sequences dropped while in this step are released now that the step is closed.
            for seq_id in step.seq_ids:
                seq = self.sequences.get(seq_id)
                if seq_id in self.dropped and seq is not None:
                    self.allocator.release(seq.rows)
                    del self.sequences[seq_id]
            try:
                self._raise_if_unavailable(step.seq_ids)
            except ShardLostError as exc:
                self.metrics.record_error(type(exc).__name__)
                raise
        return {"recovered": True, "epoch": self.epoch, "failure": failure}

    def fill_synthetic(self, client_id: str, seq_id: str, num_tokens: int, seed: int) -> int:
        """Append ``num_tokens`` of seeded random KV to a sequence without attention (benchmarks, load tests)."""
        with self._lock:
            self._check_client(client_id)
            self._raise_if_unavailable([seq_id])
            seq = self._get_sequence(seq_id)
            if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
                raise InvalidRequestError(f"num_tokens {num_tokens!r} must be an int >= 1")
            if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**40:
                raise InvalidRequestError(f"seed {seed!r} must be an int in 0..2**40")
            self._check_fits(seq, num_tokens)
            self._check_quota(client_id, num_tokens)
            if seq.in_step is not None:
                raise InvalidRequestError(f"sequence {seq_id} is in open step {seq.in_step}")
            growth = self.allocator.grow([(seq.rows, seq.length + num_tokens)])
            plans = plan_step(self.allocator, [StepRequest(seq.rows, seq.length, num_tokens)], 0, False, 1)
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
    def stats(self) -> dict:
        with self._lock:
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
            for s in self.sequences.values():
                c = per_client.setdefault(s.owner, {"sequences": 0, "tokens": 0})
                c["sequences"] += 1
                c["tokens"] += s.length
            return {"shards": shards, "num_sequences": len(self.sequences), "clients": per_client,
                    "steps_committed": self.num_steps_committed, "steps_rolled_back": self.num_steps_rolled_back,
                    "shards_replaced": self.num_shards_replaced, "epoch": self.epoch,
                    "kv_replicas": self.config.kv_replicas, "kv_cache_dtype": self.config.kv_cache_format,
                    "kv_bytes_per_block": bytes_per_block,
                    "backend": self.shard_set.infos[0]["backend"] if self.shard_set.infos else None,
                    "kernel_version": self.shard_set.infos[0]["kernel_version"] if self.shard_set.infos else None}
