"""A decode run's steady steps on the client: opened from rows on the device, without planning (issue 18).

A decode run's steps differ only by one token per sequence. Its first step copies pages on write and may capture
graphs, its second is planned as any later step; when every in-process shard replays its captured graphs in that
second step, the run's rows of every step (each shard's slots, key counts, replica slots, and the pages dynamic fp8
scales grow) go to the device at once, laid out as the graphs' step buffers are in their arena (row_arena.py),
and each later step opens with one device-to-device copy into them and the second step's wire under the step's id.
Planning a later step (its plans built from the run's arrays, the builder's ~15 small device copies and fills, the
wire) cost 0.36-0.5 ms of the caller's time per step on an H200 host, most of it small torch operations.
An extension's steps (cluster/run_extension.py) open from the previous segment's template once their first step was
planned (that step brings the graphs the extension's table): a segment boundary plans one step, not two.
A step whose bucket is not the captured one (more KV splits as sequences grow) or whose rows differ (a shard
without keys of some sequence, a replica set that changed) opens as any later step; so does every step after the
group or its graphs changed (a rejoin, a recapture).
Legend: S steps of the run, T tokens of a step (one per sequence), R slot rows (T, or 2T with replica writes).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import numpy as np
import torch

from cpattn.attention.cascade_plan import PrefixPass
from cpattn.cluster.decode_graphs import DecodeGraphs
from cpattn.cluster.decode_run_plans import RankRun, RunSteps
from cpattn.kvstore.fp8_graphed import written_pages_of_steps_host
from cpattn.kvstore.sharding import dcp_local_seq_lens_host

logger = logging.getLogger("cpattn")


@dataclass
class LocalRunRows:
    """One in-process shard's rows of every step of a run, on the device, and the graphs they refill."""

    graphs: DecodeGraphs
    keys: list[tuple | None]
    """Each step's bucket: a step refills the buffers only while the graphs hold its bucket (a step of another
    bucket is planned, and captures it: the run's later steps of that bucket are served again)."""
    packed: torch.Tensor
    """[S, N] uint8 on the device: each step's values of the graphs' step buffers in their arena's layout
    (DecodeGraphs.step_rows: slots, the keys each token sees on this shard, windows' first keys, replica slots,
    the pages dynamic fp8 scales grow)."""
    prefix_source: PrefixPass | None = None
    """Forks' shared prefix (a cascade step): the pass whose plan and rows the graphs' buffers must hold; the rows'
    key counts are the suffix pass's (the run's less each request's prefix keys)."""

    def fits(self) -> bool:
        """The graphs' arena is laid out as ``packed`` (a recapture of the same bucket makes the same layout)."""
        arena = self.graphs.arena
        return arena is not None and arena.bytes.numel() == self.packed.shape[1]

    def refill(self, j: int) -> None:
        self.graphs.arena.fill(self.packed[j])   # a row view (~3 us) and one copy


