"""Coordinator: owns sequences, lengths and block allocation per shard; plans each step once.

A plain class; ``ray.remote`` is applied in ``cluster.service``. It starts the shard actors in a
placement group, assigns ranks, builds one ShardStepPlan per rank per step and hands it to each
shard with a single Ray call; per-layer tensors never pass through here.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from dataclasses import dataclass, field

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cpattn.cluster.placement import ShardLocation, assign_ranks, shard_bundles
from cpattn.cluster.shard import ShardWorker
from cpattn.cluster.step_planner import StepRequest, plan_step
from cpattn.config import ServiceConfig
from cpattn.errors import CapacityError, CpattnError, InvalidRequestError, ServiceError, ShardLostError
from cpattn.kvstore.sharded_allocator import Growth, ShardedKVAllocator

logger = logging.getLogger("cpattn.coordinator")

# Threads per shard actor: one step loop per connected client plus control calls.
SHARD_MAX_CONCURRENCY = 64


@dataclass
class Sequence:
    seq_id: str
    owner: str
    rows: tuple[int, ...]
    length: int = 0
    in_step: int | None = None


@dataclass
class OpenStep:
    step_id: int
    client_id: str
    seq_ids: list[str]
    new_lengths: list[int]
    growth: Growth
    refs: list = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)
    plan_s: float = 0.0


class Coordinator:
    def __init__(self, config: ServiceConfig):
        self.config = config
        self._lock = threading.RLock()
        self.shards: list = []          # actor handles, index = rank
        self.shard_infos: list[dict] = []
        self._pg = None
        self.allocator = ShardedKVAllocator(config.num_shards, config.blocks_per_shard(), config.block_size,
                                            config.dcp_interleave, config.max_sequences)
        self.sequences: dict[str, Sequence] = {}
        self.clients: dict[str, dict] = {}
        self.steps: dict[int, OpenStep] = {}
        self._next_step = 1
        self.lost: dict[int, str] = {}   # rank -> why
        self.num_steps_committed = 0
        self.num_steps_rolled_back = 0
        self._stop = threading.Event()

    # Lifecycle ------------------------------------------------------------------------------------
    def start(self) -> list[dict]:
        """Place and start the shards; on any failure remove what was started, then raise."""
        cfg = self.config
        try:
            self._pg = placement_group(shard_bundles(cfg.num_shards, cfg.num_cpus_per_shard, cfg.num_gpus_per_shard),
                                       strategy=cfg.placement_strategy)
            try:
                ray.get(self._pg.ready(), timeout=cfg.start_timeout_s)
            except ray.exceptions.GetTimeoutError:
                raise ServiceError(
                    f"could not place {cfg.num_shards} shards ({cfg.num_cpus_per_shard} CPU, {cfg.num_gpus_per_shard} GPU "
                    f"each, {cfg.placement_strategy}) within {cfg.start_timeout_s}s: the cluster lacks the resources; "
                    "lower num_shards / per-shard resources or add nodes") from None
            actor_cls = ray.remote(ShardWorker)
            handles = [
                actor_cls.options(
                    num_cpus=cfg.num_cpus_per_shard, num_gpus=cfg.num_gpus_per_shard,
                    max_concurrency=SHARD_MAX_CONCURRENCY,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=i),
                ).remote(cfg, i)
                for i in range(cfg.num_shards)]
            try:
                infos = ray.get([h.info.remote() for h in handles], timeout=cfg.start_timeout_s)
            except ray.exceptions.RayActorError as exc:
                raise ServiceError(f"a shard failed to start: {exc}") from exc
            self.shards = handles
            ranks = assign_ranks([ShardLocation(i["bundle_index"], i["node_ip"], i["node_id"], tuple(i["gpu_ids"]))
                                  for i in infos])
            by_rank = sorted(range(len(handles)), key=lambda i: ranks[i])
            self.shards = [handles[i] for i in by_rank]
            self.shard_infos = [dict(infos[i], rank=r) for r, i in enumerate(by_rank)]
        except BaseException:
            self._teardown()
            raise
        threading.Thread(target=self._health_loop, daemon=True, name="cpattn-health").start()
        first = self.shard_infos[0]
        logger.info("cpattn service %r: %d shards, backend %s (%s)", cfg.name, cfg.num_shards, first["backend"],
                    first["kernel_version"])
        return self.shard_infos

    def describe(self) -> dict:
        return {"config": self.config.model_dump(), "shards": self.shard_infos, "lost": dict(self.lost)}

    def get_shards(self) -> list:
        return list(self.shards)

    def shutdown(self) -> None:
        self._stop.set()
        self._teardown()

    def _teardown(self) -> None:
        for h in self.shards:
            try:
                ray.kill(h, no_restart=True)
            except Exception:
                pass
        self.shards = []
        if self._pg is not None:
            try:
                remove_placement_group(self._pg)
            except Exception:
                pass
            self._pg = None

    # Health ---------------------------------------------------------------------------------------
    def _health_loop(self) -> None:
        while not self._stop.wait(self.config.health_check_interval_s):
            self.check_shards(timeout_s=max(self.config.health_check_interval_s, 1.0))

    def check_shards(self, timeout_s: float | None = None) -> dict[int, str]:
        """Ping every shard; a dead or silent one is recorded as lost. Returns rank -> why for the lost."""
        timeout_s = timeout_s if timeout_s is not None else self.config.rpc_timeout_s
        shards = list(self.shards)
        refs = [h.ping.remote() for h in shards]
        deadline = time.monotonic() + timeout_s
        for rank, ref in enumerate(refs):
            if rank in self.lost:
                continue
            try:
                ok = ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
                why = None if ok else "stopped answering (hung)"
            except ray.exceptions.GetTimeoutError:
                why = f"did not answer a ping within {timeout_s:.1f}s"
            except ray.exceptions.RayActorError as exc:
                why = f"died ({type(exc).__name__})"
            if why is not None:
                with self._lock:
                    self.lost[rank] = why
                logger.error("shard %d lost: %s", rank, why)
        return dict(self.lost)

    def _sequences_on(self, rank: int) -> list[str]:
        return sorted(s.seq_id for s in self.sequences.values()
                      if self.allocator.local_tokens(s.length, rank) > 0 or s.in_step is not None)

    def _raise_if_lost(self) -> None:
        if self.lost:
            rank = min(self.lost)
            affected = self._sequences_on(rank)
            raise ShardLostError(
                f"shard {rank} {self.lost[rank]}; sequences {affected} lost KV on it: re-add them (new sequence, "
                "replay the prompt) after restarting the service, or run with kv_replicas=2",
                shard=rank, sequences=affected)

    # Clients and sequences ------------------------------------------------------------------------
    def register_client(self) -> str:
        client_id = secrets.token_hex(8)
        with self._lock:
            self.clients[client_id] = {"created": time.time()}
        return client_id

    def unregister_client(self, client_id: str) -> None:
        with self._lock:
            self.clients.pop(client_id, None)

    def add_sequence(self, client_id: str) -> str:
        with self._lock:
            self._check_client(client_id)
            if not self.allocator.can_add_row():
                raise InvalidRequestError(
                    f"the service holds max_sequences={self.config.max_sequences} sequences: free some or raise max_sequences")
            seq_id = "seq-" + secrets.token_urlsafe(16)   # unguessable: the id is the capability
            self.sequences[seq_id] = Sequence(seq_id, client_id, tuple(self.allocator.add_rows()))
            return seq_id

    def free(self, client_id: str, seq_id: str) -> None:
        with self._lock:
            self._check_client(client_id)
            seq = self._get_sequence(seq_id)
            if seq.in_step is not None:
                raise InvalidRequestError(f"sequence {seq_id} is in open step {seq.in_step}: finish the step first")
            self.allocator.release(list(seq.rows))
            del self.sequences[seq_id]

    def list_sequences(self, client_id: str) -> dict[str, int]:
        with self._lock:
            return {s.seq_id: s.length for s in self.sequences.values() if s.owner == client_id}

    def sequence_length(self, seq_id: str) -> int:
        with self._lock:
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
    def begin_step(self, client_id: str, group_name: str, request: dict) -> dict:
        """Validate, allocate, plan once, and hand each shard its plan. Nothing changes if it raises."""
        t0 = time.perf_counter()
        with self._lock:
            self._check_client(client_id)
            self._raise_if_lost()
            if not isinstance(request, dict) or not request:
                raise InvalidRequestError(f"a step needs a non-empty {{seq_id: num_new_tokens}} dict, got {request!r}")
            seqs, growths, requests = [], [], []
            for seq_id, n in request.items():
                seq = self._get_sequence(seq_id)
                if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                    raise InvalidRequestError(
                        f"sequence {seq_id}: num_new_tokens {n!r} must be an int >= 1")
                if seq.in_step is not None:
                    raise InvalidRequestError(f"sequence {seq_id} is already in open step {seq.in_step}")
                seqs.append(seq)
                growths.append((list(seq.rows), seq.length + n))
                requests.append(StepRequest(seq.rows, seq.length, n))
            quota = self.config.max_tokens_per_client
            if quota is not None:
                held = sum(s.length for s in self.sequences.values() if s.owner == client_id)
                extra = sum(request.values())
                if held + extra > quota:
                    raise CapacityError(
                        f"client quota: holding {held} tokens, this step adds {extra}, max_tokens_per_client is "
                        f"{quota}: free sequences or raise the quota", needed=held + extra, free=quota - held)
            growth = self.allocator.grow(growths)        # raises CapacityError before changing anything
            step_id = self._next_step
            self._next_step += 1
            try:
                plans = plan_step(self.allocator, requests, step_id, self.config.pcp_enabled,
                                  self.config.pcp_min_tokens)
            except BaseException:
                self.allocator.undo(growth)
                raise
            for seq in seqs:
                seq.in_step = step_id
            step = OpenStep(step_id, client_id, [s.seq_id for s in seqs], [g[1] for g in growths], growth)
            self.steps[step_id] = step
            shards = list(self.shards)
        step.refs = [h.run_step.remote(group_name, plan) for h, plan in zip(shards, plans)]
        step.plan_s = time.perf_counter() - t0
        return {"step_id": step_id, "num_tokens": plans[0].num_tokens, "seq_ids": step.seq_ids,
                "query_lens": [r.num_new for r in requests], "plan_s": step.plan_s}

    def end_step(self, step_id: int, commit: bool, data_plane_error: str | None = None) -> dict:
        """Commit (lengths advance) or roll back (pages return); a shard failure rolls back and raises."""
        with self._lock:
            step = self.steps.get(step_id)
            if step is None:
                raise InvalidRequestError(f"step {step_id} is not open")
        reports, failure = [], data_plane_error
        if failure is None:
            try:
                reports = ray.get(step.refs, timeout=self.config.rpc_timeout_s)
            except (ray.exceptions.RayError, CpattnError) as exc:
                failure = f"{type(exc).__name__}: {exc}"
        else:
            for ref in step.refs:
                ray.cancel(ref, force=False)
        if failure is not None:
            self.check_shards(timeout_s=min(self.config.rpc_timeout_s, 10.0))
            commit = False
        with self._lock:
            self.steps.pop(step_id, None)
            for seq_id, new_len in zip(step.seq_ids, step.new_lengths):
                seq = self.sequences.get(seq_id)
                if seq is None:
                    continue
                seq.in_step = None
                if commit:
                    seq.length = new_len
            if commit:
                self.num_steps_committed += 1
            else:
                self.allocator.undo(step.growth)
                self.num_steps_rolled_back += 1
            if failure is not None:
                self._raise_if_lost()
                raise ServiceError(f"step {step_id} failed and was rolled back: {failure}")
        return {"plan_s": step.plan_s + max((r.get("plan_s", 0.0) for r in reports), default=0.0),
                "attention_s": max((r.get("attention_s", 0.0) for r in reports), default=0.0),
                "shard_wire_s": max((r.get("wire_s", 0.0) for r in reports), default=0.0)}

    def fill_synthetic(self, client_id: str, seq_id: str, num_tokens: int, seed: int) -> int:
        """Append ``num_tokens`` of seeded random KV to a sequence without attention (benchmarks, load tests)."""
        with self._lock:
            self._check_client(client_id)
            self._raise_if_lost()
            seq = self._get_sequence(seq_id)
            if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
                raise InvalidRequestError(f"num_tokens {num_tokens!r} must be an int >= 1")
            if seq.in_step is not None:
                raise InvalidRequestError(f"sequence {seq_id} is in open step {seq.in_step}")
            growth = self.allocator.grow([(list(seq.rows), seq.length + num_tokens)])
            plans = plan_step(self.allocator, [StepRequest(seq.rows, seq.length, num_tokens)], 0, False, 1)
            seq.in_step = -1
            shards = list(self.shards)
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
            return seq.length

    # Stats ----------------------------------------------------------------------------------------
    def stats(self) -> dict:
        with self._lock:
            bytes_per_block = self.config.bytes_per_block()
            shards = []
            for rank in range(self.config.num_shards):
                pool = self.allocator.pools[rank]
                tokens = sum(self.allocator.local_tokens(s.length, rank) for s in self.sequences.values())
                info = self.shard_infos[rank] if rank < len(self.shard_infos) else {}
                shards.append({"rank": rank, "blocks_used": pool.num_used_blocks, "blocks_free": pool.num_free_blocks,
                               "tokens": tokens, "bytes": pool.num_used_blocks * bytes_per_block,
                               "node_ip": info.get("node_ip"), "device": info.get("device"),
                               "backend": info.get("backend"), "alive": rank not in self.lost})
            per_client: dict[str, dict] = {}
            for s in self.sequences.values():
                c = per_client.setdefault(s.owner, {"sequences": 0, "tokens": 0})
                c["sequences"] += 1
                c["tokens"] += s.length
            return {"shards": shards, "num_sequences": len(self.sequences), "clients": per_client,
                    "steps_committed": self.num_steps_committed, "steps_rolled_back": self.num_steps_rolled_back,
                    "backend": self.shard_infos[0]["backend"] if self.shard_infos else None,
                    "kernel_version": self.shard_infos[0]["kernel_version"] if self.shard_infos else None}
