"""Persisted coordinator state, so a detached coordinator restarted by Ray keeps every sequence.

Kept in Ray's GCS key-value store under ``cpattn/<namespace>/<name>/``. Only committed state is
written: a sequence's length after each commit (tiny), its page lists only when they change, and
the service metadata (epoch, clients, shard bundles) when it changes. Pages allocated by a step
that never committed are not in the journal, so a restore frees them by construction.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass

from ray.experimental import internal_kv


@dataclass
class SequenceRecord:
    owner: str
    length: int
    primary: tuple[int, ...]
    replica: tuple[int, ...] | None
    pages: dict[tuple[int, int], list[int]]
    """(shard, row) -> page ids, for every row of the sequence."""


class CoordinatorJournal:
    def __init__(self, namespace: str, name: str):
        self.prefix = f"cpattn/{namespace}/{name}/"

    def _put(self, key: str, value) -> None:
        internal_kv._internal_kv_put(self.prefix + key, pickle.dumps(value), overwrite=True)

    def put_meta(self, meta: dict) -> None:
        self._put("meta", meta)

    def put_pages(self, seq_id: str, owner: str, primary, replica, pages: dict) -> None:
        self._put(f"pages/{seq_id}", (owner, tuple(primary), None if replica is None else tuple(replica), pages))

    def put_length(self, seq_id: str, length: int) -> None:
        self._put(f"len/{seq_id}", length)

    def delete_sequence(self, seq_id: str) -> None:
        internal_kv._internal_kv_del(self.prefix + f"pages/{seq_id}")
        internal_kv._internal_kv_del(self.prefix + f"len/{seq_id}")

    def load(self) -> tuple[dict | None, dict[str, SequenceRecord]]:
        raw = internal_kv._internal_kv_get(self.prefix + "meta")
        if raw is None:
            return None, {}
        meta = pickle.loads(raw)
        records = {}
        for key in internal_kv._internal_kv_list(self.prefix + "pages/"):
            seq_id = key.decode().rsplit("/", 1)[-1]
            owner, primary, replica, pages = pickle.loads(internal_kv._internal_kv_get(key))
            length_raw = internal_kv._internal_kv_get(self.prefix + f"len/{seq_id}")
            length = pickle.loads(length_raw) if length_raw is not None else 0
            records[seq_id] = SequenceRecord(owner, length, primary, replica, pages)
        return meta, records

    def clear(self) -> None:
        internal_kv._internal_kv_del(self.prefix, del_by_prefix=True)
