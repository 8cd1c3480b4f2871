"""StepLedger (a step's life on the coordinator's state owners, end_step's answers) and Generations (epoch,
incarnation, the journal's meta record, a restart) alone, without Ray (issue 19). The service tests cover
them wired into the coordinator."""

from __future__ import annotations

import pytest

from conftest import service_config
from cpattn.cluster import decode_run, generations, step_outcome
from cpattn.cluster.client_registry import ClientRegistry
from cpattn.cluster.generations import Generations
from cpattn.cluster.journal import CoordinatorJournal, SequenceRecord
from cpattn.cluster.messages import BeginStepReply
from cpattn.cluster.open_steps import STEP_ID_RESERVE, OpenSteps
from cpattn.cluster.sequence_table import SequenceTable
from cpattn.cluster.step_ledger import StepLedger
from cpattn.errors import CapacityError, InvalidRequestError, ServiceError, ShardLostError, StepFencedError


class Metrics:
    """Records what the ledger reports (ServiceMetrics' interface)."""

    def __init__(self):
        self.calls = []

    def record_step(self, latency_s, num_tokens):
        self.calls.append(("step", num_tokens))

    def record_rollback(self):
        self.calls.append(("rollback",))

    def record_error(self, name):
        self.calls.append(("error", name))


class Journal:
    """What SequenceTable writes to a CoordinatorJournal, kept in a dict (the real one needs Ray's GCS)."""

    pages_value = staticmethod(CoordinatorJournal.pages_value)

    def __init__(self):
        self.pages, self.lengths = {}, {}

    def commit(self, updates):
        for u in updates:
            if u.pages is not None:
                self.pages[u.seq_id] = u.pages
            self.lengths[u.seq_id] = (u.length, u.step_id)

    def delete_sequence(self, seq_id):
        self.pages.pop(seq_id, None)
        self.lengths.pop(seq_id, None)

    def records(self) -> dict[str, SequenceRecord]:
        return {s: SequenceRecord(owner, *self.lengths[s][:1], primary, replica, pages, self.lengths[s][1])
                for s, (owner, primary, replica, pages) in self.pages.items()}


def _ledger(journal=None, **overrides):
    cfg = service_config(num_shards=2, num_blocks_per_shard=8, block_size=4, max_open_steps=4, **overrides)
    table = SequenceTable(cfg, journal)
    steps = OpenSteps(cfg.max_open_steps, pending=lambda refs: [])
    return StepLedger(cfg, table, steps, Metrics(), lambda count=1: steps.new_id(count)[0]), Generations()


def test_a_step_is_admitted_opened_and_committed():
    ledger, gen = _ledger(pcp_wire_flops_per_byte=0.0)   # equal causal shares: the remote rank computes rows too
    ledger.table.add("c-1", "a")
    admitted = ledger.admit("c-1", {"a": 6}, 1, num_clients=1)
    assert admitted.num_steps == 1 and ledger.table.blocks_used() == [1, 1]
    step, runs = ledger.open(admitted, (0,), gen)
    assert ledger.steps.of(step.step_id, "c-1") is step and ledger.table.get("a").in_step == step.step_id
    reply = ledger.reply(step, admitted.seqs, admitted.request, runs, None, gen.epoch)
    assert isinstance(reply, BeginStepReply) and reply.later == [] and reply.seq_ids == ["a"]
    assert (reply.step_id, reply.num_tokens, reply.query_lens, reply.epoch) == (step.step_id, 6, [6], 0)
    assert set(reply.local_plans) == {0} and set(reply.remote_rows) == {1} and set(reply.local_pages) == {0}
    assert reply.local_plans[0].auth is None                      # the client never calls that shard
    step.done = ledger.num_kept(step, True, None)
    ledger.close(step, committed=True)
    assert ledger.table.get("a").length == 6 and ledger.table.get("a").in_step is None and len(ledger.steps) == 0
    assert ledger.metrics.calls == [("step", 6)] and ledger.steps.num_committed == 1


def test_a_refused_step_changes_nothing():
    ledger, gen = _ledger(max_tokens_per_client=8)
    ledger.table.add("c-1", "a")
    with pytest.raises(CapacityError, match="client quota: holding 0 tokens, this step adds 9"):
        ledger.admit("c-1", {"a": 9}, 1, 1)
    with pytest.raises(InvalidRequestError, match=rf"ahead 0 must be an int in 1..{decode_run.MAX_RUN_STEPS}"):
        ledger.admit("c-1", {"a": 1}, 0, 1)
    assert ledger.table.blocks_used() == [0, 0] and len(ledger.steps) == 0


def test_a_step_whose_planning_fails_gives_its_pages_back(monkeypatch):
    ledger, gen = _ledger()
    ledger.table.add("c-1", "a")
    admitted = ledger.admit("c-1", {"a": 1}, 4, 1)

    def broken(*args, **kwargs):
        raise RuntimeError("planner broke")
    monkeypatch.setattr(decode_run, "plan_steps", broken)
    with pytest.raises(RuntimeError, match="planner broke"):
        ledger.open(admitted, (), gen)
    assert ledger.table.blocks_used() == [0, 0] and ledger.table.get("a").in_step is None and len(ledger.steps) == 0


