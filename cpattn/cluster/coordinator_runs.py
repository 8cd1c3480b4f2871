"""The coordinator's extend_run: a decode run's next steps planned while its client runs the ones it has.

A run's start (its last commit read, a begin_step, the plans of S steps, the client's tables) cost 18-24 ms on an
H200 host, paid by the caller once per 128-step run: 0.14-0.19 ms of each step, the largest part of opening a
step at 1M tokens and at B=64 once later steps open from rows on the device (cluster/steady_run.py). So the
client asks, without waiting, at a run's second step, for its next steps: they are grown and planned from the
run's planned end, handed to its remote shards (which take them into the run they serve, shard_runs.py), and
added to the open step, whose commits, rollback and close treat them as the run's own. The client takes them
at the run's last planned step (cluster/run_extension.py): the run goes on, with no begin_step in between.

A mixin of cluster.coordinator.Coordinator (its lock, state owners and shard handles).
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from cpattn.cluster.client_registry import ClientRegistry
from cpattn.cluster.decode_run_plans import RunPlans, RunSteps, client_step, shard_step
from cpattn.cluster.generations import Generations
from cpattn.cluster.messages import RunExtension
from cpattn.cluster.open_steps import OpenStep, OpenSteps
from cpattn.cluster.rpc import call
from cpattn.cluster.sequence_table import SequenceTable
from cpattn.cluster.shard_set import ShardSet
from cpattn.cluster.step_ledger import StepLedger
from cpattn.config import ServiceConfig
from cpattn.errors import CpattnError

logger = logging.getLogger("cpattn.coordinator")


class RunExtensionMethods:
    config: ServiceConfig
    _lock: threading.RLock
    gen: Generations
    clients: ClientRegistry
    table: SequenceTable
    steps: OpenSteps
    ledger: StepLedger
    shard_set: ShardSet
    _publish_blocks_used: Callable[[], None]   # coordinator_sequences.SequenceMethods'

    def extend_run(self, credential: str, step_id: int, ahead: int, held: dict | None = None) -> RunExtension | None:
        """Up to ``ahead`` more steps of the client's open decode run ``step_id`` (its first step's id), numbered
        after its last planned one; None when not granted, with nothing changed: the run ended meanwhile, is
        being extended already, or has no room (ledger.extend), or a remote shard did not take the steps.
        ``held``: the pages the client holds of its in-process shards (begin_step's), for the tables' deltas."""
        with self._lock:
            step = self.steps.of(step_id, self.clients.check(credential))
            if step is None or step.extending:
                return None
            extended = self.ledger.extend(step, ahead, self.gen, len(self.clients))
            if extended is None:
                return None
            growths, plans = extended
            step.extending = True
            shards = list(self.shard_set.handles)
        taken = True
        try:
            refs = [h.extend_run.remote(step.group_name, step.step_id, RunSteps(shard_step, [plans.ranks[rank]], 0))
                    for rank, h in enumerate(shards) if rank not in step.local_ranks]
            taken = all(call(refs, self.config.rpc_timeout_s, "extend_run")) if refs else True
        except CpattnError as exc:   # a shard gone or slow: the run ends at its planned end, as without asking
            logger.warning("decode run %d not extended: %s", step.step_id, exc)
            taken = False
        with self._lock:
            step.extending = False
            if not self.steps.is_open(step):
                return None   # closed meanwhile (its client ended it or lapsed): its close undid these pages too
            if taken and (self.gen.epoch != step.epoch or any(s not in self.table.sequences for s in step.seq_ids)):
                taken = False   # a shard replaced meanwhile, a sequence dropped with it: the run is failing anyway
            if not taken:
                # Shards that took the steps keep them queued, unserved (the client ends the run at its planned
                # end): the run is never extended again, so no later extension reuses their step ids.
                self.ledger.withdraw(step, growths)
                step.id_span = step.num_substeps
                self._publish_blocks_used()
                return None
            self._publish_blocks_used()
            return extension_reply(self.table, step, plans, held)


def extension_reply(table: SequenceTable, step: OpenStep, plans: RunPlans, held) -> RunExtension:
    """What the client gets of an extension: the steps as it reads them (its in-process shards' plans, the rows the
    others return) and its in-process shards' block tables as deltas against ``held``."""
    local = sorted(step.local_ranks)
    seqs = [table.sequences[s] for s in step.seq_ids]
    pages = {r: table.page_deltas(r, seqs, plans.ranks[r].table, held) for r in local}
    return RunExtension(RunSteps(client_step, [r.for_client() for r in plans.ranks], 0, tuple(local)), pages)
