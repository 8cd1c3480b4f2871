"""Replacing lost shards, for the coordinator: fencing after a restart, refilling a replacement from the
replicas (or dropping the sequences it held), and settling after a failed step.

The coordinator owns the state (its ShardSet and SequenceTable, under its lock); this module owns the order
of a replacement and the one recovery lock, so two threads never replace the same shard.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import ray

from cpattn.cluster.messages import ShardStepReport
from cpattn.cluster.open_steps import OpenStep
from cpattn.cluster.recovery import refill_copies
from cpattn.cluster.sequence_table import SequenceTable
from cpattn.cluster.shard_set import CONTROL_GROUP, ShardSet
from cpattn.errors import CpattnError

logger = logging.getLogger("cpattn.coordinator")

END_STEP_PING_S = 2.0   # one round of pings within a failed step's settling
SETTLE_POLL_S = 0.25


class ShardRecovery:
    def __init__(self, shard_set: ShardSet, table: SequenceTable, lock: threading.RLock,
                 on_replaced: Callable[[], None]):
        self.shard_set = shard_set
        self.table = table
        self.config = shard_set.config
        self._lock = lock                   # the coordinator's: guards table and shard_set bookkeeping
        self._on_replaced = on_replaced     # under the lock, after each replacement (epoch, journal)
        self._recovery_lock = threading.Lock()

    def start_watching(self, stop: threading.Event, also: Callable[[], object]) -> None:
        threading.Thread(target=self.watch, args=(stop, also), daemon=True, name="cpattn-health").start()

    def watch(self, stop: threading.Event, also: Callable[[], object]) -> None:
        """The health thread: every health_check_interval_s, replace lost shards, then run ``also`` (leases)."""
        while not stop.wait(self.config.health_check_interval_s):
            try:
                if self.check(timeout_s=self.config.shard_hang_timeout_s):
                    self.recover()
            except Exception:   # never let the watchdog die; the next round retries
                logger.exception("health check failed")
            try:
                also()
            except Exception:
                logger.exception("client lease check failed")

    def fence(self, incarnation: int) -> None:
        """Before any page is handed out again: no step of an earlier incarnation may write on any shard.

        The steps open when the previous incarnation died are not in the journal, so their pages are free
        here; each shard refuses their remaining layers and returns once none of them is mid-write. A shard
        that cannot confirm is treated as lost (the health check replaces it, killing the old process).
        """
        cfg, lost, secret = self.config, self.shard_set.lost, self.shard_set.secret
        refs = {rank: h.fence.options(concurrency_group=CONTROL_GROUP).remote(incarnation, cfg.rpc_timeout_s, secret)
                for rank, h in enumerate(self.shard_set.handles) if h is not None and rank not in lost}
        for rank, ref in refs.items():
            try:
                ray.get(ref, timeout=cfg.rpc_timeout_s + 5)
            except Exception as exc:
                lost[rank] = f"could not be fenced after a coordinator restart ({type(exc).__name__})"
                logger.error("shard %d: %s", rank, lost[rank])

    def check(self, timeout_s: float | None = None) -> dict[int, str]:
        """Ping every shard; returns rank -> why for the lost ones."""
        return self.shard_set.check(timeout_s if timeout_s is not None else self.config.rpc_timeout_s)

    def recover(self) -> None:
        """Replace every lost shard in its bundle; refill from replicas or drop the sequences it held."""
        with self._recovery_lock:
            for rank in sorted(self.shard_set.lost):
                self._replace(rank)

    def _replace(self, rank: int) -> None:
        cfg, lost, allocator, secret = self.config, self.shard_set.lost, self.table.allocator, self.shard_set.secret
        why = lost[rank]
        new, info = self.shard_set.start_replacement(rank)
        with self._lock:
            sources = {allocator.replica_holder(rank), allocator.primary_of(rank)} - {rank}
            copies = None
            if cfg.kv_replicas == 2 and not sources & set(lost):
                copies = refill_copies(allocator, [s.rows for s in self.table.sequences.values()], rank)
            else:
                self.table.drop_on(rank, why)
        for copy in copies or []:
            src = self.shard_set.handles[copy.src]
            pages = src.read_blocks.remote(copy.src_blocks, secret)
            scales = src.read_block_scales.remote(copy.src_blocks, secret)     # fp8: the pages' own scales
            ray.get(new.write_blocks.remote(copy.dst_blocks, pages, secret, scales=scales), timeout=cfg.rpc_timeout_s)
        ray.get(new.mark_ready.remote(secret), timeout=cfg.rpc_timeout_s)
        with self._lock:
            self.shard_set.install(rank, new, info)
            self.table.forget_dropped_in_journal()
            self._on_replaced()
        logger.warning("shard %d replaced (%s); %s", rank, why,
                       "refilled from replicas" if copies is not None else "its sequences were dropped")

    def step_failure(self, step: OpenStep, failure: str | None,
                     epoch: Callable[[], int]) -> tuple[list[ShardStepReport], str | None]:
        """A step's shard reports, and why it failed (None: it may commit). ``epoch()``: the coordinator's now."""
        reports = []
        if failure is None:
            try:
                # The client received every partial, so the shards' calls have ended or are about to: a call that
                # does not return within a collective timeout is cut off (a partition), not waited for.
                reports = ray.get(step.refs, timeout=min(self.config.rpc_timeout_s, self.config.collective_timeout_s))
                broken = [r.error for r in reports if r.outcome == "broken"]
                if broken:
                    failure = f"data plane broke on a shard: {broken[0]}"
            except (ray.exceptions.RayError, CpattnError) as exc:
                failure = f"{type(exc).__name__}: {exc}"
        if failure is None and step.local_ranks:
            # The client wrote those shards' KV itself: commit only if they are still the same, live
            # processes (a replacement would not hold what was written into its predecessor).
            lost = self.check(timeout_s=min(self.config.rpc_timeout_s, self.config.shard_hang_timeout_s))
            if step.epoch != epoch() or set(lost) & set(step.local_ranks):
                failure = f"a shard the client computed in-process was lost: {lost}"
        return reports, failure

    def settle(self, deadline: float) -> None:
        """After a failed step, until ``deadline``: wait for silent shards to answer or be declared lost, and for
        lost ones to be replaced (in the background, as the health thread does). Returns early once settled."""
        cfg = self.config
        ping_s = min(cfg.rpc_timeout_s, cfg.shard_hang_timeout_s, END_STEP_PING_S)
        while True:
            lost = self.check(timeout_s=max(0.1, min(ping_s, deadline - time.monotonic())))
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