def local_run_rows(run: RankRun, graphs: DecodeGraphs, template=None) -> tuple[LocalRunRows, list[bool]] | None:
    """The rows of ``run`` (one in-process shard's, the client's copy) for ``graphs``, and which steps they can
    serve (this shard computes every row); None when the shard's graphs cannot take rows (no bucket captured, a
    backend without decode_graph_key / the arena's hooks, replica writes that differ from the bucket's, a prefix pass
    other than ``template``'s: the PlannedStep of the run's second step on this shard).
    Forks' steps (a prefix pass): the run's table holds the same shared pages in every step (a run copies on write
    only in its first), so the template's split serves every later step: each row's suffix keys are its keys less
    the template's prefix keys (the splitter could pick more prefix pages once every fork sees them; reading those
    in the suffix pass instead is the same attention)."""
    builder, key = graphs.runner.builder, graphs.key
    if (graphs.disabled or key is None or graphs.arena is None or (run.replica_slots is not None) != key[3]
            or run.pieces.numel() or not hasattr(builder, "decode_graph_key")):
        return None
    t = run.positions.shape[1]
    if t == 0:
        return None
    # The run's [S, B] arrays are read by numpy (views of the tensors): a torch op on a run's arrays (over its
    # 32K-element grain at 64 sequences x 128 steps) waits for torch's intra-op threads on a loaded client host
    run_lens = seq_lens = run.seq_lens.numpy()
    prefix = None
    if key[4] is not None:   # the captured bucket reads a prefix pass: only the template's, from its own split
        prefix = None if template is None else template.prefix_pass
        if prefix is None or graphs.prefix_source is not prefix or template.prefix_shift.shape[0] != t:
            return None
        seq_lens = run_lens - template.prefix_shift.numpy()
        if (seq_lens < 0).any():
            return None
    max_kv = seq_lens.max(axis=1).tolist()
    serves = run.computes.numpy().all(axis=1).tolist()
    positions = run.positions.numpy()
    starts = {w: dcp_local_seq_lens_host(np.maximum(positions - w + 1, 0), run.world_size, run.rank, run.interleave)
              for w in sorted({w for w in builder.spec.sliding_windows if w is not None})}
    in_window = {w: np.maximum(run_lens - s, 0).max(axis=1).tolist() for w, s in starts.items()}
    # key[2] is the table's width bucket: one table for the whole run, so only the split counts can change
    def key_of(j: int) -> tuple | None:
        k = builder.decode_graph_key(t, max_kv[j], key[2], {w: most[j] for w, most in in_window.items()})
        return None if k is None else k + key[3:]
    # Each part of a key is a monotone function of one of these (decode_graph_key): a window's keys inside it can
    # shrink as the window slides past this shard's keys, so its stretches are asked apart
    keys = keys_of_steps(key_of, len(max_kv), [max_kv, *in_window.values()])
    # Laid out on the host and moved once (one copy, not one per buffer)
    replica, written = run.replica_slots, None
    if graphs.written is not None:
        rows = run.slots.numpy() if replica is None else np.concatenate([run.slots.numpy(), replica.numpy()], axis=1)
        written = written_pages_of_steps_host(rows, graphs.runner.config.block_size)
    try:
        step_rows = graphs.step_rows(run.slots, torch.from_numpy(seq_lens.astype(np.int32)),
                                     {w: torch.from_numpy(s.astype(np.int32)) for w, s in starts.items()}, replica,
                                     written)
        packed = graphs.arena.pack(step_rows)
    except ValueError as exc:   # rows unlike the buffers (a builder's other dtypes): planned steps serve the run
        logger.warning("decode run rows do not fit the graphs' step buffers (%s): its steps are planned", exc)
        return None
    return LocalRunRows(graphs, keys, packed.to(graphs.runner.device, non_blocking=True), prefix), serves


def keys_of_steps(key_of, n: int, inputs: list[list[int]] = ()) -> list:
    """[key_of(j) for j < n] for keys each part of which is a monotone function of one of ``inputs`` (each step's
    values, n apiece), asked about 2 log2(n) times per change of key in each stretch of steps where every input
    is monotone (no input given: every key's inputs only grow), not n times (128 steps' keys cost ~0.7 ms asked
    one by one on an H200 host, ~4-5 ms with a window on a CPU one). Inside such a stretch each part lies between
    its values at the stretch's ends, so a key equal at both ends is the key of every step between. A decode run's
    keys are such (decode_graph_key): its splits grow with the longest row's key count, each window's with the
    most keys a row sees inside it (which can grow, stay, or shrink as the window slides)."""
    if n == 0:
        return []
    keys, asked = [None] * n, {}

    def ask(j: int):
        if j not in asked:
            asked[j] = key_of(j)
        return asked[j]

    def fill(lo: int, hi: int, k_lo, k_hi) -> None:
        if k_lo == k_hi:
            keys[lo:hi + 1] = [k_lo] * (hi - lo + 1)
        elif hi - lo <= 1:
            keys[lo], keys[hi] = k_lo, k_hi
        else:
            mid = (lo + hi) // 2
            k_mid = ask(mid)
            fill(lo, mid, k_lo, k_mid)
            fill(mid, hi, k_mid, k_hi)
    ends = _monotone_stretches(inputs, n)
    for lo, hi in zip(ends, ends[1:]):
        fill(lo, hi, ask(lo), ask(hi))
    if n == 1:
        keys[0] = ask(0)
    return keys


