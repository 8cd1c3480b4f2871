"""The coordinator's state owners alone, without Ray: ClientRegistry, SequenceTable, OpenSteps and the
authority check (issue 19). The service tests cover them wired together."""

from __future__ import annotations

import pytest

from conftest import service_config
from cpattn.cluster import authority
from cpattn.cluster.client_registry import ClientRegistry
from cpattn.cluster.open_steps import OpenStep, OpenSteps, check_local_ranks, check_step_size
from cpattn.cluster.sequence_table import SequenceTable
from cpattn.cluster.usage import tokens_on, usage_by_client
from cpattn.errors import AccessDeniedError, CapacityError, InvalidRequestError, ShardLostError


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# --- ClientRegistry ------------------------------------------------------------------------------------

def test_clients_register_check_and_lapse():
    clock = Clock()
    reg = ClientRegistry(clock)
    a, cred_a = reg.register("free")
    b, cred_b = reg.register("keep")
    assert a != b and a.startswith("c-") and reg.check(cred_a) == a and len(reg) == 2
    assert reg.client_of("forged") is None and not reg.is_connected("forged") and not reg.renew("forged")
    with pytest.raises(InvalidRequestError, match="unknown client credential .*connect again"):
        reg.check("forged")
    clock.now += 10
    assert reg.renew(cred_b)
    clock.now += 5
    assert reg.lapsed(12.0) == [a]            # b renewed 5 s ago
    with pytest.raises(InvalidRequestError, match="on_lapse 'sometimes': use 'free'"):
        reg.register("sometimes")


def test_clients_end_resume_and_forget():
    reg = ClientRegistry(Clock())
    a, cred = reg.register("keep")
    with pytest.raises(InvalidRequestError, match="still connected: close\\(\\) it first"):
        reg.resume(cred, "keep")
    assert reg.end(a).on_lapse == "keep" and reg.end(a) is None and a not in reg
    assert reg.resume(cred, "free") == a and reg.check(cred) == a     # kept sequences: the credential resumes
    reg.end(a)
    reg.forget(a)
    with pytest.raises(InvalidRequestError, match="unknown credential: its client ended"):
        reg.resume(cred, "free")


def test_clients_survive_a_restart_through_the_journal_meta():
    reg = ClientRegistry(Clock())
    a, cred = reg.register("keep")
    restored = ClientRegistry(Clock())
    restored.restore(reg.to_meta())
    assert restored.check(cred) == a and restored.to_meta() == reg.to_meta()
    old = ClientRegistry(Clock())
    old.restore({"clients": [a]})              # an old journal: ids only, no credentials
    assert a in old and old.to_meta()["clients"] == {a: "free"}


# --- SequenceTable ---------------------------------------------------------------------------------------

def _table(**overrides) -> SequenceTable:
    return SequenceTable(service_config(num_shards=2, num_blocks_per_shard=8, block_size=4, **overrides))


def test_sequences_grow_commit_and_undo():
    table = _table()
    seq = table.add("c-1", "seq-a")
    assert table.get("seq-a", "c-1") is seq and table.lengths_of("c-1") == {"seq-a": 0}
    with pytest.raises(InvalidRequestError, match="unknown or freed sequence 'seq-a'"):
        table.get("seq-a", "c-2")              # another client's id is unknown
    free_before = table.blocks_used()
    growth = table.grow([seq], [10])
    table.begin([seq], 7)
    with pytest.raises(InvalidRequestError, match="sequence seq-a is already in open step 7"):
        table.limits.check_growth(seq, 1, "num_new_tokens", "already in")
    table.undo(growth, ["seq-a"], 7)
    assert table.blocks_used() == free_before and seq.in_step is None and seq.pages_version == 1
    table.grow([seq], [10])
    table.begin([seq], 8)
    table.commit(["seq-a"], [10], 8)
    assert seq.length == 10 and seq.last_step == 8 and seq.in_step is None and seq.pages_version == 1
    assert sum(tokens_on(table, r) for r in range(2)) == 10


def test_sequence_growth_check_names_the_problem():
    table = _table(max_tokens_per_client=12)
    seq = table.add("c-1", "seq-a")
    for bad in (0, -1, True, 1.5, "3"):
        with pytest.raises(InvalidRequestError, match="num_tokens .* must be an int >= 1"):
            table.limits.check_growth(seq, bad, "num_tokens", "in")
    with pytest.raises(CapacityError, match=r"0 \+ 65 tokens exceed the whole KV cache \(64 tokens"):
        table.limits.check_growth(seq, 65, "num_tokens", "in")
    with pytest.raises(CapacityError, match="client quota: holding 0 tokens, this step adds 13"):
        table.limits.check_quota(table.owned_by("c-1"), 13)
    seqs, request = table.admit("c-1", {"seq-a": 3})
    assert seqs == [seq] and request == {"seq-a": 3}
    with pytest.raises(InvalidRequestError, match="a step needs a non-empty"):
        table.admit("c-1", {})


