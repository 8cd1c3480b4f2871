"""Persisted coordinator state, so a detached coordinator restarted by Ray keeps every sequence.

Kept in Ray's GCS key-value store under ``cpattn/<namespace>/<name>/``. Only committed state is
written: a sequence's length (and the id of the step that committed it) after each commit (tiny), its
page lists only when they change, and the service metadata (epoch, incarnation, clients, shard bundles)
when it changes. Pages allocated by a step that never committed are not in the journal, so a restore
frees them by construction.

A step over several sequences commits atomically: one ``commit`` record holding every update is written
first and deleted after the per-sequence keys; a restore applies a leftover record over them.
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
    last_step: int = 0
    """The step that committed ``length`` (0: none, or fill_synthetic)."""


@dataclass
class SequenceUpdate:
    """One sequence's part of a commit: new pages (None: unchanged), its length and the committing step."""

    seq_id: str
    pages: tuple | None
    length: int
    step_id: int


class CoordinatorJournal:
    def __init__(self, namespace: str, name: str):
        self.prefix = f"cpattn/{namespace}/{name}/"

    def _put(self, key: str, value) -> None:
        internal_kv._internal_kv_put(self.prefix + key, pickle.dumps(value), overwrite=True)

    def put_meta(self, meta: dict) -> None:
        self._put("meta", meta)

    @staticmethod
    def pages_value(owner: str, primary, replica, pages: dict) -> tuple:
        return (owner, tuple(primary), None if replica is None else tuple(replica), pages)

    def put_pages(self, seq_id: str, owner: str, primary, replica, pages: dict) -> None:
        self._put(f"pages/{seq_id}", self.pages_value(owner, primary, replica, pages))

    def put_length(self, seq_id: str, length: int, step_id: int = 0) -> None:
        self._put(f"len/{seq_id}", (length, step_id))

    def commit(self, updates: list[SequenceUpdate]) -> None:
        """Write a step's updates, atomically when there are several (see the module docstring)."""
        if len(updates) > 1:
            self._put("commit", updates)
        for u in updates:
            if u.pages is not None:
                self._put(f"pages/{u.seq_id}", u.pages)
            self.put_length(u.seq_id, u.length, u.step_id)
        if len(updates) > 1:
            internal_kv._internal_kv_del(self.prefix + "commit")

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
            length = pickle.loads(length_raw) if length_raw is not None else (0, 0)
            length, last_step = length if isinstance(length, tuple) else (length, 0)
            records[seq_id] = SequenceRecord(owner, length, primary, replica, pages, last_step)
        raw = internal_kv._internal_kv_get(self.prefix + "commit")
        for u in pickle.loads(raw) if raw is not None else ():   # a commit cut short by a crash: roll it forward
            if u.pages is not None:
                owner, primary, replica, pages = u.pages
                records[u.seq_id] = SequenceRecord(owner, u.length, primary, replica, pages, u.step_id)
            elif u.seq_id in records:
                records[u.seq_id].length, records[u.seq_id].last_step = u.length, u.step_id
        return meta, records

    def clear(self) -> None:
        internal_kv._internal_kv_del(self.prefix, del_by_prefix=True)
