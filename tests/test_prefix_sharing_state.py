"""Forks and share tokens in the coordinator's state owners alone (no Ray): what a token grants and for how long,
which sequences may be forked, and what a refused request leaves (nothing)."""

from __future__ import annotations

import pytest

from conftest import service_config
from cpattn.cluster.prefix_sharing import PrefixSharing
from cpattn.cluster.sequence_table import SequenceTable
from cpattn.errors import AccessDeniedError, CapacityError, InvalidRequestError


class Clock:
    now = 1000.0

    def __call__(self) -> float:
        return self.now


def _state(**overrides):
    table = SequenceTable(service_config(num_shards=3, **overrides))
    clock = Clock()
    return table, PrefixSharing(table, lambda: "secret-a", clock), clock


def _grown(table, owner, seq_id, length):
    seq = table.add(owner, seq_id)
    table.finish(table.grow([seq], [length]))
    table.commit([seq_id], [length], 1)
    return seq


def test_a_token_grants_the_length_when_shared_until_it_expires():
    table, sharing, clock = _state()
    _grown(table, "alice", "seq-a", 10)
    token = sharing.share("alice", "seq-a", ttl_s=60)
    part = sharing.share("alice", "seq-a", num_tokens=4)
    table.finish(table.grow([table.get("seq-a")], [15]))
    table.commit(["seq-a"], [15], 2)
    fork = sharing.fork_shared("bob", token)
    assert table.get(fork, "bob").length == 10 and table.get(sharing.fork_shared("bob", part), "bob").length == 4
    with pytest.raises(InvalidRequestError, match="unknown or freed sequence"):
        table.get(fork, "alice")                  # the owner sees nothing of the grantee's fork
    clock.now += 61
    with pytest.raises(AccessDeniedError, match=r"expired 1s ago"):
        sharing.fork_shared("bob", token)
    other_service = PrefixSharing(table, lambda: "secret-b", clock)
    with pytest.raises(AccessDeniedError, match="not issued by this service"):
        other_service.fork_shared("bob", part)


def test_refused_shares_and_forks_change_nothing():
    table, sharing, _ = _state(max_sequences=3, max_tokens_per_client=25)
    _grown(table, "alice", "seq-a", 10)

    def snapshot():
        return ({k: (s.owner, s.length) for k, s in table.sequences.items()},
                [(p.num_used_blocks, p.num_shared_blocks) for p in table.allocator.pools])

    for bad, match in ((0, "ttl_s 0 must be"), (-5.0, "ttl_s -5.0"), (True, "ttl_s True"), (10**9, "ttl_s 1000000000")):
        with pytest.raises(InvalidRequestError, match=match):
            sharing.share("alice", "seq-a", ttl_s=bad)
    with pytest.raises(InvalidRequestError, match="unknown or freed sequence"):
        sharing.share("bob", "seq-a")
    sharing.fork("alice", "seq-a")                # 20 of alice's 25 quota tokens: a fork counts fully
    before = snapshot()
    with pytest.raises(CapacityError, match="client quota: holding 20 tokens, this step adds 10"):
        sharing.fork("alice", "seq-a")
    table.begin([table.get("seq-a")], 7)
    token = sharing.share("alice", "seq-a")
    with pytest.raises(InvalidRequestError, match="is in open step 7: fork it after that step ends"):
        sharing.fork_shared("bob", token)
    table.get("seq-a").in_step = None
    assert snapshot() == before
    _grown(table, "bob", "seq-b", 2)              # the third sequence: the service holds its most
    before = snapshot()
    with pytest.raises(InvalidRequestError, match="max_sequences=3"):
        sharing.fork_shared("bob", token)
    assert snapshot() == before


def test_a_freed_source_voids_its_tokens_and_keeps_its_forks():
    table, sharing, _ = _state()
    _grown(table, "alice", "seq-a", 9)
    token = sharing.share("alice", "seq-a")
    fork = sharing.fork_shared("bob", token)
    used = [p.num_used_blocks for p in table.allocator.pools]
    table.free("seq-a", "alice")
    assert [p.num_used_blocks for p in table.allocator.pools] == used     # the fork holds every page
    with pytest.raises(InvalidRequestError, match="freed by its owner"):
        sharing.fork_shared("bob", token)
    table.free(fork, "bob")
    assert all(p.num_used_blocks == 0 for p in table.allocator.pools)


def test_a_copy_on_write_resends_the_row_and_rewrites_the_journal():
    """A client computing a shard in-process caches block-table rows by version (page_delta.py), and the journal
    rewrites page lists only when their count changes: a page replaced by its copy must bump both."""
    table, sharing, _ = _state()
    source = _grown(table, "alice", "seq-a", 10)
    fork = table.get(sharing.fork("alice", "seq-a"), "alice")
    source.persisted_pages = fork.persisted_pages = 7
    versions = (source.pages_version, fork.pages_version)
    growth = table.grow([fork], [11])             # token 10 lands in shard 1's shared, partly filled page
    assert [(c.shard, c.index) for c in growth.copies] == [(1, 0)]
    assert (source.pages_version, fork.pages_version) == (versions[0], versions[1] + 1)
    assert fork.persisted_pages == -1 and source.persisted_pages == 7
    table.undo(growth, [fork.seq_id])
    assert table.allocator.pools[1].num_shared_blocks == 1          # the rollback left the page shared


def test_a_client_holds_at_most_max_sequences_per_client_rows_forks_included():
    """Empty sequences hold no tokens, so max_tokens_per_client cannot stop one client from taking every row of
    max_sequences: max_sequences_per_client does, counting adds, forks and forks of another client's share."""
    table, sharing, _ = _state(max_sequences=6, max_sequences_per_client=2)
    _grown(table, "alice", "seq-a", 10)
    token = sharing.share("alice", "seq-a")
    sharing.fork("alice", "seq-a")
    used = [p.num_used_blocks for p in table.allocator.pools]

    def refused(call):
        before = {k: (s.owner, s.length) for k, s in table.sequences.items()}
        with pytest.raises(CapacityError, match="client quota: holding 2 sequences, max_sequences_per_client "
                                                "is 2: free sequences or raise the quota") as err:
            call()
        assert (err.value.needed, err.value.free) == (3, 0)
        assert {k: (s.owner, s.length) for k, s in table.sequences.items()} == before
        assert [p.num_used_blocks for p in table.allocator.pools] == used

    refused(lambda: table.add("alice", "seq-c"))
    refused(lambda: sharing.fork("alice", "seq-a"))
    bob = [table.add("bob", "seq-b").seq_id, sharing.fork_shared("bob", token)]   # bob's own two
    refused(lambda: table.add("bob", "seq-d"))
    refused(lambda: sharing.fork_shared("bob", token))
    table.free(bob[0], "bob")                    # freeing gives the row back to its owner's quota
    assert table.get(sharing.fork_shared("bob", token)).owner == "bob"
