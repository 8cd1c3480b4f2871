"""The fields of ``ServiceConfig`` (cpattn/config.py) in groups, one pydantic model each; ServiceConfig
inherits them all and adds the checks across groups and the derived values.

Each field's docstring is its help text (``cpattn serve --help``, through pydantic's use_attribute_docstrings).
The groups are listed in GROUPS in the order their fields read (help, errors, ``model_dump``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

# Longest timeout or interval accepted (one day): beyond it, timedelta, Event.wait and Ray's millisecond
# timeouts overflow, and a value that large is a mistake (inf used to fail with OverflowError after 13 s).
MAX_SECONDS = 86400.0


def _seconds(default: float, doc_gt: float = 0):
    """A finite, positive duration of at most MAX_SECONDS."""
    return Field(default, gt=doc_gt, le=MAX_SECONDS, allow_inf_nan=False)


class FieldGroup(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)   # docstrings: --help


class ModelGeometry(FieldGroup):
    """The model's attention geometry and how the service addresses it."""

    num_shards: int = Field(4, ge=1, le=1024)
    """Shard actors; each owns an interleaved share (DCP) of every sequence's KV cache."""
    num_layers: int = Field(32, ge=1, le=4096)
    """Attention layers; each shard holds one paged KV tensor per layer."""
    num_q_heads: int = Field(32, ge=1)
    """Query heads (Hq)."""
    num_kv_heads: int = Field(8, ge=1)
    """KV heads (Hk); Hq must be a multiple of it (GQA/MQA)."""
    head_size: int = Field(128, ge=1)
    """Head dimension D; a multiple of 8 up to 256 (what the GPU kernels accept)."""
    block_size: int = Field(16, ge=1)
    """Tokens per KV page on each shard (the manager block size)."""
    dtype: Literal["float16", "bfloat16", "float32", "float64"] = "bfloat16"
    """Activation and KV dtype of q, k, v and the output."""
    backend: str = "auto"
    """Attention backend: auto, TORCH, FLASHINFER, FLASH_ATTN, TRITON or a registered plugin name. It runs decode
    steps (and their CUDA graphs), and prefill steps too unless prefill_backend names another."""
    prefill_backend: str = "same"
    """Backend of steps where some sequence has more than one new token (chunked prefill, its context-parallel
    split): same (the default) = backend; auto = the fastest prefill backend that serves the settings and shares
    backend's paged KV cache (CUDA: FLASH_ATTN, then FLASHINFER), else backend; or a name as for backend, refused
    with every reason when it cannot serve or cannot share the cache (layout, kernel page size)."""
    dcp_interleave: int = Field(1, ge=1)
    """DCP interleave size I: tokens [k*I, (k+1)*I) live on shard k mod num_shards."""



class KVCacheSize(FieldGroup):
    """How much KV each shard holds."""

    num_blocks_per_shard: int | None = Field(None, ge=1)
    """KV pages per shard; derived from kv_cache_bytes_per_shard when unset."""
    kv_cache_bytes_per_shard: int = Field(256 * 2**20, ge=1)
    """Memory budget of one shard's KV cache (all layers) when num_blocks_per_shard is unset."""
    max_sequences: int = Field(4096, ge=1)
    """Most live sequences the service holds at once."""



