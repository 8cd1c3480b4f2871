"""Typed replies that cross processes (issue 19): what a shard's ``info()`` says about itself, what the
coordinator's begin_step and end_step answer a client, and what a shard's run_step reports to the coordinator.

Dataclasses instead of dicts with string keys: a misspelt field fails where it is read, the fields are
listed once, and Ray pickles them between the shard, the coordinator and the client like any object.
The public surface (``Service.info()``, ``stats()``, ``cpattn status --json``) still shows plain dicts:
``as_dict()``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cpattn.array_pickle import TensorsAsArrays

if TYPE_CHECKING:
    import torch

    from cpattn.cluster.page_delta import Delta
    from cpattn.cluster.step_planner import ShardStepPlan


@dataclass(frozen=True)
class ShardInfo:
    """One shard: where it runs, what it serves with, and how much KV it holds."""

    bundle_index: int
    """Its bundle in the service's placement group (names the actor; kept by a replacement)."""
    rank: int | None = None
    """Its DCP rank: set by the coordinator once ranks are assigned (by node, then GPU); None before."""
    node_id: str | None = None
    node_ip: str | None = None
    gpu_ids: tuple[str, ...] = ()
    """What Ray assigned the actor (ray.get_gpu_ids())."""
    gpu_uuid: str | None = None
    """The CUDA device's UUID (None on CPU): a client on the same GPU opens the shard's cache by CUDA IPC."""
    pid: int | None = None
    device: str | None = None
    backend: str | None = None
    """The attention backend's name (select_backend's choice in the shard's process)."""
    kernel_version: str | None = None
    lse_base: str | None = None
    prefill_backend: str | None = None
    """The backend of its prefill steps (select_prefill_backend's choice; = backend unless prefill_backend says)."""
    prefill_kernel_version: str | None = None
    num_blocks: int | None = None
    kernel_block_size: int | None = None
    ready: bool = True
    """False for a replacement until the coordinator has refilled it."""
    warmup_s: float | None = None
    """Seconds its kernels took to run once at start (cluster/kernel_warmup.py: compiling); None on a CPU."""
    kv_cache_dtype: str | None = None
    kv_bytes: int | None = None
    """None fields: a shard that has not answered (missing after a coordinator restart)."""

    def with_rank(self, rank: int) -> "ShardInfo":
        return dataclasses.replace(self, rank=rank)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class StepPlans(TensorsAsArrays):
    """One step a begin_step planned (a decode run: each of its steps)."""

    step_id: int
    local_plans: dict[int, ShardStepPlan]
    """Plans of the shards the client computes in its own process (step_planner.for_client: no secret, and
    block tables as deltas, ``BeginStepReply.local_pages``)."""
    remote_rows: dict[int, torch.Tensor | None]
    """Per remote shard with rows to send: which query rows it computes (None: all)."""
    remote_kv_rows: dict[int, torch.Tensor | None] | None = dataclasses.field(default=None, kw_only=True)
    """A selected step (cluster/wire_select.py): per remote shard, the new tokens whose K/V it gets (None: all);
    its query rows are ``remote_rows`` (a shard absent there gets none). None: the step's layers are broadcast."""


@dataclass
class BeginStepReply(StepPlans):
    """begin_step's answer: the (first) step's plans, and what the client needs to run it."""

    num_tokens: int
    seq_ids: list[str]
    """The step's sequences, canonical ids, in the request's order."""
    query_lens: list[int]
    plan_s: float
    """Seconds the coordinator spent (checks, allocation, plans, handing the remote shards theirs)."""
    epoch: int
    local_pages: dict[int, list[Delta]]
    """The in-process shards' block-table rows, as deltas against the pages the client holds (page_delta.py);
    one table for a whole decode run (its last step's pages)."""
    later: list[StepPlans]
    """A decode run's steps after the first (cluster/decode_run.py); empty for a plain step."""


@dataclass
class RunExtension:
    """extend_run's answer: a decode run's next steps, after its last planned one (cluster/run_extension.py)."""

    steps: Any
    """decode_run_plans.RunSteps of the new steps (the client's view: its in-process shards' plans, remote rows)."""
    local_pages: dict[int, list[Delta]]
    """The in-process shards' block-table rows for the new steps, as deltas (as BeginStepReply's)."""


@dataclass(frozen=True)
class Rejoin:
    """begin_step's answer to a client whose data-plane group predates a shard replacement: nothing was planned;
    rebuild the group on ``epoch`` and begin again."""

    epoch: int


@dataclass(frozen=True)
class EndStepReply:
    """end_step's answer (a step that failed for good raises instead)."""

    shard_plan_s: float = 0.0
    """A committed step: the slowest shard's plan, attention and wire seconds (the step waited for it)."""
    attention_s: float = 0.0
    shard_wire_s: float = 0.0
    shard_graphed_steps: int = 0
    """The most steps a shard served as one CUDA graph replay (cluster/shard_graphs.py)."""
    advanced: int | None = None
    """A decode run that goes on: how many of its steps are committed now."""
    committed_before_restart: bool = False
    """The step committed before the coordinator restarted (its journal says so); timings are unknown."""
    recovered: bool = False
    """The step was rolled back, the lost shard replaced and every sequence of the step kept its KV: run the
    step again (``failure`` says why it failed)."""
    epoch: int | None = None
    failure: str | None = None


@dataclass
class ShardStepReport:
    """What a shard's run_step reports: how the step (a decode run: its steps) ended there, and its seconds."""

    outcome: str = "served"
    """served (every layer), abort (the client rolled back), ended (a decode run the client ended early),
    broken (the data plane failed: ``error``) or fenced (a restarted coordinator's fence: ``error``)."""
    plan_s: float = 0.0
    attention_s: float = 0.0
    wire_s: float = 0.0
    layers: int = 0
    steps: int = 0
    """A decode run: how many of its steps the shard served."""
    graphed_steps: int = 0
    """How many of them were one CUDA graph replay (cluster/shard_graphs.py)."""
    error: str | None = None

    @classmethod
    def of(cls, timings: dict) -> "ShardStepReport":
        """From the dict a shard accumulates while it serves layers (keys: these fields)."""
        return cls(**timings)


@dataclass(frozen=True)
class ShardsReply:
    """get_shards' answer: the shard actors a client builds its data-plane group with, on which epoch."""

    epoch: int
    """Bumped by every shard replacement: a client whose group is older rebuilds it (cluster/client_group.py)."""
    shards: list
    """Actor handles by rank (None while a lost shard's replacement starts); their join and leave need a ticket."""
    infos: list[ShardInfo]
    """What each shard said about itself (its GPU decides which shards a client opens in its own process)."""
