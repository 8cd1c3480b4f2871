"""The coordinator's remote methods on sequences: add, free, fork and share, lengths, synthetic fills.

A mixin of cluster.coordinator.Coordinator (its lock, state owners and shard handles): each method checks the
caller's credential and hands the call to SequenceTable, PrefixSharing or StepLedger under the lock.
"""

from __future__ import annotations

import threading

import ray

from cpattn.cluster.client_registry import ClientRegistry
from cpattn.cluster.generations import Generations
from cpattn.cluster.ids import new_sequence_id
from cpattn.cluster.metrics import ServiceMetrics
from cpattn.cluster.prefix_sharing import PrefixSharing
from cpattn.cluster.sequence_table import SequenceTable
from cpattn.cluster.shard_set import ShardSet
from cpattn.cluster.step_ledger import StepLedger
from cpattn.config import ServiceConfig


class SequenceMethods:
    config: ServiceConfig
    _lock: threading.RLock
    gen: Generations
    clients: ClientRegistry
    table: SequenceTable
    sharing: PrefixSharing
    ledger: StepLedger
    shard_set: ShardSet
    metrics: ServiceMetrics

    def _publish_blocks_used(self) -> None:
        """After pages changed hands: the blocks-used gauge per shard."""
        self.metrics.set_blocks_used(self.table.blocks_used())

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
            seq, growth, plans = self.ledger.plan_fill(self.clients.check(credential), seq_id, num_tokens, seed,
                                                       self.gen)
            shards = list(self.shard_set.handles)
        try:
            ray.get([h.fill_synthetic.remote(p, seed) for h, p in zip(shards, plans)], timeout=self.config.rpc_timeout_s)
        except BaseException:
            with self._lock:
                self.ledger.undo_fill(seq, growth)
            raise
        with self._lock:
            return self.ledger.commit_fill(seq, num_tokens, growth)
