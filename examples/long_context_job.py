"""Long-context inference with a Hugging Face Llama-family decoder (Llama, Mistral, Gemma 2/3, Qwen2/3, gpt-oss)
whose attention runs on cpattn.

The model's own projections, RoPE, MLPs and sampling run here; every attention layer runs on a cpattn
service through transformers' attention interface (``AttentionInterface.register("cpattn", ...)``).
The service holds the whole KV cache, sharded over its Ray actors, so the model runs without a
transformers cache: each forward passes only the new tokens, and one cpattn step covers every layer of
that forward (model layer i = cpattn layer i). A long prompt is prefilled in chunks, then greedy decoding.
With ``--questions N`` the prompt is a shared document: prefilled once, forked into N sequences (svc.fork:
they share its KV pages, nothing is copied or prefilled again), each gets its own question, and all N
are decoded in one batch.

With ``--device cuda`` the model (a Llama-3-8B shape with random weights built on the GPU, or ``--model DIR``)
runs in bf16 on this process's GPU and hands q/k/v to the service as CUDA tensors: the shard on this GPU is
computed in-process on its KV cache (CUDA IPC), shards on other GPUs are reached over NCCL. Nothing of the
prompt's length is held on the GPU beyond the current chunk (the KV lives on the shards; only the last
position's logits are computed). ``--attn sdpa`` runs the same model with transformers' SDPA and its own cache
on one GPU instead: the baseline.

    python examples/long_context_job.py                              # tiny random Llama, embedded Ray
    python examples/long_context_job.py --questions 8                # one document, 8 questions, one batch
    python examples/long_context_job.py --model /path/to/llama      # local weights (no downloads)
    ray job submit --working-dir . -- python examples/long_context_job.py
    cpattn submit -- python examples/long_context_job.py --service cpattn   # attach to `cpattn serve`
    ray job submit --entrypoint-num-gpus 0.5 --working-dir . -- python examples/long_context_job.py --device cuda \\
        --prompt-len 1048576 --chunk-size 8192 --shards 2 --json-out /tmp/1m.json      # scripts/job_gpu.sh

On the embedded default it produces exactly the tokens of the model's eager attention (--verify checks).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))   # its sibling modules, however this file is loaded
from job_args import parser, resolve  # noqa: E402
from job_attention import ATTENTION, ATTN_IMPLEMENTATION, one_or_per_layer, probe_layers  # noqa: E402,F401
from job_models import (BUILT_IN, NoSdpaError, build_model, describe, kv_bytes_per_token,  # noqa: E402,F401
                        tiny_llama_config, weight_bytes)
from job_report import GIB, Progress, environment, peak_gpu_gib, phase_rates, summary_table  # noqa: E402
from job_sdpa import SdpaLM  # noqa: E402

from cpattn.errors import CpattnError  # noqa: E402

# GPU memory the client needs beside the model and the KV of the shard on its GPU: an 8K-token chunk's
# activations (the MLP's [T, 14336] pair dominates), the attention partials and the kernels' workspace.
CLIENT_HEADROOM_BYTES = 6 * GIB


def make_prompt(vocab_size: int, length: int, batch: int, seed: int) -> torch.Tensor:
    """Random token ids [batch, length] (a fixed seed, so a reference run sees the same prompt)."""
    gen = torch.Generator().manual_seed(seed + 1)
    return torch.randint(0, vocab_size, (batch, length), generator=gen)


def make_questions(vocab_size: int, num_questions: int, length: int, seed: int) -> torch.Tensor:
    """Random token ids [num_questions, length]: one question per fork of the document."""
    gen = torch.Generator().manual_seed(seed + 2)
    return torch.randint(0, vocab_size, (num_questions, length), generator=gen)


class CpattnLM:
    """Runs a transformers causal LM with its attention on a cpattn service; one step per forward."""

    def __init__(self, model, service, batch: int, seq_ids: list[str] | None = None, position: int = 0,
                 decode_graph: bool | None = None, sinks: bool = False):
        """``batch`` new sequences, or ``seq_ids`` that already hold ``position`` tokens each (forks).
        ``decode_graph`` (default: on CUDA, unless the model has ``sinks``, which a captured step does not take):
        decode steps replay the whole forward as one CUDA graph."""
        from transformers import AttentionInterface

        AttentionInterface.register(ATTN_IMPLEMENTATION, ATTENTION)
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        ATTENTION.expect(service.config)
        self.model = model
        self.device = next(model.parameters()).device
        self.svc = service
        self.seq_ids = seq_ids if seq_ids is not None else [service.add_sequence() for _ in range(batch)]
        self.position = position
        self.use_graph = self.device.type == "cuda" and not sinks if decode_graph is None else decode_graph
        self.graph = None   # svc.decode_graph of this batch's decode steps, made at the first one

    def _decode_step(self, input_ids: torch.Tensor) -> torch.Tensor:
        """One decode step (one new token per row) through svc.decode_graph: the model's whole forward, cpattn's
        attend calls included, captured once and replayed per token (eager where it cannot be captured)."""
        if self.graph is None:
            ids = torch.zeros_like(input_ids)
            positions = torch.zeros_like(input_ids)

            def forward(step):
                ATTENTION.step = step
                try:
                    return self.model(input_ids=ids, position_ids=positions, use_cache=False,
                                      logits_to_keep=1).logits[:, -1]
                finally:
                    ATTENTION.step = None

            self.graph = self.svc.decode_graph(self.seq_ids, forward, allow_eager=True)
            self.graph_inputs = (ids, positions)
        ids, positions = self.graph_inputs
        ids.copy_(input_ids)
        positions.fill_(self.position)
        logits = self.graph.step().clone()   # the graph's output tensor is refilled by the next step
        self.position += 1
        return logits

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits of the last new token per row, [B, vocab]; the tokens' KV joins the service's cache.

        Only this forward's tokens are on the device: ids, positions and hidden states of the chunk, and the
        logits of its last position (``logits_to_keep=1``: the [T, vocab] logits of a chunk are never made)."""
        b, n = input_ids.shape
        input_ids = input_ids.to(self.device)
        if n == 1 and self.use_graph:
            return self._decode_step(input_ids)
        positions = torch.arange(self.position, self.position + n, device=self.device).expand(b, n)
        with self.svc.step({sid: n for sid in self.seq_ids}) as step:
            ATTENTION.step = step
            try:
                logits = self.model(input_ids=input_ids, position_ids=positions, use_cache=False,
                                    logits_to_keep=1).logits
            finally:
                ATTENTION.step = None
        self.position += n
        return logits[:, -1]

    def fill_random(self, num_tokens: int, seed: int, piece: int | None = None) -> None:
        """Random KV for the first ``num_tokens`` positions (``--synthetic-prefix``), written by the shards; in fills
        of at most ``piece`` tokens (a service whose windows release pages holds a window, not the whole prefix)."""
        piece = piece or num_tokens
        for start in range(0, num_tokens, piece):
            for i, sid in enumerate(self.seq_ids):
                self.svc.fill_synthetic(sid, min(piece, num_tokens - start), seed=seed + i + 7919 * (start // piece))
        self.position += num_tokens

    def free(self) -> None:
        if self.graph is not None:
            self.graph.close()
        for sid in self.seq_ids:
            self.svc.free(sid)
        self.seq_ids = []


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def generate(lm, prompt: torch.Tensor, chunk_size: int, max_new_tokens: int, progress: bool | Progress = True):
    """Chunked prefill, then greedy decoding (``lm``: CpattnLM or SdpaLM). Returns (new tokens [B, max_new_tokens]
    on the CPU, timings: prefill_s, decode_s and decode_ms, the wall time of each decode step after the first)."""
    bar = progress if isinstance(progress, Progress) else Progress(prompt.shape[1] + max_new_tokens, None, progress)
    device = getattr(lm, "device", torch.device("cpu"))
    t0 = time.perf_counter()
    start = 0
    try:
        for start in range(0, prompt.shape[1], chunk_size):
            chunk = prompt[:, start:start + chunk_size]
            logits = lm.forward(chunk)
            bar.update(chunk.shape[1], "prefill")
    except KeyboardInterrupt:   # stopped at a time limit (scripts/job_gpu.sh): say how far the prefill got
        print(f"stopped during prefill: {start} of {prompt.shape[1]} tokens in {time.perf_counter() - t0:.1f} s",
              file=sys.stderr, flush=True)
        raise
    _sync(device)
    t1 = time.perf_counter()
    tokens, decode_ms = [], []
    for i in range(max_new_tokens):
        next_tokens = logits.argmax(dim=-1, keepdim=True)
        tokens.append(next_tokens)
        bar.update(1, "decode")
        if i + 1 < max_new_tokens:
            t = time.perf_counter()
            logits = lm.forward(next_tokens)
            _sync(device)   # a decode loop reads its token anyway: each step's time is its own
            decode_ms.append(1e3 * (time.perf_counter() - t))
    t2 = time.perf_counter()
    if not isinstance(progress, Progress):
        bar.close()
    new_tokens = torch.cat(tokens, dim=1).cpu() if tokens else prompt[:, :0]
    return new_tokens, {"prefill_s": t1 - t0, "decode_s": t2 - t1, "decode_ms": decode_ms}


@torch.no_grad()
def eager_generate(model, prompt: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """The reference: transformers' own greedy generation with eager attention."""
    model.set_attn_implementation("eager")
    prompt = prompt.to(next(model.parameters()).device)
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_new_tokens,
                         do_sample=False, pad_token_id=0)
    return out[:, prompt.shape[1]:].cpu()


def ask_questions(lm_document: CpattnLM, document: torch.Tensor, questions: torch.Tensor, chunk_size: int,
                  max_new_tokens: int, progress: bool = True):
    """Prefill ``document`` [1, L] once, fork it once per row of ``questions`` [N, Lq], then prefill the questions
    and decode all N in one batch. Returns (new tokens [N, max_new_tokens], timings, stats after forking)."""
    svc = lm_document.svc
    t0 = time.perf_counter()
    for start in range(0, document.shape[1], chunk_size):
        lm_document.forward(document[:, start:start + chunk_size])
    doc_id = lm_document.seq_ids[0]
    forks = [svc.fork(doc_id) for _ in range(questions.shape[0])]
    lm_document.free()   # the forks hold the document's pages: its own sequence is no longer needed
    forked = svc.stats()
    lm = CpattnLM(lm_document.model, svc, 0, seq_ids=forks, position=document.shape[1],
                  decode_graph=lm_document.use_graph)
    t1 = time.perf_counter()
    new_tokens, timings = generate(lm, questions, chunk_size, max_new_tokens, progress)
    stats = svc.stats()
    lm.free()
    timings = dict(timings, prefill_s=timings["prefill_s"] + t1 - t0, document_prefill_s=t1 - t0)
    return new_tokens, timings, forked, stats


def context_tokens(args, prompt_tokens: int) -> int:
    """KV tokens each sequence will hold: the random-KV prefix (``--synthetic-prefix``: its tokens are in the cache,
    not in the prompt tensor), the prompt, a question, the new tokens."""
    return args.synthetic_prefix + prompt_tokens + args.max_new_tokens + (args.question_len if args.questions else 0)


# Tokens a decode run grows ahead of its step (ServiceConfig.decode_run_steps' default): a windowed sequence holds them.
DECODE_RUN_AHEAD = 128


def held_tokens(args, total_tokens: int, layers=None) -> int:
    """The KV tokens a sequence holds at once: all of them, or where every layer has a window (the service gives
    back the pages before it: release_pages_outside_window) its largest window, a step's new tokens (a chunk, a
    question) and a decode run's pages ahead."""
    windows = layers.windows if layers is not None else [None]
    if not windows or any(w is None for w in windows):
        return total_tokens
    step = max(args.chunk_size, args.question_len if args.questions else 0, DECODE_RUN_AHEAD)
    return min(total_tokens, max(windows) + step + args.block_size * args.shards)


def service_config(model_config, args, dtype: str, total_tokens: int, layers=None):
    """The service the job starts, sized for ``total_tokens`` per sequence (context_tokens), with the model's
    per-layer windows and soft caps (``layers``: job_attention.probe_layers; None: full attention, no caps)."""
    import cpattn

    head_size = getattr(model_config, "head_dim", None) or model_config.hidden_size // model_config.num_attention_heads
    held = held_tokens(args, total_tokens, layers)
    tokens_per_shard = math.ceil(held / args.shards)
    blocks = args.batch * (math.ceil(tokens_per_shard / args.block_size) + 2)
    if held < total_tokens:   # every layer windowed: each sequence, the document and its forks alike, holds a window
        blocks = (args.batch + args.questions) * (math.ceil(tokens_per_shard / args.block_size) + 2)
    elif args.questions:
        # One copy of the document, then per question its own tokens and a copy of the page it shares partly.
        own = math.ceil((args.question_len + args.max_new_tokens) / args.shards / args.block_size) + 2
        blocks = math.ceil((total_tokens - args.question_len - args.max_new_tokens) / args.shards / args.block_size)
        blocks += args.questions * own + 2
    # On GPUs: an 8K chunk onto 1M keys takes seconds per step and a remote shard's first kernels JIT-compile
    # while holding its GIL, so the timeouts are those of benchmarks/cp_scaling.py.
    slow = {"rpc_timeout_s": 600, "collective_timeout_s": 600, "shard_hang_timeout_s": 600} if args.device == "cuda" \
        else {}
    return cpattn.ServiceConfig(
        num_shards=args.shards, num_layers=model_config.num_hidden_layers,
        num_q_heads=model_config.num_attention_heads, num_kv_heads=model_config.num_key_value_heads,
        head_size=head_size, block_size=args.block_size, dtype=dtype, backend=args.backend,
        prefill_backend=args.prefill_backend or "same",
        kv_cache_dtype=args.kv_cache_dtype, num_blocks_per_shard=blocks, num_cpus_per_shard=args.cpus_per_shard,
        num_gpus_per_shard=args.gpus_per_shard, device="cuda" if args.device == "cuda" else "auto",
        placement_strategy=args.placement_strategy, pcp_min_tokens=args.pcp_min_tokens,
        max_tokens_per_step=max(16384, args.batch * args.chunk_size), **slow,
        **(layers.service_fields() if layers is not None else {}),
        name=f"cpattn-job-{os.getpid()}", ray_address=args.address or os.environ.get("RAY_ADDRESS") or None)


def service_config_on(model_config, args, dtype: str, total_tokens: int, layers=None):
    """service_config with --device cuda's default prefill backend resolved here (default_prefill_backend):
    (config, why the prefill stays on the decode backend, or "")."""
    cfg = service_config(model_config, args, dtype, total_tokens, layers)
    if args.device != "cuda" or args.prefill_backend is not None:
        return cfg, ""
    name, why_not = default_prefill_backend(cfg)
    return cfg.model_copy(update={"prefill_backend": name}), why_not


def check_geometry(svc_config, model_config, dtype: str, layers=None) -> None:
    """An attached service (--service) serves this model: its shape, dtype, and (``layers``) per-layer windows and
    soft caps."""
    expected = {"num_layers": model_config.num_hidden_layers, "num_q_heads": model_config.num_attention_heads,
                "num_kv_heads": model_config.num_key_value_heads, "dtype": dtype}
    wrong = {k: (getattr(svc_config, k), v) for k, v in expected.items() if getattr(svc_config, k) != v}
    if layers is not None and not wrong:
        for name, have, need in (("sliding_window", svc_config.layer_windows(), layers.windows),
                                 ("logits_soft_cap", svc_config.layer_soft_caps(), layers.soft_caps)):
            if have != need:
                wrong[name] = (one_or_per_layer(have), one_or_per_layer(need))
    if wrong:
        from cpattn.errors import ConfigError

        raise ConfigError("the service does not fit the model: " + ", ".join(
            f"{k} is {have}, the model needs {need}" for k, (have, need) in wrong.items())
            + ": serve one with matching fields (e.g. examples/service_local.yaml for the tiny model)")


def check_gpu_memory(svc_config, model, args) -> None:
    """Before any shard starts: the first shard lands on this process's GPU (job_args.default_gpus_per_shard), so
    its KV must fit in what the model left free. Refuses, saying what to change, instead of a shard dying in its
    constructor."""
    device = next(model.parameters()).device
    if device.type != "cuda":
        return
    from cpattn.errors import ConfigError

    free, _ = torch.cuda.mem_get_info(device)
    problem = kv_fit_problem(svc_config, free, weight_bytes(model))
    if problem:
        raise ConfigError(problem)


def kv_fit_problem(svc_config, free_bytes: int, model_bytes: int) -> str | None:
    """Why one shard's KV cache does not fit in ``free_bytes`` beside the client's chunk (None when it fits).
    An fp8 cache's prefill on FLASH_ATTN reads one layer's pages dequantised: up to the shard's pages of one layer
    in the activation dtype plus their fp8 gather (kvstore.fp8.dequantize_pages), counted here."""
    kv = svc_config.blocks_per_shard() * svc_config.bytes_per_block()
    scratch = 0
    if svc_config.kv_cache_format.startswith("fp8"):
        scratch = kv // svc_config.num_layers * (1 + svc_config.torch_dtype.itemsize)
    if kv + scratch + CLIENT_HEADROOM_BYTES <= free_bytes:
        return None
    dequantised = f" (+{scratch / GIB:.1f} GiB to read one layer's fp8 pages dequantised)" if scratch else ""
    return (f"the KV cache of one shard ({kv / GIB:.1f} GiB, {svc_config.kv_cache_format}){dequantised} does not fit "
            f"beside the model ({model_bytes / GIB:.1f} GiB) on this GPU: {free_bytes / GIB:.1f} GiB are free and the client "
            f"needs ~{CLIENT_HEADROOM_BYTES / GIB:.0f} GiB for a chunk's activations; use --kv-cache-dtype fp8_e4m3 "
            "(half the bytes), more shards on more GPUs (--shards 2 on 2 GPUs), or a shorter --prompt-len")


def default_prefill_backend(svc_config) -> tuple[str, str]:
    """--device cuda without --prefill-backend: (FLASH_ATTN, "") where it serves these settings beside the decode
    backend on this GPU (flash-attn-4 on an H200: causal prefill ~590 TFLOP/s vs TRITON's ~356, while TRITON's
    split-KV decode is ~10x FA4's at 1M), else ("same", why not)."""
    from cpattn.attention import select_backend, select_prefill_backend
    from cpattn.errors import BackendUnavailableError

    try:
        select_prefill_backend(svc_config, select_backend(svc_config), prefill_backend="FLASH_ATTN")
    except BackendUnavailableError as exc:
        first = next((r for reasons in exc.reasons.values() for r in reasons), exc.message)
        return "same", f"FLASH_ATTN cannot: {first}"
    return "FLASH_ATTN", ""


def run_cpattn(args, model, prompt, questions, layers) -> dict:
    """The job on the cpattn service: started here (or attached with --service), prefilled, decoded, stopped.
    ``layers``: the model's attention per layer (job_attention.probe_layers)."""
    import cpattn

    why_not = ""   # why the prefill runs on the decode backend, when the job chose that itself
    if args.service:
        svc = cpattn.connect(name=args.service, namespace=args.namespace, address=args.address)
        check_geometry(svc.config, model.config, args.dtype, layers)
    else:
        cfg, why_not = service_config_on(model.config, args, args.dtype, context_tokens(args, prompt.shape[1]),
                                         layers)
        check_gpu_memory(cfg, model, args)
        svc = cpattn.start(cfg)
    cfg = svc.config
    per_token = cfg.bytes_per_block() // cfg.block_size

    held = held_tokens(args, context_tokens(args, prompt.shape[1]), layers) if not args.service else None

    def kv_per_shard(done: int) -> int:   # estimated locally: stats() would end a decode run
        tokens = done + args.synthetic_prefix
        tokens = min(tokens, held) if held is not None else tokens
        return math.ceil(prompt.shape[0] * tokens / cfg.num_shards) * per_token

    forked = None
    try:
        first = svc.info()["shards"][0]
        backend = "{backend} ({kernel_version}, LSE base {lse_base})".format(**first)
        if first["prefill_backend"] != first["backend"]:
            backend += ", prefill {prefill_backend} ({prefill_kernel_version})".format(**first)
        else:
            backend += f", prefill on it too{f' ({why_not})' if why_not else ''}"
        print(f"cpattn: {cfg.num_shards} shards, {backend}, KV {cfg.kv_cache_format}; prompt {tuple(prompt.shape)}"
              f"{f' after {args.synthetic_prefix} random-KV tokens' if args.synthetic_prefix else ''}, chunks of "
              f"{args.chunk_size}, {args.max_new_tokens} new tokens"
              + (f", {args.questions} questions of {args.question_len} tokens" if args.questions else "")
              + f"; {layers.summary()}", file=sys.stderr, flush=True)
        lm = CpattnLM(model, svc, prompt.shape[0], decode_graph=False if args.decode_graph == "off" else None,
                      sinks=any(layers.sinks))
        if questions is not None:
            new_tokens, timings, forked, stats = ask_questions(lm, prompt, questions, args.chunk_size,
                                                               args.max_new_tokens, not args.no_progress)
        else:
            if args.synthetic_prefix:
                t = time.perf_counter()
                windowed = cfg.row_window() is not None and cfg.release_pages_outside_window
                lm.fill_random(args.synthetic_prefix, args.seed, args.chunk_size if windowed else None)
                print(f"cpattn: random KV of {args.synthetic_prefix} tokens written in {time.perf_counter() - t:.1f}s",
                      file=sys.stderr, flush=True)
            bar = Progress(prompt.shape[1] + args.max_new_tokens, kv_per_shard, not args.no_progress)
            ATTENTION.capture_layer = 0 if args.oracle_check else None
            try:
                new_tokens, timings = generate(lm, prompt, args.chunk_size, args.max_new_tokens, bar)
            except torch.cuda.OutOfMemoryError as exc:   # the client's GPU (model + chunk + the in-process shard)
                print(f"cpattn: out of GPU memory at {lm.position} tokens ({str(exc).splitlines()[0]})")
                return {"status": "oom", "oom_at_tokens": lm.position, "oom": f"OOM at {lm.position} tokens",
                        "backend": backend}
            finally:
                bar.close()
            stats = svc.stats()
            lm.free()
    finally:
        if args.service:
            svc.close()
        else:
            svc.shutdown()
    result = {"tokens": new_tokens.tolist(), "timings": timings, "backend": backend,
              "decode_graph_steps": lm.graph.counts if lm.graph is not None else None,
              "decode_backend": first["backend"], "prefill_backend": first["prefill_backend"],
              "service": {"num_shards": cfg.num_shards, "num_gpus_per_shard": cfg.num_gpus_per_shard,
                          "kv_cache_dtype": cfg.kv_cache_format, "block_size": cfg.block_size,
                          "num_blocks_per_shard": cfg.blocks_per_shard(),
                          "pcp_min_tokens": cfg.pcp_min_tokens},
              "kv_per_shard": [{k: r[k] for k in ("rank", "blocks_used", "tokens", "bytes")} for r in stats["shards"]],
              "kv_gib_per_shard": max(r["bytes"] for r in stats["shards"]) / GIB}
    print(summary_table(stats, timings, prompt.numel() + (0 if questions is None else questions.numel()),
                        new_tokens.numel(), backend))
    if forked is not None:
        used = sum(r["blocks_used"] for r in forked["shards"])
        separate = sum(r["tokens"] for r in forked["shards"]) / cfg.block_size
        print(f"shared document: {args.questions} forks hold {used} KV blocks over the shards "
              f"(separate sequences: about {separate:.0f})")
        result["forked_kv"] = [{k: r[k] for k in ("rank", "blocks_used", "blocks_shared", "tokens")}
                               for r in forked["shards"]]
    return result


def run_sdpa(args, model, prompt) -> dict:
    """The baseline: transformers' SDPA with its DynamicCache on this device; running out of memory is a result
    ("OOM at N tokens"), not a failure."""
    lm = SdpaLM(model, prompt.shape[0])
    per_token = prompt.shape[0] * kv_bytes_per_token(model.config, next(model.parameters()).element_size())
    bar = Progress(prompt.shape[1] + args.max_new_tokens, lambda done: (done + args.synthetic_prefix) * per_token,
                   not args.no_progress)
    print(f"sdpa: one device ({lm.device}), transformers DynamicCache; prompt {tuple(prompt.shape)}, chunks of "
          f"{args.chunk_size}, {args.max_new_tokens} new tokens", file=sys.stderr, flush=True)
    try:
        if args.synthetic_prefix:
            lm.fill_random(args.synthetic_prefix, args.seed)
        new_tokens, timings = generate(lm, prompt, args.chunk_size, args.max_new_tokens, bar)
    except torch.cuda.OutOfMemoryError as exc:
        bar.close()
        at = lm.position
        lm.free()
        torch.cuda.empty_cache()
        print(f"sdpa: out of GPU memory at {at} tokens in the cache ({str(exc).splitlines()[0]})")
        return {"status": "oom", "oom_at_tokens": at, "oom": f"OOM at {at} tokens", "backend": "sdpa"}
    bar.close()
    kv = lm.kv_bytes()
    lm.free()
    print(summary_table(None, timings, prompt.numel(), new_tokens.numel(), "sdpa (transformers DynamicCache)"))
    print(f"KV in the cache: {kv / GIB:.2f} GiB on one device")
    return {"tokens": new_tokens.tolist(), "timings": timings, "backend": "sdpa", "kv_gib_per_shard": kv / GIB}


def parse_args(argv):
    """The job's flags as given (job_args.parser); ``resolve`` fills the per-device defaults and checks them."""
    return parser(__doc__.split("\n\n")[0]).parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = resolve(parse_args(argv))
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    t = time.perf_counter()
    try:
        model = build_model(args.model, args.seed, args.layers, args.dtype, device,
                            attn="sdpa" if args.attn == "sdpa" else "eager")
    except NoSdpaError as exc:
        raise SystemExit(f"--attn sdpa: {exc}: run it on cpattn with --verify (transformers' eager attention is "
                         "then the reference)") from exc
    _sync(device)
    model_s = time.perf_counter() - t
    layers = probe_layers(model) if args.attn == "cpattn" else None   # windows, caps, scales, sinks per layer
    if layers is not None and layers.problems:
        raise SystemExit("cpattn cannot run this model: " + "; ".join(layers.problems))
    if args.oracle_check and args.attn == "cpattn":
        from job_oracle import check_supported_for_oracle

        check_supported_for_oracle(model)
    if args.prompt_file:
        from transformers import AutoTokenizer

        if args.model in BUILT_IN:
            raise SystemExit("--prompt-file needs --model DIR (the tokenizer comes with the weights)")
        tokenizer = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
        with open(args.prompt_file) as f:
            prompt = tokenizer(f.read(), return_tensors="pt").input_ids.expand(args.batch, -1)
    else:
        prompt = make_prompt(model.config.vocab_size, args.prompt_len - args.synthetic_prefix, args.batch, args.seed)
    questions = None
    if args.questions:
        if prompt.shape[0] != 1:
            raise SystemExit("--questions forks one document: use --batch 1")
        questions = make_questions(model.config.vocab_size, args.questions, args.question_len, args.seed)

    try:
        result = (run_sdpa(args, model, prompt) if args.attn == "sdpa"
                  else run_cpattn(args, model, prompt, questions, layers))
    except CpattnError as exc:   # refused (e.g. the KV does not fit): the row's JSON says why, the exit status too
        if args.json_out:
            Path(args.json_out).write_text(json.dumps({"status": "error", "error": str(exc), "config": vars(args)}))
        raise
    result.setdefault("status", "ok")
    if result["status"] == "ok":
        print("generated:", result["tokens"])
        result.update(phase_rates(result["timings"], prompt.numel() + (0 if questions is None else questions.numel())))
    result.update(attn=args.attn, model=describe(model, args.model or "tiny"), model_build_s=model_s,
                  attention=layers.describe() if layers is not None else None,
                  weights_gib=weight_bytes(model) / GIB, peak_gpu_gib=peak_gpu_gib(device),
                  context_tokens=args.prompt_len if not args.prompt_file else prompt.shape[1],
                  synthetic_prefix=args.synthetic_prefix, config=vars(args), environment=environment(device))
    status = 0
    if args.verify:
        full = prompt if questions is None else torch.cat([prompt.expand(questions.shape[0], -1), questions], dim=1)
        reference = eager_generate(model, full, args.max_new_tokens)
        result["eager_tokens"] = reference.tolist()
        same = reference.tolist() == result["tokens"]
        print("verify: identical to eager attention" if same else
              f"verify: MISMATCH vs eager attention: {reference.tolist()}")
        status = 0 if same else 1
    if args.oracle_check and result["status"] == "ok":
        from job_oracle import check_layer0

        q, out = ATTENTION.captured
        history = torch.cat([prompt, torch.tensor(result["tokens"])[:, :-1]], dim=1)   # what the last query saw
        result["oracle"] = check_layer0(model, history, q, out, args.chunk_size, result["service"]["kv_cache_dtype"],
                                        layers)
        verdict = "ok" if result["oracle"]["ok"] else "FAIL"
        print("oracle: layer 0 of the last decode step over {keys} keys, relative error {rel_err:.2e} vs float64 "
              "(bound {bound:g}): {verdict}".format(**result["oracle"], verdict=verdict))
        status = max(status, 0 if result["oracle"]["ok"] else 1)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=1)
    return status


if __name__ == "__main__":
    try:
        sys.exit(main())
    except CpattnError as exc:   # e.g. no room for the shards: one line saying what to change, not a traceback
        sys.exit(f"long_context_job: error: {exc}")
