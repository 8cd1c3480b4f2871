"""The coordinator's sequence methods (cluster/coordinator_sequences.py) on a plain Coordinator, without Ray: its
shards are plain shard surfaces behind LocalActor handles (tests/local_actors.py). Credentials, ownership between
two clients, bad input refused with nothing changed, and fill_synthetic's KV against synthetic_kv itself."""

from __future__ import annotations

import pytest

from conftest import service_config
from cpattn.cluster import coordinator_sequences
from cpattn.cluster.shard_kv import synthetic_kv
from cpattn.errors import AccessDeniedError, CapacityError, InvalidRequestError, StepFencedError
from local_actors import FakeRay, LocalActor, plain_coordinator

BLOCK, BLOCKS = 4, 8   # per shard; 2 shards: 64 tokens in all


class Failing:
    """A shard whose fill fails (fenced by a restarted coordinator) after its sibling wrote its share."""

    def fill_synthetic(self, plan, seed):
        raise StepFencedError("shard 1: fill_synthetic was fenced by a restarted coordinator: fill again")


@pytest.fixture
def coord(monkeypatch):
    monkeypatch.setattr(coordinator_sequences, "ray", FakeRay)
    return plain_coordinator(service_config(num_shards=2, num_blocks_per_shard=BLOCKS, block_size=BLOCK,
                                            dcp_interleave=BLOCK))   # tokens 0-3 on shard 0, 4-7 on shard 1, ...


def _client(coord) -> str:
    return coord.register_client()["credential"]


def _state(coord) -> tuple:
    """Everything a rejected call must leave as it was."""
    lengths = {s.seq_id: (s.owner, s.length, s.in_step) for s in coord.table.sequences.values()}
    checksums = [w._impl.kv_checksum() for w in coord.workers]
    return lengths, coord.table.blocks_used(), checksums


def _expected_checksum(cfg, seed: int, num_tokens: int) -> float:
    """Sum of |K| + |V| of every layer's synthetic tokens, each stored once (kv_replicas=1), in float64."""
    total = 0.0
    for layer in range(cfg.num_layers):
        k, v = synthetic_kv(seed, layer, 0, num_tokens, cfg.num_kv_heads, cfg.head_size)
        total += float(k.double().abs().sum() + v.double().abs().sum())
    return total


def test_sequences_belong_to_the_client_that_added_them(coord):
    a, b = _client(coord), _client(coord)
    seq = coord.add_sequence(a)
    assert coord.list_sequences(a) == {seq: 0} and coord.list_sequences(b) == {}
    assert coord.sequence_length(a, seq) == 0
    before = _state(coord)
    with pytest.raises(InvalidRequestError, match="unknown client credential"):
        coord.add_sequence("forged")
    with pytest.raises(InvalidRequestError, match=f"unknown or freed sequence '{seq}'"):
        coord.sequence_length(b, seq)                   # another client's id is as unknown as a made-up one
    with pytest.raises(InvalidRequestError, match=f"unknown or freed sequence '{seq}'"):
        coord.free(b, seq)
    with pytest.raises(InvalidRequestError, match="unknown client credential"):
        coord.free("forged", seq)
    assert _state(coord) == before and coord.list_sequences(a) == {seq: 0}
    coord.free(a, seq)
    assert coord.list_sequences(a) == {}
    with pytest.raises(InvalidRequestError, match=f"unknown or freed sequence '{seq}'"):
        coord.sequence_length(a, seq)


def test_fill_synthetic_writes_the_seeded_kv_once_and_commits_the_length(coord):
    a = _client(coord)
    seq = coord.add_sequence(a)
    assert coord.fill_synthetic(a, seq, 10, 7) == 10
    assert coord.sequence_length(a, seq) == 10 and coord.table.sequences[seq].in_step is None
    assert sum(coord.table.blocks_used()) == 3                            # ceil(10 / 4) pages
    written = sum(w._impl.kv_checksum() for w in coord.workers)
    assert written == pytest.approx(_expected_checksum(coord.config, 7, 10), rel=1e-12)
    assert coord.fill_synthetic(a, seq, 6, 7) == 16                       # appends after the committed length
    assert sum(coord.table.blocks_used()) == 4


