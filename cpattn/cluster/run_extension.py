"""A decode run extended while it runs, the client's side (the coordinator's: coordinator_runs.py; the shards':
shard_runs.py).

At the second step of each segment of its run (the steps begin_step gave, then each extension's), the client asks
for the next segment without waiting: ``extend_run`` with twice the segment's steps, up to decode_run_steps (asked
that early, even a 4-step segment leaves the coordinator a few steps' time; the pages are held a segment sooner).
At the segment's last step, before committing it, it reads the answer (there by then). With steps, the run goes
on with them: its block tables from the answer's deltas, its first step planned, its later ones steady from the
previous segment's template (cluster/steady_run.py). Without (not granted, or not there within EXTENSION_WAIT_S),
the run ends there as it would have, END to its remote shards, and the coordinator undoes what it added when the
run's last commit says it ends.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import ray

from cpattn.cluster.decode_run_plans import use_block_tables
from cpattn.cluster.rpc import call
from cpattn.errors import CpattnError

if TYPE_CHECKING:
    from cpattn.cluster.client_run import DecodeRun
    from cpattn.cluster.messages import RunExtension
    from cpattn.cluster.page_delta import PageCache

logger = logging.getLogger("cpattn")


def ask_extension(gateway, run: DecodeRun) -> None:
    """After a step of ``run`` began: ask for its next segment once this one's second step began (one ask each)."""
    cfg = gateway.config
    segment = run.num_steps - run.segment_start
    if run.asked or not cfg.decode_run_extend or run.index - run.segment_start < 2:
        return
    run.asked = True
    held = gateway.pages.held(list(run.request), sorted(gateway.local)) if gateway.local else None
    ahead = min(cfg.decode_run_steps, 2 * segment)
    run.extension = gateway.coordinator.extend_run.remote(gateway.credential, run.first_step_id, ahead, held)


EXTENSION_WAIT_S = 1.0
"""How long the run's last step waits for an extension not there yet (asked a segment earlier: a coordinator busy
planning others' steps, a loaded host), before the run ends as without one. Waiting is no slower than the begin_step
it saves, which would queue behind the same coordinator; the bound is for a shard that does not answer
(coordinator_runs waits for it up to rpc_timeout_s)."""


def take_extension(gateway, run: DecodeRun) -> bool:
    """At ``run``'s last planned step: True when its extension came and the run now goes on with it. One that has
    not come within EXTENSION_WAIT_S is left: the run's commit ends what the coordinator adds (ends_run)."""
    ref, run.extension = run.extension, None
    if ref is None or not ray.wait([ref], timeout=EXTENSION_WAIT_S)[0]:
        return False
    try:
        extension = call(ref, gateway.config.rpc_timeout_s, "extend_run")
    except CpattnError as exc:   # the run ends at its planned end; its commit ends what the coordinator added
        logger.warning("decode run %d: its extension did not come (%s); the next step begins a new run",
                       run.first_step_id, exc)
        return False
    if extension is None:
        return False
    adopt_extension(gateway.pages, run, extension)
    return True


def adopt_extension(pages: PageCache, run: DecodeRun, extension: RunExtension) -> None:
    """The run goes on with the extension's steps, its in-process shards' tables from the deltas (``pages``: the
    client's PageCache, which held the run's tables so far)."""
    seq_ids = list(run.request)
    tables = {r: pages.apply(r, seq_ids, deltas) for r, deltas in extension.local_pages.items()}
    use_block_tables(extension.steps, tables)
    run.extend(extension.steps)