def test_a_decode_run_advances_then_gives_back_the_steps_not_run():
    ledger, gen = _ledger()
    seq = ledger.table.add("c-1", "a")
    admitted = ledger.admit("c-1", {"a": 1}, 4, 1)
    assert admitted.num_steps == 4
    step, runs = ledger.open(admitted, (), gen)
    reply = ledger.reply(step, admitted.seqs, admitted.request, runs, None, gen.epoch)
    assert [p.step_id for p in reply.later] == [step.step_id + 1, step.step_id + 2, step.step_id + 3]
    assert step.num_substeps == 4 and len(runs) == 4 and ledger.table.blocks_used() == [1, 1]   # interleave 1
    ledger.advance(step, ledger.num_kept(step, True, 2))
    assert seq.length == 2 and seq.in_step == step.step_id and seq.last_step == step.step_id + 1
    with pytest.raises(InvalidRequestError, match=r"done 5 must be an int in 0..4"):
        ledger.num_kept(step, True, 5)
    ledger.close(step, committed=False, drain=True)    # the client left the run after 2 of its 4 steps
    assert seq.length == 2 and seq.in_step is None and ledger.metrics.calls == [("rollback",)]
    assert ledger.steps.num_committed == 2 and ledger.steps.num_rolled_back == 1


def test_a_client_that_ends_has_its_steps_rolled_back():
    ledger, gen = _ledger()
    ledger.table.add("c-1", "a")
    step, _ = ledger.open(ledger.admit("c-1", {"a": 5}, 1, 1), (), gen)
    assert ledger.roll_back("c-2") == [] and ledger.roll_back("c-1") == [step]
    assert ledger.table.get("a").length == 0 and ledger.table.blocks_used() == [0, 0]
    with pytest.raises(InvalidRequestError, match=f"step {step.step_id} was rolled back: its client ended"):
        ledger.check_still_open(step)


def test_end_step_answers_for_steps_it_does_not_hold():
    ledger, gen = _ledger()
    ledger.steps.restart_at(100)                 # steps 1..99 were an earlier incarnation's
    seq = ledger.table.add("c-1", "a")
    seq.last_step = 42
    assert ledger.unknown(42) == step_outcome.COMMITTED_BEFORE_RESTART
    with pytest.raises(StepFencedError, match="step 43 was open when the coordinator restarted"):
        ledger.unknown(43)
    with pytest.raises(InvalidRequestError, match="step 100 is not open"):
        ledger.unknown(100)
    assert ledger.metrics.calls == [("error", "StepFencedError")]


def test_a_failed_step_is_run_again_unless_its_kv_was_lost():
    ledger, gen = _ledger()
    ledger.table.add("c-1", "a")
    step, _ = ledger.open(ledger.admit("c-1", {"a": 4}, 1, 1), (), gen)
    ledger.close(step, committed=False, drain=True)
    with pytest.raises(ServiceError, match="no shard was lost: run the step again"):
        ledger.raise_unless_replaced(step, "wire broke", {}, {}, epoch=gen.epoch)
    with pytest.raises(ServiceError, match=r"shard\(s\) \[1\] were lost \(died\)"):
        ledger.raise_unless_replaced(step, "wire broke", {1: "died"}, {}, epoch=gen.epoch + 1)
    ledger.raise_unless_replaced(step, "wire broke", {}, {}, epoch=gen.epoch + 1)   # replaced meanwhile
    ledger.check_survived(step)                                   # "a" had no KV on the lost shard yet
    ledger.table.grow([ledger.table.get("a")], [4])
    ledger.table.commit(["a"], [4], 1)
    ledger.table.drop_on(0, "died")
    with pytest.raises(ShardLostError, match=r"shard 0 died: sequences \['a'\] lost KV"):
        ledger.check_survived(step)
    assert ledger.metrics.calls[-1] == ("error", "ShardLostError")


def test_a_synthetic_fill_commits_or_gives_its_pages_back():
    ledger, gen = _ledger()
    ledger.table.add("c-1", "a")
    with pytest.raises(InvalidRequestError, match=r"seed -1 must be an int in 0..2\*\*40"):
        ledger.plan_fill("c-1", "a", 4, -1, gen)
    seq, growth, plans = ledger.plan_fill("c-1", "a", 6, 7, gen)
    assert len(plans) == 2 and seq.in_step == -1
    ledger.undo_fill(seq, growth)
    assert seq.in_step is None and ledger.table.blocks_used() == [0, 0]
    seq, growth, _ = ledger.plan_fill("c-1", "a", 6, 7, gen)
    assert ledger.commit_fill(seq, 6, growth) == 6 and seq.in_step is None


def test_generations_survive_a_restart_through_the_journal():
    journal = Journal()
    ledger, gen = _ledger(journal)
    clients = ClientRegistry()
    client_id, credential = clients.register("keep")
    ledger.table.add(client_id, "a")
    step, _ = ledger.open(ledger.admit(client_id, {"a": 5}, 1, 1), (), gen)
    step.done = 1
    ledger.close(step, committed=True)
    ledger.table.add(client_id, "b")
    ledger.table.dropped["gone"] = (1, "died", client_id)
    gen.shard_replaced()
    ledger.steps.new_id()
    meta = generations.meta_record(gen, ledger.table, clients, ledger.steps, ["bundle-0", "bundle-1"])
    assert meta["next_step"] == ledger.steps.next_step + STEP_ID_RESERVE and meta["bundles"] == ["bundle-0", "bundle-1"]

    again, _ = _ledger()
    gen2, clients2 = Generations(), ClientRegistry()
    generations.restore(meta, journal.records(), gen2, again.table, clients2, again.steps)
    assert (gen2.epoch, gen2.incarnation, gen2.shard_secret) == (2, 2, gen.shard_secret)
    assert again.table.lengths_of(client_id) == {"a": 5, "b": 0} and again.table.blocks_used() == [1, 1]
    assert again.table.dropped == {"gone": (1, "died", client_id)} and clients2.check(credential) == client_id
    assert again.steps.before_restart(meta["next_step"] - 1) and again.steps.new_id()[0] == meta["next_step"]