@pytest.mark.parametrize("args, error, fragment", [
    (("seq", 4, -1), InvalidRequestError, "seed -1 must be an int in 0..2\\*\\*40"),
    (("seq", 4, True), InvalidRequestError, "seed True must be an int"),
    (("seq", 0, 1), InvalidRequestError, "num_tokens 0 must be an int >= 1"),
    (("seq", 65, 1), CapacityError, "exceed the whole KV cache \\(64 tokens over 2 shards\\)"),
    (("s-nobody", 4, 1), InvalidRequestError, "unknown or freed sequence"),
])
def test_fill_synthetic_refuses_bad_input_changing_nothing(coord, args, error, fragment):
    a = _client(coord)
    seq = coord.add_sequence(a)
    coord.fill_synthetic(a, seq, 3, 1)
    before = _state(coord)
    seq_arg, num_tokens, seed = args
    with pytest.raises(error, match=fragment):
        coord.fill_synthetic(a, seq if seq_arg == "seq" else seq_arg, num_tokens, seed)
    assert _state(coord) == before


def test_fill_synthetic_of_another_client_or_a_forged_credential_is_refused(coord):
    a, b = _client(coord), _client(coord)
    seq = coord.add_sequence(a)
    before = _state(coord)
    with pytest.raises(InvalidRequestError, match=f"unknown or freed sequence '{seq}'"):
        coord.fill_synthetic(b, seq, 4, 1)
    with pytest.raises(InvalidRequestError, match="unknown client credential"):
        coord.fill_synthetic("forged", seq, 4, 1)
    assert _state(coord) == before


def test_a_shard_failing_a_fill_gives_its_pages_back(coord):
    a = _client(coord)
    seq = coord.add_sequence(a)
    coord.fill_synthetic(a, seq, 4, 1)
    lengths, blocks, _ = _state(coord)
    healthy = coord.shard_set.handles[1]
    coord.shard_set.handles[1] = LocalActor(Failing())
    with pytest.raises(StepFencedError, match="fenced by a restarted coordinator: fill again"):
        coord.fill_synthetic(a, seq, 8, 2)
    assert _state(coord)[:2] == (lengths, blocks)          # length, step and pages as before
    coord.shard_set.handles[1] = healthy
    assert coord.fill_synthetic(a, seq, 8, 2) == 12         # the sequence is in no step: it fills again


def test_fork_share_and_fork_shared_between_two_clients(coord):
    a, b = _client(coord), _client(coord)
    seq = coord.add_sequence(a)
    coord.fill_synthetic(a, seq, 8, 3)
    blocks = coord.table.blocks_used()
    mine = coord.fork(a, seq, 4)
    assert coord.list_sequences(a) == {seq: 8, mine: 4}
    assert coord.table.blocks_used() == blocks               # a fork shares the prefix's pages
    before = _state(coord)
    with pytest.raises(InvalidRequestError, match=f"unknown or freed sequence '{seq}'"):
        coord.fork(b, seq)                                   # b cannot fork what it was not granted
    with pytest.raises(InvalidRequestError, match="num_tokens 9 must be an int in 0..8"):
        coord.fork(a, seq, 9)
    with pytest.raises(InvalidRequestError, match="ttl_s 0 must be a number of seconds"):
        coord.share(a, seq, 6, 0)
    with pytest.raises(InvalidRequestError, match=f"unknown or freed sequence '{seq}'"):
        coord.share(b, seq)
    with pytest.raises(AccessDeniedError, match="not a share token"):
        coord.fork_shared(b, "seq-" + seq)
    assert _state(coord) == before
    token = coord.share(a, seq, 6)
    with pytest.raises(AccessDeniedError, match="not issued by this service"):
        coord.fork_shared(b, token[:-1] + ("0" if token[-1] != "0" else "1"))
    theirs = coord.fork_shared(b, token)
    assert coord.list_sequences(b) == {theirs: 6} and theirs not in coord.list_sequences(a)
    with pytest.raises(InvalidRequestError, match=f"unknown or freed sequence '{theirs}'"):
        coord.sequence_length(a, theirs)                     # the fork is b's alone
    coord.free(a, seq)
    with pytest.raises(InvalidRequestError, match="was freed by its owner"):
        coord.fork_shared(b, token)
    assert coord.sequence_length(b, theirs) == 6 and coord.sequence_length(a, mine) == 4   # forks keep their KV