def test_sequences_dropped_with_a_shard_raise_for_their_owner_only():
    table = _table()
    a, b = table.add("c-1", "seq-a"), table.add("c-2", "seq-b")
    table.grow([a], [8])
    table.commit(["seq-a"], [8], 1)
    table.drop_on(0, "died")
    assert "seq-a" not in table.sequences and "seq-b" in table.sequences   # b had no tokens there
    with pytest.raises(ShardLostError, match=r"shard 0 died: sequences \['seq-a'\] lost KV"):
        table.raise_if_unavailable(["seq-a"], "c-1")
    table.raise_if_unavailable(["seq-a"], "c-2")       # not theirs: stays unknown, not lost
    table.free("seq-a", "c-1")
    table.raise_if_unavailable(["seq-a"], "c-1")
    assert table.free_idle_of("c-2") == ["seq-b"] and table.blocks_used() == [0, 0]


def test_usage_lists_only_the_caller_unless_admin():
    table = _table()
    for owner, seq_id, n in (("c-1", "s1", 4), ("c-2", "s2", 6), ("c-2", "s3", 1)):
        table.grow([table.add(owner, seq_id)], [n])
        table.commit([seq_id], [n], 1)
    assert usage_by_client(table, "c-1", admin=False) == ({"c-1": {"sequences": 1, "tokens": 4}},
                                                          {"sequences": 2, "tokens": 7})
    assert usage_by_client(table, None, admin=True)[0]["c-2"] == {"sequences": 2, "tokens": 7}


# --- OpenSteps ---------------------------------------------------------------------------------------------

def _step(step_id: int, client_id: str, refs=()) -> OpenStep:
    return OpenStep(step_id, client_id, [], [], None, 1, 0, refs=list(refs))


def test_open_steps_one_per_client_and_shard_threads_counted():
    still = {"r1"}
    steps = OpenSteps(2, pending=lambda refs: [r for r in refs if r in still])
    steps.check_can_open("c-1")
    step_id, _ = steps.new_id()
    steps.open(_step(step_id, "c-1", ["r1"]))
    with pytest.raises(CapacityError, match=r"already holds 1 open step\(s\)"):
        steps.check_can_open("c-1")
    steps.close(steps.of(step_id, "c-1"), committed=False, drain=True)     # rolled back; its shard call still runs
    steps.open(_step(steps.new_id()[0], "c-2"))
    with pytest.raises(CapacityError, match=r"2 steps are open .*max_open_steps=2"):
        steps.check_can_open("c-3")
    still.clear()                                          # the shard call returned
    steps.check_can_open("c-3")
    assert (steps.num_committed, steps.num_rolled_back) == (0, 1)
    assert steps.of(2, "c-1") is None and steps.of([2], "c-2") is None   # another's, unhashable: unknown


def test_open_steps_ids_and_argument_checks():
    steps = OpenSteps(4, pending=lambda refs: [], next_step=1000)
    assert steps.new_id() == (1000, True) and steps.new_id() == (1001, False)
    assert steps.before_restart(999) and not steps.before_restart(1000) and not steps.before_restart(True)
    assert check_local_ranks([2, 0, 2], 3) == (0, 2)
    with pytest.raises(InvalidRequestError, match=r"local_ranks \[3\] must be shard ranks in 0..2"):
        check_local_ranks([3], 3)
    with pytest.raises(InvalidRequestError, match="a step of 9 new tokens exceeds max_tokens_per_step=8"):
        check_step_size(9, 8)


# --- authority ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["begin_step", "stats", "shutdown", "register_client"])
def test_authority_rules(method):
    rule = authority.COORDINATOR_METHODS[method]
    operator = authority.new_operator_credential()
    check = lambda proof, clients=(): authority.authorize_coordinator_call(  # noqa: E731
        rule, proof, method, "coordinator 'x'", authority.digest(operator), lambda p: p in clients)
    check("anything", clients=("anything",)) if rule.who != authority.OPERATOR else check(operator)
    if rule.who == authority.OPEN:
        check(None)
        return
    with pytest.raises(AccessDeniedError, match=f"{method}"):
        check("stranger")
    if rule.who in (authority.OPERATOR, authority.CLIENT_OR_OPERATOR):
        check(operator)


@pytest.mark.parametrize("odd", ["é" * 64, "\ud800", "share|a|b|1|2|é", "\x00", ""])
def test_secrets_macs_and_credentials_of_any_text_are_refused_not_crashed_on(odd):
    """hmac.compare_digest raises TypeError for non-ASCII str and a lone surrogate cannot be encoded strictly: a
    hostile token, ticket or credential made the coordinator raise an untyped error instead of refusing it."""
    from cpattn.cluster.prefix_sharing import ShareGrant, make_share_token, read_share_token

    secret = "s" * 64
    assert not authority.matches_secret(odd, secret) and not authority.matches_digest(odd, authority.digest(secret))
    assert authority.digest(odd) != authority.digest(secret)
    assert authority.read_ticket(secret, "c-1-g", f"c-1|1.0|{odd}") is None
    genuine = make_share_token(secret, ShareGrant("seq-a", "c-1", 3, 200.0))
    for token in (odd, genuine.rsplit("|", 1)[0] + "|" + odd):
        with pytest.raises(AccessDeniedError, match="fork_shared refused"):
            read_share_token(secret, token, 100.0)
    assert read_share_token(secret, genuine, 100.0) == ShareGrant("seq-a", "c-1", 3, 200.0)