class Placement(FieldGroup):
    """Where shards run and how a client reaches them."""

    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where shards keep KV and compute: auto takes cuda when GPUs are assigned, else cpu."""
    num_cpus_per_shard: float = Field(1.0, ge=0, allow_inf_nan=False)
    """Ray CPU resources reserved per shard bundle."""
    num_gpus_per_shard: float = Field(0.0, ge=0, allow_inf_nan=False)
    """Ray GPU resources per shard (0.25 lets four shards share one GPU)."""
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """Ray placement group strategy for the shard bundles (SPREAD for multi-node)."""
    data_plane: Literal["auto", "gloo", "nccl"] = "auto"
    """torch.distributed backend between a client and the shards it reaches over the wire: auto = NCCL
    when the client and each of those shards have a GPU of their own (tensors stay on the GPUs), gloo
    otherwise (CPU, or shards sharing a GPU: CUDA tensors are staged through the host)."""
    prefill_wire: Literal["auto", "broadcast", "per_rank"] = "auto"
    """How a prefill step's q|k|v reach the remote shards per layer: per_rank sends each only the query rows it
    computes and the new K/V it stores or attends (point to point), broadcast sends every one the whole q|k|v;
    auto takes per_rank when the client sends fewer bytes that way (with one remote shard, always)."""
    data_plane_interface: str | None = None
    """Network interface the data plane binds to on every node (e.g. eth1), for machines with several networks;
    unset: each process binds to its node IP as Ray knows it (`ray start --node-ip-address`), never to what the
    hostname resolves to (often 127.0.0.1 or 127.0.1.1). Sets NCCL_SOCKET_IFNAME for NCCL likewise."""
    shard_resources: dict[str, float] = {}
    """Extra Ray resources each shard's bundle asks for, e.g. {"cpattn_shard": 1} with `ray start --resources
    '{"cpattn_shard": 1}'` on the nodes that may hold shards (one shard per such node when each has 1)."""
    shard_label_selector: dict[str, str] = {}
    """Node labels every shard's node must carry (`ray start --labels key=value`), e.g. {"cpattn/shards": "yes"}."""
    coordinator_resources: dict[str, float] = {}
    """Extra Ray resources of the coordinator actor, e.g. {"cpattn_coordinator": 1} with that resource given to
    the head only (`ray start --head --resources ...`): the coordinator then runs on the head."""
    coordinator_label_selector: dict[str, str] = {}
    """Node labels the coordinator's node must carry (`ray start --labels`)."""
    local_shards: Literal["auto", "off"] = "auto"
    """auto: a client on a shard's GPU computes that shard's share in its own process, on the shard's KV
    cache opened by CUDA IPC (no hand-over between two processes on one GPU); off: every shard over the wire.
    A detached service (cpattn serve) always uses the wire: its coordinator may restart mid-step, and only
    the shards themselves can fence a previous incarnation's writes."""



class StepExecution(FieldGroup):
    """How a step runs: CUDA graphs, commits, decode runs, prefill splits, NaN checks."""

    cuda_graphs: Literal["auto", "off"] = "auto"
    """auto: a decode-only step on CUDA shards whose backend declares CUDA-graph support (TRITON) replays one
    captured graph per layer (KV write, paged decode, split merge, NaN check: one launch instead of ~10),
    captured once per (batch size, KV splits, block-table width) bucket; off: eager launches every layer."""
    async_commit: bool = True
    """Send a step's commit without waiting; the answer is read by the client's next call, so a decode loop
    pays one Ray round trip per step. A shard lost between the last layer and the commit is then reported
    (kv_replicas=1) or replayed (kv_replicas=2) at that next call instead of at the end of the step. A detached
    service always commits before the step ends (its coordinator can restart in between)."""
    decode_run_steps: int = Field(128, ge=1, le=256)
    """Most decode steps planned per coordinator round trip: a decode-only step (each sequence + 1 token) with
    ``async_commit`` plans a run of steps ahead (4, doubling after each run the client finishes, up to this),
    and the client runs them without asking the coordinator or making a Ray call to any shard
    (cluster/decode_run.py); a step with other sequences or other token counts ends the run early and gets
    back its unused pages. 1: plan every step (one Ray round trip per step). A run's start costs its step
    9-17 ms on an H200 host (the last run's commit, the plan, the first step's tables), so 128 steps charge a
    step ~0.1 ms of it where 32 charged 0.3-0.5 (issue 18's 0.3 ms per step); a run holds one page per
    sequence and 16 steps ahead (128 steps of B=64 at page 16: 512 pages, returned when it ends early)."""
    decode_run_extend: bool = True
    """Extend a decode run while it runs: at each segment's second step the client asks (without waiting) for its
    next steps (twice as many, up to ``decode_run_steps``), grown, planned and handed to the shards while it
    decodes; at the run's last step it goes on with them, with no begin_step in between
    (cluster/coordinator_runs.py). False: a run ends after its steps and the next begins with a coordinator round
    trip (18-24 ms on an H200 host)."""
    pcp_enabled: bool = True
    """Split the causal part of long prefills across shards (prefill context parallelism)."""
    pcp_min_tokens: int = Field(2048, ge=1)
    """A request with at least this many new tokens in a step is split across shards."""
    pcp_wire_flops_per_byte: float = Field(3000.0, ge=0, allow_inf_nan=False)
    """Attention FLOPs a shard computes in the time one byte travels to a remote shard (3000: FlashAttention 4 at
    ~600 TFLOP/s on an H200 against ~200 GB/s of NCCL point to point over NVLink). When the client computes some
    shards in its own process, a long prefill's causal part is cut into contiguous query ranges, the earliest for
    those shards and the later ones for the remote shards, sized so all finish together counting the bytes each
    remote shard's rows travel; 0: equal shares (head-tail pairs), as when every shard is remote."""
    nan_policy: Literal["reject", "allow"] = "reject"
    """reject: NaN/inf in q, k or v raises InvalidRequestError (they would poison the cache)."""



class Reliability(FieldGroup):
    """Replicas, the service's Ray identity, and every timeout."""

    kv_replicas: int = Field(1, ge=1, le=2)
    """Copies of every token's KV; 2 keeps a replica on another shard so a lost shard is refilled."""
    name: str = Field("cpattn", min_length=1)
    """Name of the coordinator actor; connect(name=...) finds the service by it."""
    namespace: str = Field("cpattn", min_length=1)
    """Ray namespace of the named coordinator."""
    detached: bool = False
    """Keep the service alive after the starting process exits (cpattn serve)."""
    ray_address: str | None = None
    """Ray cluster to join (e.g. 'auto' or 'ray://host:10001'); None starts a local embedded Ray."""
    rpc_timeout_s: float = _seconds(60.0)
    """Timeout of every blocking Ray call."""
    collective_timeout_s: float = _seconds(120.0)
    """Timeout of data-plane collectives; a hung shard surfaces as an error after this."""
    start_timeout_s: float = _seconds(300.0)
    """Time allowed for shards to be placed and start."""
    placement_wait_s: float = _seconds(20.0)
    """How long shards wait to be placed while nothing will free what they lack by itself (resources held by
    other services' placement groups or by actors, or a cluster too small): then start fails naming what holds
    them and what to change. Resources held by running tasks are waited for up to start_timeout_s. Raise it
    where nodes are added on demand (an autoscaler)."""
    health_check_interval_s: float = _seconds(1.0)
    """How often the coordinator checks that shards are alive (replica failover)."""
    shard_hang_timeout_s: float = _seconds(30.0)
    """A live shard that does not answer a ping for this long is declared hung and replaced. Keep it above
    the longest GIL-holding pause (a kernel JIT compile takes seconds); a dead shard is seen at once."""
    join_timeout_s: float = _seconds(20.0)
    """A shard gives up on a data-plane join whose handshake (the client's rendezvous) has not finished within
    this, freeing its thread; a client joins at most two groups at once per shard (shard_groups.MAX_JOINS_PER_CLIENT)."""
    test_hooks: bool = False
    """Serve test-only remote methods (shard.simulate_hang, which makes a shard look hung). Only the test suite
    sets it; off, those methods refuse every caller."""



class ClientLimits(FieldGroup):
    """What one client and one step may hold."""

    max_tokens_per_client: int | None = Field(None, ge=1)
    """Optional quota: tokens of KV a single client may hold across its sequences."""
    max_sequences_per_client: int | None = Field(None, ge=1)
    """Optional quota: sequences (block-table rows, max_sequences in all) a single client may hold, forks
    included; an empty sequence holds no tokens but does hold a row. One more is refused with CapacityError."""
    client_lease_s: float = _seconds(30.0)
    """A client that makes no call and sends no heartbeat (every client_lease_s / 3) for this long has ended:
    its open step is rolled back, its data-plane groups dropped, its sequences freed (kept with
    ``connect(on_lapse="keep")``). close() ends a client too, keeping its sequences."""
    max_tokens_per_step: int = Field(16384, ge=1)
    """Most new tokens in one step (all its sequences); a bigger step is refused with InvalidRequestError
    before anything is allocated. Bounds a step's per-shard memory (q/k/v and outputs grow with it; the TORCH
    backend attends in tiles, so scores do not grow with its square): split long prefills into chunks."""
    max_open_steps: int = Field(48, ge=1, le=1024)
    """Most steps open at once (each holds a thread on every shard while its shard calls run: a step whose
    client stalled mid-step stops counting once its shards gave up, after collective_timeout_s); one more is
    refused with CapacityError. Shards get this many step threads plus headroom for control calls; pings and fencing
    have threads of their own."""



class AttentionFeatures(FieldGroup):
    """Sliding windows, soft caps and the fp8 KV cache."""

    sliding_window: int | list[int | None] | None = None
    """Local attention (Mistral/Gemma style): a query at global position p sees keys at positions
    p - W < j <= p (W keys, itself included). One int for every layer, a list with one entry per layer
    (None = full attention on that layer), or None. Applied on global positions on every shard."""
    release_pages_outside_window: bool = True
    """When every layer has a window: pages holding only tokens no later query can see (wholly before the last
    token's largest window) go back to the pool as a sequence grows, so a sequence holds about its window
    rather than its length, and may grow past the whole cache (as vLLM's sliding-window manager does). A fork
    must then start where its window's pages are still held (at the sequence's length, or within a window of
    it). False keeps every page until the sequence is freed."""
    logits_soft_cap: float | list[float | None] | None = None
    """Gemma-2 style soft cap of the scaled logits: s -> cap * tanh(s / cap). One value for every layer,
    one per layer (None = no cap), or None."""
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"] = "auto"
    """KV cache element type: auto = the activation dtype; fp8_e4m3 (alias fp8, as in vLLM) or fp8_e5m2
    store one byte per element with a float32 scale per (layer, K/V, kv head), so a shard holds about
    twice the tokens of bf16 (four times float32). Scales are dynamic (kv_scales unset) or static."""
    kv_scales: list[list[list[float]]] | None = None
    """Static fp8 scales from a checkpoint's calibration: [num_layers][2 (K, V)][num_kv_heads], dequantised
    value = stored * scale. Unset: dynamic scales, computed on write (see cpattn/kvstore/fp8.py)."""



GROUPS = (ModelGeometry, KVCacheSize, Placement, StepExecution, Reliability, ClientLimits, AttentionFeatures)
