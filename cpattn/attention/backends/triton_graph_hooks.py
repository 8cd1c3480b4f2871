"""TRITON's builder hooks for CUDA graphs (cluster/decode_graphs.py): a decode step's bucket, buffers at fixed
addresses for it (invariant 8), and each way of filling them: from a built plan (refill), from the step's host
values without building one (refill_from_host), from a decode run's rows already on the device (the buffers
step_row_buffers names, which cluster/row_arena.py lays out in one, so a steady step refills them with one copy).

Legend: T tokens (= requests: a decode-only step), S KV splits, W block-table width.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from cpattn.attention.backends.triton_attn import TritonAttentionMetadata
    from cpattn.attention.metadata import CommonAttentionMetadata


class TritonGraphHooks:
    """Mixed into TritonMetadataBuilder (its ``spec``)."""

    def graph_key(self, md: TritonAttentionMetadata) -> tuple | None:
        """(T, S (with each window's S), block-table width bucket) of a decode-only step, whose launches depend on
        nothing else; for a pass of query groups only (a cascade's prefix pass over forks' shared pages) S is
        ("groups", writes, (n, requests, S) of each group). None when the step cannot replay a captured graph
        (prefill tiles are planned per step)."""
        if md.num_tokens == 0:
            return None
        width = max(64, 1 << (md.block_table.shape[1] - 1).bit_length())
        if not md.decode_only:
            if not md.query_groups or md.dec_tok.numel() or md.tiles[0].numel() or md.window_starts:
                return None
            groups = tuple((g.n, g.req.numel(), g.splits, g.all_rows, g.out_rows is not None, g.q_step_rows)
                           for g in md.query_groups)
            return md.num_tokens, ("groups", md.has_writes, *groups), width
        splits = md.num_splits
        if md.window_starts:     # each window's S too (decode_graphs appends to this 3-tuple: keep its length)
            splits = (splits,) + tuple((w, ws[2]) for w, ws in sorted(md.window_starts.items()))
        return md.num_tokens, splits, width

    def host_graph_key(self, common: CommonAttentionMetadata) -> tuple | None:
        """graph_key of build(common) for a plain decode-only step (one query per request), from host values alone;
        None for any other step (it is built, then keyed). A decode run's later steps replay graphs already
        captured: refill_from_host then fills their buffers with two copies (two more per window) instead of
        build()'s ~15 device copies and fills per step (DecodeGraphs.prepare_from_host)."""
        t = common.num_actual_tokens
        if common.max_query_len != 1 or common.num_reqs != t or t == 0:
            return None
        kv = common.seq_lens_cpu
        in_window = {w: int((kv - starts).clamp(min=0).max()) for w, starts in self._window_starts(common).items()}
        return self.decode_graph_key(t, int(kv.max()), common.block_table_tensor.shape[1], in_window)

    def _window_starts(self, common: CommonAttentionMetadata) -> dict[int, torch.Tensor]:
        """Each sliding window's first visible local key per token, (T,) int64 on the CPU (build's window_starts)."""
        return {w: common.window_key_start(w) for w in sorted({w for w in self.spec.sliding_windows if w is not None})}

    def decode_graph_key(self, num_tokens: int, max_kv_len: int, width: int,
                         in_window: dict[int, int] | None = None) -> tuple | None:
        """graph_key of a plain decode-only step of ``num_tokens`` requests whose longest sees ``max_kv_len`` keys,
        over a block table ``width`` pages wide; ``in_window``: per sliding window, the most keys a request sees
        inside it (every window of the spec; None without one). None for a step without tokens. Each part of the
        key is a monotone function of one input (the splits of ``max_kv_len``, each window's of its
        ``in_window``: decode_num_splits only grows with keys): cluster/steady_run.keys_of_steps relies on that."""
        from cpattn.attention.backends.triton_decode import decode_num_splits

        windows = sorted({w for w in self.spec.sliding_windows if w is not None})
        in_window = in_window or {}
        if num_tokens == 0 or any(w not in in_window for w in windows):
            return None
        dev, hk = torch.device(self.spec.device), self.spec.num_kv_heads
        splits = decode_num_splits(num_tokens, hk, max_kv_len, dev) if max_kv_len else 1
        if windows:   # graph_key's shape: (S, (W, its S), ...) by window
            splits = (splits,) + tuple((w, decode_num_splits(num_tokens, hk, in_window[w], dev) if in_window[w] else 1)
                                       for w in windows)
        return num_tokens, splits, max(64, 1 << (width - 1).bit_length())

    @staticmethod
    def step_row_buffers(static: TritonAttentionMetadata) -> list[torch.Tensor]:
        """The buffers a steady decode step refills (cluster/steady_run.py; its block table is the one they hold):
        slots (int64), key counts, then each window's (ascending) token and decode first visible keys (int32)."""
        out = [static.slot_mapping, static.dec_kv_len]
        for w in sorted(static.window_starts):
            out += list(static.window_starts[w][:2])
        return out

    @staticmethod
    def with_step_row_buffers(static: TritonAttentionMetadata, views: list[torch.Tensor]) -> TritonAttentionMetadata:
        """``static`` reading step_row_buffers' buffers from ``views`` (same order, shapes and values)."""
        windows, i = dict(static.window_starts), 2
        for w in sorted(windows):
            windows[w] = (views[i], views[i + 1], windows[w][2])
            i += 2
        return dataclasses.replace(static, slot_mapping=views[0], dec_kv_len=views[1], window_starts=windows)

    @staticmethod
    def step_rows(slots: torch.Tensor, kv_lens: torch.Tensor, window_starts: dict[int, torch.Tensor]) -> list:
        """step_row_buffers' values of decode steps ([S, T] each: slots, int32 key counts, each window's int32 first
        keys): a decode-only step's token row is its decode index, so both of a window's buffers get its starts."""
        out = [slots, kv_lens]
        for w in sorted(window_starts):
            out += [window_starts[w], window_starts[w]]
        return out

    def refill_from_host(self, static: TritonAttentionMetadata, common: CommonAttentionMetadata,
                         table: torch.Tensor | None) -> None:
        """refill(static, build(common)) for a step host_graph_key keyed, from the host values: its slots, key counts
        and window starts copied in, and ``table`` (the block table on the device) unless None (the buffers hold it
        already)."""
        static.slot_mapping.copy_(common.slots_on_host(), non_blocking=True)
        static.dec_kv_len.copy_(common.seq_lens_cpu.to(torch.int32), non_blocking=True)
        for w, starts in self._window_starts(common).items():
            starts = starts.to(torch.int32)
            static.window_starts[w][0].copy_(starts, non_blocking=True)
            static.window_starts[w][1].copy_(starts, non_blocking=True)
        if table is not None:
            static.block_table[:, :table.shape[1]].copy_(table)

    def make_static(self, md: TritonAttentionMetadata, key: tuple) -> TritonAttentionMetadata:
        """Metadata at fixed addresses for graphs of ``key``'s bucket (invariant 8); no writes until refilled."""
        t, _, width = key
        dev = md.block_table.device
        return dataclasses.replace(
            md, has_writes=md.decode_only or md.has_writes,
            slot_mapping=torch.full((t,), -1, dtype=torch.int64, device=dev),
            block_table=torch.zeros(md.block_table.shape[0], width, dtype=torch.int64, device=dev),
            dec_tok=md.dec_tok.clone(), dec_req=md.dec_req.clone(), dec_kv_len=md.dec_kv_len.clone(),
            window_starts={w: (a.clone(), b.clone(), n) for w, (a, b, n) in md.window_starts.items()},
            query_groups=[dataclasses.replace(g, first_tok=g.first_tok.clone(), req=g.req.clone(),
                                              kv_len=g.kv_len.clone(),
                                              out_rows=None if g.out_rows is None else g.out_rows.clone())
                          for g in md.query_groups])

    def refill(self, static: TritonAttentionMetadata, md: TritonAttentionMetadata) -> None:
        """This step's values into the graph's buffers. Columns past the step's width keep stale page ids:
        the kernel reads only the pages below each token's key count."""
        static.slot_mapping.copy_(md.slot_mapping)
        static.block_table[:, :md.block_table.shape[1]].copy_(md.block_table)
        static.dec_kv_len.copy_(md.dec_kv_len)
        for w, (tok_starts, dec_starts, _) in md.window_starts.items():
            static.window_starts[w][0].copy_(tok_starts)
            static.window_starts[w][1].copy_(dec_starts)
        for kept, grp in zip(static.query_groups, md.query_groups):
            kept.first_tok.copy_(grp.first_tok)
            kept.req.copy_(grp.req)
            kept.kv_len.copy_(grp.kv_len)
            if kept.out_rows is not None:
                kept.out_rows.copy_(grp.out_rows)
