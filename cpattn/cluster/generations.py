"""The coordinator's service-wide generations and shard secret, and the journal's ``meta`` record of the
coordinator's state: what a detached coordinator restarted by Ray takes back (cluster/journal.py holds the
sequences themselves).

Pure state: no Ray and no lock (the coordinator holds its lock around every call).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

from cpattn.cluster.client_registry import ClientRegistry
from cpattn.cluster.journal import SequenceRecord
from cpattn.cluster.open_steps import STEP_ID_RESERVE, OpenSteps
from cpattn.cluster.sequence_table import SequenceTable


@dataclass
class Generations:
    shard_secret: str = field(default_factory=lambda: secrets.token_hex(32))
    """Proves to shards that a call (KV reads/writes, plans, fencing) or a group join comes from this service."""
    epoch: int = 0
    """Bumped by every shard replacement; clients rejoin on a new one."""
    incarnation: int = 1
    """Bumped by every coordinator restart; every plan carries it and shards refuse older ones once fenced."""
    num_shards_replaced: int = 0

    def shard_replaced(self) -> None:
        self.epoch += 1
        self.num_shards_replaced += 1


def meta_record(gen: Generations, table: SequenceTable, clients: ClientRegistry, steps: OpenSteps,
                bundles: list) -> dict:
    """What the journal keeps besides the sequences; written whenever any of it changes."""
    return {"epoch": gen.epoch, "dropped": dict(table.dropped), **clients.to_meta(),
            "incarnation": gen.incarnation, "shard_secret": gen.shard_secret,
            "next_step": steps.next_step + STEP_ID_RESERVE,   # never reused after a restart
            "bundles": bundles}


def restore(meta: dict, records: dict[str, SequenceRecord], gen: Generations, table: SequenceTable,
            clients: ClientRegistry, steps: OpenSteps) -> None:
    """A restarted coordinator's state owners from the journal (``meta``: meta_record's, ``records``: its
    sequences). A new incarnation, and a new epoch: every client rebuilds its data-plane group (old groups
    may hold steps the restart fenced)."""
    gen.shard_secret = meta.get("shard_secret", gen.shard_secret)
    table.restore(records)
    clients.restore(meta)
    table.dropped = dict(meta["dropped"])
    steps.restart_at(meta["next_step"])
    gen.incarnation = meta.get("incarnation", 1) + 1
    gen.epoch = meta["epoch"] + 1
