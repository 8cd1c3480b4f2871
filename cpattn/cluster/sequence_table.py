"""The coordinator's sequences: who owns each, its committed length, its rows in the block allocator, the
pages a client may hold (``pages_version``, cluster/page_delta.py), and what the journal holds of it.

Pure state: no Ray and no lock (the coordinator holds its lock around every call). A step's life here is
``check_growth`` (every sequence), ``grow`` (pages for all of them, or none), then ``commit`` or ``undo``.
Sequences whose KV went with a lost shard are ``dropped``: using them raises ShardLostError naming them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpattn.cluster.ids import canonical_id, canonical_request
from cpattn.cluster.journal import CoordinatorJournal, SequenceUpdate
from cpattn.cluster.page_delta import Delta, row_deltas
from cpattn.cluster.sequence_limits import SequenceLimits, row_width
from cpattn.config import ServiceConfig
from cpattn.errors import CapacityError, InvalidRequestError, ShardLostError
from cpattn.kvstore.run_growth import grow_decode_run
from cpattn.kvstore.sharded_allocator import Growth, SequenceRows, ShardedKVAllocator, restore_allocator


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
    release_from: int = 0       # length - window at which a page can next go back (sequence_limits.py)


class SequenceTable:
    def __init__(self, config: ServiceConfig, journal: CoordinatorJournal | None = None):
        self.config = config
        self.journal = journal
        self.allocator = ShardedKVAllocator(config.num_shards, config.blocks_per_shard(), config.block_size,
                                            config.dcp_interleave, config.max_sequences, config.kv_replicas,
                                            row_width(config))
        self.limits = SequenceLimits(config, self.allocator)
        self.sequences: dict[str, Sequence] = {}
        self.dropped: dict[str, tuple] = {}   # seq_id -> (rank, why, owner): KV lost with a shard

    def restore(self, records: dict) -> None:
        """After a coordinator restart: the journal's sequences, with their pages taken again."""
        restore_allocator(self.allocator, [(SequenceRows(r.primary, r.replica), r.length, r.pages)
                                           for r in records.values()])
        for seq_id, r in records.items():
            seq = Sequence(seq_id, r.owner, SequenceRows(r.primary, r.replica), r.length, last_step=r.last_step)
            seq.persisted_pages = self._num_pages(seq)
            self.sequences[seq_id] = seq

    def _num_pages(self, seq: Sequence) -> int:
        return sum(len(p) for p in self.allocator.pages_of(seq.rows).values())

    # Lookups ------------------------------------------------------------------------------------------------
    def get(self, seq_id, client_id: str | None = None) -> Sequence:
        """The caller's sequence; another client's id is exactly as unknown as an id that never existed."""
        seq_id = canonical_id(seq_id)
        seq = self.sequences.get(seq_id) if isinstance(seq_id, str) else None
        if seq is None or (client_id is not None and seq.owner != client_id):
            raise InvalidRequestError(
                f"unknown or freed sequence {seq_id!r}: use an id returned by add_sequence() that was not freed")
        return seq

    def owned_by(self, client_id: str) -> list[Sequence]:
        return [s for s in self.sequences.values() if s.owner == client_id]

    def lengths_of(self, client_id: str) -> dict[str, int]:
        return {s.seq_id: s.length for s in self.owned_by(client_id)}

    def raise_if_unavailable(self, seq_ids: list, client_id: str | None = None) -> None:
        seq_ids = [canonical_id(s) for s in seq_ids]
        dropped = [s for s in seq_ids if isinstance(s, str) and s in self.dropped   # ids may be hostile/unhashable
                   and self.dropped_owner(s) in (None, client_id)]                  # others' ids stay unknown
        if dropped:
            rank, why = self.dropped[dropped[0]][:2]
            raise ShardLostError(
                f"shard {rank} {why}: sequences {dropped} lost KV held there; start them again as new sequences "
                "(replay the prompt), or run with kv_replicas=2 to survive shard loss", shard=rank, sequences=dropped)

    def dropped_owner(self, seq_id: str) -> str | None:
        entry = self.dropped[seq_id]
        return entry[2] if len(entry) > 2 else None   # journals before issue 12 did not record owners

    # Adding and freeing -------------------------------------------------------------------------------------
    def check_room(self, owner: str) -> None:
        """A row for one more sequence of ``owner``: the service's (max_sequences) and the client's quota."""
        if not self.allocator.can_add_row():
            raise InvalidRequestError(f"the service holds max_sequences={self.config.max_sequences} sequences: "
                                      "free some or raise max_sequences")
        quota = self.config.max_sequences_per_client
        held = len(self.owned_by(owner)) if quota is not None else 0
        if quota is not None and held >= quota:
            raise CapacityError(f"client quota: holding {held} sequences, max_sequences_per_client is {quota}: "
                                "free sequences or raise the quota", needed=held + 1, free=0)

    def add(self, owner: str, seq_id: str) -> Sequence:
        self.check_room(owner)
        seq = Sequence(seq_id, owner, self.allocator.add_rows())
        self.sequences[seq_id] = seq
        self.persist([seq])
        return seq

    def free(self, seq_id, client_id: str) -> None:
        """The client's sequence (or its dropped id) forgotten; its pages return."""
        seq_id = canonical_id(seq_id)
        if (isinstance(seq_id, str) and seq_id in self.dropped and seq_id not in self.sequences
                and self.dropped_owner(seq_id) in (None, client_id)):
            del self.dropped[seq_id]
            return
        seq = self.get(seq_id, client_id)
        if seq.in_step is not None:
            raise InvalidRequestError(f"sequence {seq_id} is in open step {seq.in_step}: finish the step first")
        self.remove(seq)

    def remove(self, seq: Sequence) -> None:
        self.allocator.release(seq.rows)
        del self.sequences[seq.seq_id]
        self.dropped.pop(seq.seq_id, None)
        if self.journal is not None:
            self.journal.delete_sequence(seq.seq_id)

    def free_idle_of(self, client_id: str) -> list[str]:
        """Free the client's sequences that are in no step; their ids."""
        idle = [s for s in self.owned_by(client_id) if s.in_step is None]
        for seq in idle:
            self.remove(seq)
        return [s.seq_id for s in idle]

    def release_dropped(self, seq_ids: list[str]) -> None:
        """Sequences dropped while in a step are released once the step is closed."""
        for seq_id in seq_ids:
            seq = self.sequences.get(seq_id)
            if seq_id in self.dropped and seq is not None:
                self.allocator.release(seq.rows)
                del self.sequences[seq_id]

    def drop_on(self, rank: int, why: str) -> None:
        """Shard ``rank`` was lost with no replica: every sequence with tokens there is dropped."""
        for s in list(self.sequences.values()):
            if self.allocator.local_tokens(s.length, rank) > 0:
                self.dropped[s.seq_id] = (rank, why, s.owner)
                if s.in_step is None:
                    self.allocator.release(s.rows)
                    del self.sequences[s.seq_id]

    def forget_dropped_in_journal(self) -> None:
        if self.journal is not None:
            for seq_id in self.dropped:
                if seq_id not in self.sequences:
                    self.journal.delete_sequence(seq_id)

    # A step: check, grow, then commit or undo --------------------------------------------------------------
    def admit(self, client_id: str, request) -> tuple[list[Sequence], dict]:
        """A step's sequences and its canonical {seq_id: num_new_tokens}, once each may grow."""
        if not isinstance(request, dict) or not request:
            raise InvalidRequestError(f"a step needs a non-empty {{seq_id: num_new_tokens}} dict, got {request!r}")
        request = canonical_request(request)
        self.raise_if_unavailable(list(request), client_id)
        seqs = []
        for seq_id, n in request.items():
            seq = self.get(seq_id, client_id)
            self.limits.check_growth(seq, n, f"sequence {seq_id}: num_new_tokens", "already in")
            seqs.append(seq)
        return seqs, request

    def grow(self, seqs: list[Sequence], new_lengths: list[int]) -> Growth:
        """Pages for every sequence's new length; CapacityError before changing anything."""
        lengths = [s.length for s in seqs]
        # A decode (one token each) takes the fast path; one that does not fit raises from grow() below.
        fast = grow_decode_run(self.allocator, [s.rows for s in seqs], lengths, 1, first_step=0) \
            if all(n == m + 1 for n, m in zip(new_lengths, lengths)) else []
        growth = fast[0] if fast else self.allocator.grow([(s.rows, n) for s, n in zip(seqs, new_lengths)], lengths)
        _note_copies(seqs, growth)
        return growth

    def grow_run(self, seqs: list[Sequence], num_steps: int) -> list[Growth]:
        """Pages for a decode run's steps 1 .. num_steps-1 (kvstore/run_growth.py; shortened where a pool runs out)."""
        growths = grow_decode_run(self.allocator, [s.rows for s in seqs], [s.length for s in seqs], num_steps)
        for growth in growths:
            _note_copies(seqs, growth)
        return growths

    def finish(self, growth: Growth) -> None:
        """After a commit: drop the references to shared pages the step copied (copy on write)."""
        self.allocator.finish(growth)

    def fork(self, source: Sequence, owner: str, seq_id: str, num_tokens: int) -> Sequence:
        """A new sequence of ``owner`` whose first ``num_tokens`` tokens are ``source``'s, sharing its pages."""
        self.check_room(owner)
        self.limits.check_fork(source, num_tokens)
        seq = Sequence(seq_id, owner, self.allocator.fork_rows(source.rows, num_tokens), num_tokens)
        self.sequences[seq_id] = seq
        self.persist([seq])
        return seq

    @staticmethod
    def begin(seqs: list[Sequence], step_id: int) -> None:
        """The sequences are in step ``step_id`` until it commits or is undone."""
        for seq in seqs:
            seq.in_step = step_id

    def commit(self, seq_ids: list[str], new_lengths: list[int], step_id: int, commit: bool = True) -> None:
        """Close a step on its sequences: lengths advance (``commit``) or stay; journalled atomically."""
        committed = []
        for seq_id, new_len in zip(seq_ids, new_lengths):
            seq = self.sequences.get(seq_id)
            if seq is None:
                continue
            seq.in_step = None
            if commit:
                seq.length, seq.last_step = new_len, step_id
                self._release_outside_window(seq)
                committed.append(seq)
        self.persist(committed)

    def advance(self, seq_ids: list[str], new_lengths: list[int], step_id: int) -> None:
        """A decode run's step committed: lengths advance, the sequences stay in the run; journalled."""
        advanced = []
        for seq_id, new_len in zip(seq_ids, new_lengths):
            seq = self.sequences.get(seq_id)
            if seq is not None and new_len > seq.length:
                seq.length, seq.last_step = new_len, step_id
                self._release_outside_window(seq)
                advanced.append(seq)
        self.persist(advanced)

    def _release_outside_window(self, seq: Sequence) -> None:
        if self.limits.release_outside_window(seq):
            seq.persisted_pages = -1   # the same number of pages, some released: the journal rewrites the list

    def undo(self, growth: Growth, seq_ids: list[str], step_id: int | None = None, release: bool = True) -> None:
        """A step that will not commit: its pages return, clients holding them get whole rows again (``release``:
        the sequences leave the step; not for a decode run's extension withdrawn)."""
        for seq in [s for s in map(self.sequences.get, seq_ids) if s is not None]:
            if release and (step_id is None or seq.in_step == step_id):
                seq.in_step = None
            seq.pages_version += 1
        self.allocator.undo(growth)

    def page_deltas(self, rank: int, seqs: list[Sequence], table_BW: torch.Tensor, held) -> list[Delta]:
        """The rank's block-table rows as deltas against what the client says it holds (page_delta.py)."""
        held = held if isinstance(held, dict) else {}
        claims = [held.get(s.seq_id) for s in seqs]
        claims = [c.get(rank) if isinstance(c, dict) else None for c in claims]
        pages = [self.allocator.tables[rank].num_blocks[s.rows.primary[rank]] for s in seqs]
        return row_deltas(table_BW, pages, [s.pages_version for s in seqs], claims)

    # Journal ------------------------------------------------------------------------------------------------
    def persist(self, seqs: list[Sequence]) -> None:
        """Lengths (with the committing step) always, page lists only when they changed; atomic over ``seqs``."""
        if self.journal is None or not seqs:
            return
        updates = []
        for seq in seqs:
            pages = self.allocator.pages_of(seq.rows)
            value = None
            if sum(len(p) for p in pages.values()) != seq.persisted_pages:
                value = self.journal.pages_value(seq.owner, seq.rows.primary, seq.rows.replica, pages)
            updates.append(SequenceUpdate(seq.seq_id, value, seq.length, seq.last_step))
        self.journal.commit(updates)
        for seq, u in zip(seqs, updates):
            if u.pages is not None:
                seq.persisted_pages = sum(len(p) for p in u.pages[3].values())

    # Usage (the rest of it: cluster/usage.py) --------------------------------------------------------------
    def blocks_used(self) -> list[int]:
        return [pool.num_used_blocks for pool in self.allocator.pools]


def _note_copies(seqs: list[Sequence], growth: Growth) -> None:
    """A copy on write replaced a page the sequence held: clients holding its pages and the journal must know."""
    if growth.copies:
        copied = {(c.shard, c.row) for c in growth.copies}
        for seq in seqs:
            rows = set(enumerate(seq.rows.primary)) | set(enumerate(seq.rows.replica or ()))
            if copied & rows:
                seq.pages_version += 1     # a page a client may hold was replaced by its copy (page_delta.py)
                seq.persisted_pages = -1   # same page count, other pages: the journal must rewrite them
