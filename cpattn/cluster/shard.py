"""Shard worker: owns one shard of every layer's paged KV and runs the attention backend on it.

A plain class; ``ray.remote`` is applied where the group is created, so it is testable without Ray.
Per step it receives one ShardStepPlan (metadata planned once, reused by every layer), then
serves layers from its data-plane group until the gateway says commit or abort. Its methods on whole KV
pages (refill, CUDA IPC export, synthetic fill) are in shard_kv.py, on its data-plane groups in shard_groups.py.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import threading
import time

import torch

from cpattn.attention import select_backend, select_prefill_backend
from cpattn.attention.registry import apply_registry_state
from cpattn.cluster import authority
from cpattn.cluster.decode_graphs import DecodeGraphs
from cpattn.cluster.decode_run_plans import RunSteps, run_auths
from cpattn.cluster.shard_graphs import ShardStepGraphs
from cpattn.cluster.data_plane import CMD_ABORT, CMD_ATTEND, DataPlane, partial_tag
from cpattn.cluster.fencing import StepFence
from cpattn.cluster.shard_groups import ShardGroups
from cpattn.cluster.shard_kv import ShardKVPages
from cpattn.cluster.shard_runs import LiveRuns, ShardRunMethods
from cpattn.cluster.kernel_warmup import warm_up_kernels
from cpattn.cluster.layer_runner import PlannedStep, ShardLayerRunner
from cpattn.cluster.messages import ShardInfo, ShardStepReport
from cpattn.cluster.step_planner import ShardStepPlan
from cpattn.cluster.wire_select import receiver_for
from cpattn.config import ServiceConfig
from cpattn.errors import ConfigError, CpattnError
from cpattn.kvstore.fp8 import fp8_dtype, initial_page_scales, is_fp8

logger = logging.getLogger("cpattn.shard")


class ShardWorker(ShardKVPages, ShardGroups, ShardRunMethods):
    def __init__(self, config: ServiceConfig, bundle_index: int, backend_registry: dict | None = None,
                 secret: str | None = None, ready: bool = True, operator_digest: str | None = None):
        self.config = config
        self._operator_digest = operator_digest   # the operator may read checksums and group names
        # A replacement is not ready until the coordinator refilled it; a restarted coordinator that finds an
        # unready one (its predecessor died mid-refill) replaces it again instead of serving a half-empty shard.
        self._ready = ready
        self._secret = secret   # the coordinator's: KV reads/writes, plans and group joins prove it (issue 12)
        if backend_registry:
            # Plugins registered by the process that started the service (register_backend) live there only.
            apply_registry_state(backend_registry)
        self.bundle_index = bundle_index
        self.device = torch.device(config.resolved_device())
        if self.device.type == "cuda":
            if not torch.cuda.is_available():   # (set_device raised an AttributeError from torch._C)
                raise ConfigError(f"shard {bundle_index}: device {config.resolved_device()!r}, but this shard's "
                                  "process sees no CUDA device: give shards GPUs with num_gpus_per_shard > 0 (now "
                                  f"{config.num_gpus_per_shard:g}) on nodes that have them, or set device='cpu'")
            torch.cuda.set_device(0)   # Ray narrows CUDA_VISIBLE_DEVICES to this actor's GPU
            self.device = torch.device("cuda", 0)
        else:
            torch.set_num_threads(max(1, int(config.num_cpus_per_shard)))
        self.dtype = config.torch_dtype
        self.backend = select_backend(config, self.device)
        self.prefill_backend = select_prefill_backend(config, self.backend, self.device)   # same cache, pair checked
        self.num_blocks = config.blocks_per_shard()
        shape = self.backend.get_kv_cache_shape(self.num_blocks, config.block_size, config.num_kv_heads, config.head_size)
        self.kv_format = config.kv_cache_format if is_fp8(config.kv_cache_format) else None
        self.cache_dtype = fp8_dtype(self.kv_format) if self.kv_format else self.dtype
        self.kv_caches = [torch.zeros(shape, dtype=self.cache_dtype, device=self.device)
                          for _ in range(config.num_layers)]
        # fp8: [2, num_blocks, Hk] float32 page scales per layer (static from the config on every page, or
        # dynamic: 0 until a write into the page; cpattn/kvstore/fp8.py).
        self.kv_scales = None if self.kv_format is None else [
            initial_page_scales(self.num_blocks, config.num_kv_heads,
                                None if config.kv_scales is None else config.kv_scales[layer], self.device)
            for layer in range(config.num_layers)]
        self.runner = ShardLayerRunner(config, self.backend, self.kv_caches, self.device, self.kv_scales,
                                       self.prefill_backend)
        self.kernel_block_size = self.runner.kernel_block_size
        self.warmup_s = None   # kernels compile here, within start_timeout_s, not in a first step
        if self.device.type == "cuda":
            self.warmup_s = warm_up_kernels(config, self.backend, self.prefill_backend, self.device,
                                            f"shard {bundle_index}")
        self._groups: dict[str, DataPlane] = {}
        self._graphs: dict[str, DecodeGraphs | None] = {}   # per group: a client runs one step at a time
        self._step_graphs: dict[str, ShardStepGraphs] = {}   # per NCCL group: whole decode steps (shard_graphs)
        self._live_runs = LiveRuns()   # per group: the decode run its thread serves (extensions join it)
        self._admitted: dict[str, float] = {}   # ticket -> when it expires (a ticket joins once)
        self._ended: dict[str, float] = {}      # client id -> when it ended (its older tickets are void)
        self._joining: dict[str, int] = {}      # client id -> joins whose handshake is still running
        self._lock = threading.Lock()
        self._hang = False
        self._fence = StepFence()   # coordinator fencing: steps of an older incarnation never write (fencing.py)
        logger.info("shard %d: backend %s (%s), %d blocks of %d tokens, kernel pages of %d, device %s",
                    bundle_index, self.backend.get_name(), self.backend.kernel_version(), self.num_blocks,
                    config.block_size, self.kernel_block_size, self.device)   # the prefill backend: the selector's log

    # Authority (the remote surface calls this before every method: cluster.authority) ----------------
    def authorize(self, rule: authority.Rule, proof, arguments: dict, method: str) -> None:
        if self._secret is None:
            return   # a plain worker in a unit test: no service, nothing to prove
        who = f"shard {self.bundle_index}"
        if rule.who == authority.TICKET:
            group_name = arguments.get("group_name")
            if authority.read_ticket(self._secret, group_name, proof) is None:
                raise authority.refuse(who, method, f"group {group_name!r} refused: no valid ticket (get one from "
                                                    "the coordinator with the client's credential)")
            return
        if rule.who == authority.PLAN:
            proof = getattr(proof, "auth", None)
        ok = authority.matches_secret(proof, self._secret) or (
            rule.who in (authority.SECRET_OR_OPERATOR, authority.TEST_HOOK)
            and authority.matches_digest(proof, self._operator_digest))
        if not ok:
            raise authority.refuse(who, method, "only the service's coordinator may call it" + (
                "" if rule.who in (authority.SECRET, authority.PLAN) else " (or the operator credential)"))
        if rule.who == authority.TEST_HOOK and not self.config.test_hooks:
            raise authority.refuse(who, method, "test hooks are off: only a service started with test_hooks=True "
                                                "(the test suite's) serves them")

    # Introspection --------------------------------------------------------------------------------
    def info(self, secret: str | None = None) -> ShardInfo:
        gpu_ids: tuple[str, ...] = ()
        node_id = socket.gethostname()
        node_ip = "127.0.0.1"
        import ray

        if ray.is_initialized():   # else a plain worker in a unit test (get_runtime_context would start Ray)
            node_id = ray.get_runtime_context().get_node_id()
            node_ip = ray.util.get_node_ip_address()
            gpu_ids = tuple(str(g) for g in ray.get_gpu_ids())
        gpu_uuid = str(torch.cuda.get_device_properties(self.device).uuid) if self.device.type == "cuda" else None
        return ShardInfo(bundle_index=self.bundle_index, node_id=node_id, node_ip=node_ip, gpu_ids=gpu_ids,
                         gpu_uuid=gpu_uuid, pid=os.getpid(), device=str(self.device), backend=self.backend.get_name(),
                         kernel_version=self.backend.kernel_version(), lse_base=self.backend.lse_base.name,
                         prefill_backend=self.prefill_backend.get_name(),
                         prefill_kernel_version=self.prefill_backend.kernel_version(),
                         num_blocks=self.num_blocks, kernel_block_size=self.kernel_block_size, ready=self._ready,
                         warmup_s=self.warmup_s,
                         kv_cache_dtype=str(self.cache_dtype).removeprefix("torch."),
                         kv_bytes=sum(t.numel() * t.element_size() for t in self.kv_caches))

    def ping(self, secret: str | None = None) -> bool:
        return not self._hang

    def simulate_hang(self, secret: str | None = None, hang: bool = True) -> None:
        """Test hook: stop answering pings and data-plane traffic, as a wedged process would."""
        self._hang = hang

    # Coordinator fencing (issue 12) ----------------------------------------------------------------
    def fence(self, incarnation: int, timeout_s: float, secret: str | None = None) -> dict:
        """Called by a restarted coordinator before it hands out any page: steps of older incarnations
        write nothing more (see cluster/fencing.py). Returns once none of them is mid-write."""
        report = self._fence.raise_floor(incarnation, timeout_s)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)   # writes launched before the floor rose have landed
        logger.warning("shard %d fenced coordinator incarnations below %d (%d steps were mid-write)",
                       self.bundle_index, incarnation, report["waited_for"])
        return report

    def run_step(self, group_name: str, plan: ShardStepPlan | RunSteps, later: list[ShardStepPlan] | None = None
                 ) -> ShardStepReport:
        """Serve every layer of one step from the group; returns timings (seconds) and how it ended.

        ``later``: the next steps of a decode run (cluster/decode_run.py), each served after the client's run
        header says NEXT (planned before that header arrives, so its first layer starts at once); END stops. A
        run planned at once comes whole as ``plan`` (RunSteps: each step's plan built as it is reached). A run's
        extensions join it while it runs (extend_run, shard_runs.py); after its last step one more header says
        END or NEXT into the extension its client took."""
        plane = self._groups.get(group_name)
        if plane is None:
            raise CpattnError(f"shard {self.bundle_index}: not in data-plane group {group_name!r}")
        later = later or ()
        if self._secret is not None and not all(authority.matches_secret(a, self._secret) for a in run_auths(later)):
            raise authority.refuse(f"shard {self.bundle_index}", "run_step", "a run's plans come from its coordinator")
        if group_name not in self._graphs:
            self._graphs[group_name] = self.runner.new_graphs()
            if self._graphs[group_name] is not None and ShardStepGraphs.supported(plane, self.runner):
                self._step_graphs[group_name] = ShardStepGraphs(plane, self.runner)
        steps = iter(plan) if isinstance(plan, RunSteps) else itertools.chain([plan], later)   # built as reached
        if not (len(plan) > 1 if isinstance(plan, RunSteps) else later):
            return self._serve_run(plane, group_name, None, steps)
        first = plan.ranks[0].step_ids[plan.start] if isinstance(plan, RunSteps) else plan.step_id
        run = self._live_runs.start(group_name, first, steps)
        try:
            return self._serve_run(plane, group_name, run, steps)
        finally:
            self._live_runs.finish(group_name, run)

    def _serve_layers_ahead(self, plane: DataPlane, planned: PlannedStep, timings: dict,
                            step_graphs: ShardStepGraphs | None = None) -> dict:
        """NCCL: every layer of the step enqueued at once, in order 0..L-1, without waiting for its message.

        NCCL operations are stream-ordered, so the GPU waits for each layer's message and the host does not:
        the shard's kernels start the moment a message lands instead of after a host round trip per layer.
        The client attends layers in order (Step enforces it on NCCL) and, when it stops early, sends every
        remaining message marked ABORT and drains their partials; the headers are read once, at the end.
        A coordinator restart's fence() waits until these launched writes have landed (cuda synchronize).
        With ``step_graphs`` ready for this step, the whole step is one graph replay (cluster/shard_graphs.py).
        """
        plan = planned.plan
        while self._hang:
            time.sleep(0.05)
        if not self._fence.enter(plan.incarnation):   # fencing: write nothing past a coordinator restart
            return self._refuse_fenced(plane, plan, timings)
        a0 = time.perf_counter()
        graphed = not plan.selected and step_graphs is not None and step_graphs.prepare(planned)
        receiver = receiver_for(plane, planned, self.config, self.device)
        headers = []
        try:
            if graphed:
                step_graphs.replay()
            else:
                for layer in range(self.config.num_layers):
                    header, q, k, v = receiver.receive(ahead=True)
                    headers.append(header)
                    out, lse = self.runner.run_layer(planned, layer, q, k, v)
                    if plan.num_rows:
                        plane.send_partial(out, lse, partial_tag(plan.step_id, layer))
        finally:
            self._fence.leave()   # every write is launched; fence() waits for them on the device
        a1 = time.perf_counter()
        # The one host wait of the step: until its last message.
        got = step_graphs.wait(self.config.collective_timeout_s) if graphed else torch.stack(headers).tolist()
        timings["graphed_steps"] = timings.get("graphed_steps", 0) + int(graphed)
        timings["attention_s"] += a1 - a0
        timings["wire_s"] += time.perf_counter() - a1
        timings["layers"] += sum(1 for h in got if h[0] == CMD_ATTEND)
        for layer, (command, h_layer, step_id, num_tokens) in enumerate(got):
            if command == CMD_ABORT:
                timings["outcome"] = "abort"
                return timings
            if command != CMD_ATTEND or step_id != plan.step_id or num_tokens != plan.num_tokens or h_layer != layer:
                raise CpattnError(f"shard {self.bundle_index}: unexpected header {(command, h_layer, step_id, num_tokens)}"
                                  f" for layer {layer} of step {plan.step_id} ({plan.num_tokens} tokens)")
        timings["outcome"] = "served"
        return timings

    def _serve_layers(self, plane: DataPlane, planned: PlannedStep, timings: dict,
                      step_graphs: ShardStepGraphs | None = None) -> dict:
        if plane.backend == "nccl":
            return self._serve_layers_ahead(plane, planned, timings, step_graphs)
        plan = planned.plan
        t = plan.num_tokens
        receiver = receiver_for(plane, planned, self.config, self.device)
        served: set[int] = set()
        while len(served) < self.config.num_layers:
            while self._hang:
                time.sleep(0.05)
            w0 = time.perf_counter()
            (command, layer, step_id, num_tokens), q, k, v = receiver.receive(ahead=False)
            if command == CMD_ABORT:
                timings["outcome"] = "abort"
                return timings
            if command != CMD_ATTEND or step_id != plan.step_id or num_tokens != t or layer in served:
                raise CpattnError(f"shard {self.bundle_index}: unexpected header {(command, layer, step_id, num_tokens)} "
                                  f"in step {plan.step_id} of {t} tokens")
            served.add(layer)
            if not self._fence.enter(plan.incarnation):   # fencing: write nothing past a coordinator restart
                return self._refuse_fenced(plane, plan, timings)
            a0 = time.perf_counter()
            out, lse = self.runner.run_layer(planned, layer, q, k, v)
            self._fence.leave()   # fencing: this layer's KV writes are launched (fence() waits for the device)
            a1 = time.perf_counter()
            if plan.num_rows:
                plane.send_partial(out, lse, partial_tag(plan.step_id, layer))
            timings["attention_s"] += a1 - a0
            timings["wire_s"] += (a0 - w0) + (time.perf_counter() - a1)
            timings["layers"] += 1
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)   # the step's sends are done before it reports
        timings["outcome"] = "served"
        return timings


RemoteShard = authority.remote_surface(ShardWorker, authority.SHARD_METHODS, "RemoteShard", __name__)
"""What Ray runs (cluster.shard_set): only the methods of authority.SHARD_METHODS, each checked."""
