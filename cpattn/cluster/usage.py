"""What ``stats()`` reports: per shard its pages, tokens and bytes, per client its sequences and tokens.

Pages are physical: a page forked sequences share counts once in ``blocks_used`` and ``bytes`` (and
``blocks_shared`` says how many are shared); ``tokens`` are logical, each sequence's own count.

A pure function of the coordinator's state owners (called under the coordinator's lock).
"""

from __future__ import annotations

from cpattn.cluster.client_registry import ClientRegistry
from cpattn.cluster.open_steps import OpenSteps
from cpattn.cluster.sequence_table import SequenceTable
from cpattn.cluster.shard_set import ShardSet
from cpattn.config import ServiceConfig


def usage_report(cfg: ServiceConfig, table: SequenceTable, shard_set: ShardSet, me: str | None, admin: bool,
                 clients: ClientRegistry, steps: OpenSteps, extra: dict) -> dict:
    """``clients`` lists only ``me`` (every client when ``admin``); the others are counted in ``other_clients``."""
    num_other_clients = len([c for c in clients.ids() if c != me])
    infos, bytes_per_block = shard_set.infos, cfg.bytes_per_block()
    shards = []
    for rank in range(cfg.num_shards):
        pool = table.allocator.pools[rank]
        info = infos[rank].as_dict() if rank < len(infos) else {}
        shards.append({"rank": rank, "blocks_used": pool.num_used_blocks, "blocks_free": pool.num_free_blocks,
                       "blocks_shared": pool.num_shared_blocks,
                       "blocks_total": pool.num_blocks, "token_capacity": pool.num_blocks * cfg.block_size,
                       "tokens": tokens_on(table, rank), "bytes": pool.num_used_blocks * bytes_per_block,
                       **{k: info.get(k) for k in ("node_ip", "node_id", "device", "backend", "prefill_backend")},
                       "alive": rank not in shard_set.lost})
    per_client, others = usage_by_client(table, me, admin)
    return {"shards": shards, "num_sequences": len(table.sequences), "clients": per_client,
            "other_clients": {"clients": num_other_clients, **others},
            "kv_replicas": cfg.kv_replicas, "kv_cache_dtype": cfg.kv_cache_format, "kv_bytes_per_block": bytes_per_block,
            "backend": infos[0].backend if infos else None,
            "kernel_version": infos[0].kernel_version if infos else None,
            "prefill_backend": infos[0].prefill_backend if infos else None,
            "steps_committed": steps.num_committed, "steps_rolled_back": steps.num_rolled_back,
            "shards_replaced": extra["shards_replaced"], "epoch": extra["epoch"], "open_steps": len(steps),
            "num_clients": len(clients)}


def tokens_on(table: SequenceTable, rank: int) -> int:
    """The tokens shard ``rank`` holds (logical: every sequence its own, shared pages or not)."""
    return sum(table.allocator.local_tokens(s.length, rank) for s in table.sequences.values())


def usage_by_client(table: SequenceTable, me: str | None, admin: bool) -> tuple[dict[str, dict], dict]:
    """(per listed client {sequences, tokens}, the others' aggregate): only ``me`` is listed unless admin."""
    per_client: dict[str, dict] = {}
    others = {"sequences": 0, "tokens": 0}
    for s in table.sequences.values():
        if admin or s.owner == me:
            c = per_client.setdefault(s.owner, {"sequences": 0, "tokens": 0})
        else:
            c = others
        c["sequences"] += 1
        c["tokens"] += s.length
    return per_client, others