def _monotone_stretches(inputs: list[list[int]], n: int) -> list[int]:
    """The steps 0 = e_0 < e_1 < ... = n - 1 such that every input is monotone (non-decreasing or non-increasing)
    over each [e_k, e_k+1]: an input turns at step i when its step i -> i + 1 change has the other sign than its
    last nonzero change before."""
    ends = {0, n - 1}
    for values in inputs:
        sign = np.sign(np.diff(np.asarray(values, dtype=np.int64)))
        moves = np.flatnonzero(sign)
        ends.update(moves[1:][sign[moves[1:]] != sign[moves[:-1]]].tolist())
    return sorted(ends)


class SteadyRun:
    """The steps of one decode run that open from its rows on the device (``open``); the others return None."""

    def __init__(self, template, rows: dict[int, LocalRunRows], serves: list[bool], step_ids: list[int]):
        self.template = template
        """The StepWire of the run's second step: its local PlannedSteps replay the graphs (every later step's)."""
        self.rows = rows
        self.serves = serves
        self.step_ids = step_ids
        self.norms = None if template.norms is None else torch.zeros_like(template.norms)

    @classmethod
    def of(cls, steps, template, graphs: dict[int, DecodeGraphs | None]) -> SteadyRun | None:
        """From a run's later steps (``steps``, as begin_step's reply holds them) and its second step's StepWire
        (``template``); None when no step could open this way."""
        if (not isinstance(steps, RunSteps) or not template.local or template.selection is not None
                or template.disjoint or any(rows is not None for rows in template.remote_rows.values())):
            return None
        remote = [r for r in range(len(steps.ranks)) if r not in steps.local]
        if sorted(template.remote_rows) != remote:   # a remote shard that sends no row in this step
            return None
        serves = [True] * len(steps.ranks[0].step_ids)
        for r in remote:   # each remote shard sends every row (the template's remote rows, every step)
            serves = [s and every for s, every in zip(serves, steps.ranks[r].computes.numpy().all(axis=1).tolist())]
        rows = {}
        for r, planned in template.local.items():
            g = graphs.get(r)
            if g is None or planned.graphs is not g or planned.copies is not None:
                return None
            made = local_run_rows(steps.ranks[r], g, planned)
            if made is None:
                return None
            rows[r], served = made
            serves = [s and ok for s, ok in zip(serves, served)]
        return cls(template, rows, serves, steps.ranks[0].step_ids) if any(serves) else None

    def open(self, j: int, graphs: dict[int, DecodeGraphs | None]):
        """Step j of the run (0 = its first) as a StepWire, its rows copied into the graphs' buffers; None when the
        step must be planned (a shard computes only some rows, the graphs hold another bucket than the step's, or
        the shards' graphs are not the ones the rows are for)."""
        if not (0 <= j < len(self.serves) and self.serves[j]):
            return None
        if any(graphs.get(r) is not rows.graphs or rows.graphs.key != rows.keys[j] or not rows.fits()
               or rows.graphs.prefix_source is not rows.prefix_source for r, rows in self.rows.items()):
            return None
        for rows in self.rows.values():
            rows.refill(j)
        # The norms are not zeroed (a torch call, ~20-50 us on a GPU host): every attended layer writes its own entry
        # (wire_select.post_layer, out=norms[layer]) and they are read only once every layer was attended.
        return replace(self.template, step_id=self.step_ids[j], broken=[], sent_bytes=0, graphs=None, norms=self.norms)
