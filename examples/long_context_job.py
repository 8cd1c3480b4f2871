"""Long-context inference with a Hugging Face Llama-architecture decoder whose attention runs on cpattn.

The model's own projections, RoPE, MLPs and sampling run here; every attention layer runs on a cpattn
service through transformers' attention interface (``AttentionInterface.register("cpattn", ...)``).
The service holds the whole KV cache, sharded over its Ray actors, so the model runs without a
transformers cache: each forward passes only the new tokens, and one cpattn step covers every layer of
that forward (model layer i = cpattn layer i). A long prompt is prefilled in chunks, then greedy decoding.
With ``--questions N`` the prompt is a shared document: prefilled once, forked into N sequences (svc.fork:
they share its KV pages, nothing is copied or prefilled again), each gets its own question, and all N
are decoded in one batch.

    python examples/long_context_job.py                              # tiny random Llama, embedded Ray
    python examples/long_context_job.py --questions 8                # one document, 8 questions, one batch
    python examples/long_context_job.py --model /path/to/llama      # local weights (no downloads)
    ray job submit --working-dir . -- python examples/long_context_job.py
    cpattn submit -- python examples/long_context_job.py --service cpattn   # attach to `cpattn serve`

On the embedded default it produces exactly the tokens of the model's eager attention (--verify checks).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

ATTN_IMPLEMENTATION = "cpattn"


class StepAttention:
    """The attention function transformers calls per layer; it forwards to the open cpattn step.

    transformers passes query [B, Hq, T, D] and key/value [B, Hk, T, D] of the forward's new tokens
    (no transformers cache: cpattn holds the history). Batch row b is cpattn sequence b of the step, so
    the tokens in request order are row-major (b, t). Returns [B, T, Hq, D] as eager attention does.
    """

    def __init__(self):
        self.step = None

    def __call__(self, module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        if self.step is None:
            raise RuntimeError("cpattn attention called outside a cpattn step: run the model through CpattnLM")
        b, hq, t, d = query.shape
        if abs(scaling - d ** -0.5) > 1e-9 * d ** -0.5:
            raise ValueError(f"layer {module.layer_idx}: attention scale {scaling} is not head_size**-0.5; "
                             "cpattn does not support custom scales yet")
        if dropout:
            raise ValueError("cpattn attention is inference-only: put the model in eval() mode (dropout 0)")
        q = query.transpose(1, 2).reshape(b * t, hq, d)
        k = key.transpose(1, 2).reshape(b * t, key.shape[1], d)
        v = value.transpose(1, 2).reshape(b * t, value.shape[1], d)
        out = self.step.attend(module.layer_idx, q.contiguous(), k.contiguous(), v.contiguous())
        return out.view(b, t, hq, d), None


ATTENTION = StepAttention()


def tiny_llama_config(num_layers: int = 2, vocab_size: int = 256, max_positions: int = 32768):
    """A small random Llama: 4 query heads, 2 KV heads (GQA), head size 16; nothing is downloaded."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       max_position_embeddings=max_positions, rope_theta=10000.0, tie_word_embeddings=False)


def build_model(model_path: str | None = None, seed: int = 0, num_layers: int = 2, dtype: str = "float32"):
    """The eager-attention model: random tiny Llama from ``seed``, or local weights from ``model_path``."""
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    torch_dtype = getattr(torch, dtype)
    if model_path:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype, attn_implementation="eager",
                                                     local_files_only=True)
    else:
        torch.manual_seed(seed)
        model = LlamaForCausalLM._from_config(tiny_llama_config(num_layers), attn_implementation="eager",
                                              dtype=torch_dtype)
    return model.eval()


def make_prompt(vocab_size: int, length: int, batch: int, seed: int) -> torch.Tensor:
    """Random token ids [batch, length] (a fixed seed, so a reference run sees the same prompt)."""
    gen = torch.Generator().manual_seed(seed + 1)
    return torch.randint(0, vocab_size, (batch, length), generator=gen)


def make_questions(vocab_size: int, num_questions: int, length: int, seed: int) -> torch.Tensor:
    """Random token ids [num_questions, length]: one question per fork of the document."""
    gen = torch.Generator().manual_seed(seed + 2)
    return torch.randint(0, vocab_size, (num_questions, length), generator=gen)


def check_supported(model_config) -> list[str]:
    """What cpattn cannot run for this model (empty when it can)."""
    reasons = []
    if getattr(model_config, "sliding_window", None):
        reasons.append(f"sliding_window={model_config.sliding_window}: cpattn attends to the whole history")
    for name in ("attn_logit_softcapping", "query_pre_attn_scalar"):
        if getattr(model_config, name, None):
            reasons.append(f"{name}={getattr(model_config, name)}: custom softcap/scale are not supported yet")
    return reasons


class CpattnLM:
    """Runs a transformers causal LM with its attention on a cpattn service; one step per forward."""

    def __init__(self, model, service, batch: int, seq_ids: list[str] | None = None, position: int = 0):
        """``batch`` new sequences, or ``seq_ids`` that already hold ``position`` tokens each (forks)."""
        from transformers import AttentionInterface

        AttentionInterface.register(ATTN_IMPLEMENTATION, ATTENTION)
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        self.model = model
        self.svc = service
        self.seq_ids = seq_ids if seq_ids is not None else [service.add_sequence() for _ in range(batch)]
        self.position = position

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits of the last new token per row, [B, vocab]; the tokens' KV joins the service's cache."""
        n = input_ids.shape[1]
        positions = torch.arange(self.position, self.position + n).expand(input_ids.shape[0], n)
        with self.svc.step({sid: n for sid in self.seq_ids}) as step:
            ATTENTION.step = step
            try:
                logits = self.model(input_ids=input_ids, position_ids=positions, use_cache=False,
                                    logits_to_keep=1).logits
            finally:
                ATTENTION.step = None
        self.position += n
        return logits[:, -1]

    def free(self) -> None:
        for sid in self.seq_ids:
            self.svc.free(sid)
        self.seq_ids = []


def generate(lm: CpattnLM, prompt: torch.Tensor, chunk_size: int, max_new_tokens: int, progress: bool = True):
    """Chunked prefill, then greedy decoding. Returns (new tokens [B, max_new_tokens], timings)."""
    from tqdm import tqdm

    bar = tqdm(total=prompt.shape[1] + max_new_tokens, unit="tok", desc="prefill", disable=not progress,
               file=sys.stderr)
    t0 = time.perf_counter()
    for start in range(0, prompt.shape[1], chunk_size):
        chunk = prompt[:, start:start + chunk_size]
        logits = lm.forward(chunk)
        bar.update(chunk.shape[1])
    t1 = time.perf_counter()
    bar.set_description("decode")
    tokens = []
    for i in range(max_new_tokens):
        next_tokens = logits.argmax(dim=-1, keepdim=True)
        tokens.append(next_tokens)
        bar.update(1)
        if i + 1 < max_new_tokens:
            logits = lm.forward(next_tokens)
    t2 = time.perf_counter()
    bar.close()
    new_tokens = torch.cat(tokens, dim=1) if tokens else prompt[:, :0]
    return new_tokens, {"prefill_s": t1 - t0, "decode_s": t2 - t1}


@torch.no_grad()
def eager_generate(model, prompt: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """The reference: transformers' own greedy generation with eager attention."""
    model.set_attn_implementation("eager")
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_new_tokens,
                         do_sample=False, pad_token_id=0)
    return out[:, prompt.shape[1]:]


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
    lm = CpattnLM(lm_document.model, svc, 0, seq_ids=forks, position=document.shape[1])
    t1 = time.perf_counter()
    new_tokens, timings = generate(lm, questions, chunk_size, max_new_tokens, progress)
    stats = svc.stats()
    lm.free()
    timings = dict(timings, prefill_s=timings["prefill_s"] + t1 - t0, document_prefill_s=t1 - t0)
    return new_tokens, timings, forked, stats


def service_config(model_config, args, dtype: str, total_tokens: int):
    import cpattn

    head_size = getattr(model_config, "head_dim", None) or model_config.hidden_size // model_config.num_attention_heads
    tokens_per_shard = math.ceil(total_tokens / args.shards)
    blocks = args.batch * (math.ceil(tokens_per_shard / args.block_size) + 2)
    if args.questions:
        # One copy of the document, then per question its own tokens and a copy of the page it shares partly.
        own = math.ceil((args.question_len + args.max_new_tokens) / args.shards / args.block_size) + 2
        blocks = math.ceil((total_tokens - args.question_len - args.max_new_tokens) / args.shards / args.block_size)
        blocks += args.questions * own + 2
    return cpattn.ServiceConfig(
        num_shards=args.shards, num_layers=model_config.num_hidden_layers,
        num_q_heads=model_config.num_attention_heads, num_kv_heads=model_config.num_key_value_heads,
        head_size=head_size, block_size=args.block_size, dtype=dtype, backend=args.backend,
        num_blocks_per_shard=blocks, num_cpus_per_shard=args.cpus_per_shard, num_gpus_per_shard=args.gpus_per_shard,
        placement_strategy=args.placement_strategy, pcp_min_tokens=args.pcp_min_tokens,
        name=f"cpattn-job-{os.getpid()}", ray_address=args.address or os.environ.get("RAY_ADDRESS") or None)


def check_geometry(svc_config, model_config, dtype: str) -> None:
    expected = {"num_layers": model_config.num_hidden_layers, "num_q_heads": model_config.num_attention_heads,
                "num_kv_heads": model_config.num_key_value_heads, "dtype": dtype}
    wrong = {k: (getattr(svc_config, k), v) for k, v in expected.items() if getattr(svc_config, k) != v}
    if wrong:
        from cpattn.errors import ConfigError

        raise ConfigError("the service does not fit the model: " + ", ".join(
            f"{k} is {have}, the model needs {need}" for k, (have, need) in wrong.items())
            + ": serve one with matching fields (e.g. examples/service_local.yaml for the tiny model)")


def summary_table(stats: dict, timings: dict, prompt_tokens: int, new_tokens: int, backend: str) -> str:
    rows = [("prefill", prompt_tokens, timings["prefill_s"]), ("decode", new_tokens, timings["decode_s"])]
    lines = [f"backend {backend}", f"{'phase':<8} {'tokens':>8} {'seconds':>9} {'tokens/s':>10}"]
    for phase, n, s in rows:
        lines.append(f"{phase:<8} {n:>8} {s:>9.3f} {n / s if s > 0 else float('nan'):>10.1f}")
    lines.append("")
    lines.append(f"{'shard':>5} {'node_ip':<15} {'device':<8} {'blocks':>7} {'tokens':>8} {'KV MiB':>8}")
    for row in stats["shards"]:
        lines.append(f"{row['rank']:>5} {str(row['node_ip']):<15} {str(row['device']):<8} {row['blocks_used']:>7} "
                     f"{row['tokens']:>8} {row['bytes'] / 2**20:>8.3f}")
    return "\n".join(lines)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=None, help="local Hugging Face model directory (default: tiny random Llama)")
    p.add_argument("--layers", type=int, default=2, help="layers of the tiny random model")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16", "float64"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt-len", type=int, default=2048, help="random prompt tokens (ignored with --prompt-file)")
    p.add_argument("--prompt-file", default=None, help="text file to tokenize as the prompt (needs --model)")
    p.add_argument("--batch", type=int, default=1, help="prompts decoded together, one cpattn sequence each")
    p.add_argument("--chunk-size", type=int, default=256, help="prefill chunk: tokens per forward / cpattn step")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--service", default=None, help="attach to this running service (`cpattn serve`) "
                                                   "instead of starting one")
    p.add_argument("--namespace", default="cpattn")
    p.add_argument("--address", default=None, help="Ray cluster (default: RAY_ADDRESS, set by Ray Jobs; "
                                                   "else an embedded local Ray)")
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--backend", default="auto")
    p.add_argument("--cpus-per-shard", type=float, default=0.5)
    p.add_argument("--gpus-per-shard", type=float, default=0.0)
    p.add_argument("--placement-strategy", default="PACK", choices=["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"])
    p.add_argument("--pcp-min-tokens", type=int, default=128, help="prefill chunks this long split across shards")
    p.add_argument("--questions", type=int, default=0, help="N > 0: the prompt is a document prefilled once and "
                                                             "forked into N sequences, each with its own question")
    p.add_argument("--question-len", type=int, default=16, help="random tokens of each question (--questions)")
    p.add_argument("--verify", action="store_true", help="also run eager attention and fail unless tokens match")
    p.add_argument("--json-out", default=None, help="write tokens and timings as JSON here")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import cpattn

    model = build_model(args.model, args.seed, args.layers, args.dtype)
    reasons = check_supported(model.config)
    if reasons:
        raise SystemExit("cpattn cannot run this model: " + "; ".join(reasons))
    if args.prompt_file:
        from transformers import AutoTokenizer

        if not args.model:
            raise SystemExit("--prompt-file needs --model (the tokenizer comes with the weights)")
        tokenizer = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
        with open(args.prompt_file) as f:
            prompt = tokenizer(f.read(), return_tensors="pt").input_ids.expand(args.batch, -1)
    else:
        prompt = make_prompt(model.config.vocab_size, args.prompt_len, args.batch, args.seed)
    questions = None
    if args.questions:
        if prompt.shape[0] != 1:
            raise SystemExit("--questions forks one document: use --batch 1")
        questions = make_questions(model.config.vocab_size, args.questions, args.question_len, args.seed)

    if args.service:
        svc = cpattn.connect(name=args.service, namespace=args.namespace, address=args.address)
        check_geometry(svc.config, model.config, args.dtype)
    else:
        total = prompt.shape[1] + args.max_new_tokens + (args.question_len if args.questions else 0)
        svc = cpattn.start(service_config(model.config, args, args.dtype, total))
    forked = None
    try:
        backend = "{backend} ({kernel_version}, LSE base {lse_base})".format(**svc.info()["shards"][0])
        print(f"cpattn: {svc.config.num_shards} shards, {backend}; prompt {tuple(prompt.shape)}, "
              f"chunks of {args.chunk_size}, {args.max_new_tokens} new tokens"
              + (f", {args.questions} questions of {args.question_len} tokens" if args.questions else ""),
              file=sys.stderr, flush=True)
        lm = CpattnLM(model, svc, prompt.shape[0])
        if questions is not None:
            new_tokens, timings, forked, stats = ask_questions(lm, prompt, questions, args.chunk_size,
                                                               args.max_new_tokens, not args.no_progress)
        else:
            new_tokens, timings = generate(lm, prompt, args.chunk_size, args.max_new_tokens, not args.no_progress)
            stats = svc.stats()
            lm.free()
    finally:
        if args.service:
            svc.close()
        else:
            svc.shutdown()
    prefilled = prompt.numel() + (0 if questions is None else questions.numel())
    print(summary_table(stats, timings, prefilled, new_tokens.numel(), backend))
    print("generated:", new_tokens.tolist())
    result = {"tokens": new_tokens.tolist(), "timings": timings, "backend": backend,
              "kv_per_shard": [{k: r[k] for k in ("rank", "blocks_used", "tokens", "bytes")} for r in stats["shards"]]}
    if forked is not None:
        used = sum(r["blocks_used"] for r in forked["shards"])
        separate = sum(r["tokens"] for r in forked["shards"]) / svc.config.block_size
        print(f"shared document: {args.questions} forks hold {used} KV blocks over the shards "
              f"(separate sequences: about {separate:.0f})")
        result["forked_kv"] = [{k: r[k] for k in ("rank", "blocks_used", "blocks_shared", "tokens")}
                               for r in forked["shards"]]
    status = 0
    if args.verify:
        full = prompt if questions is None else torch.cat([prompt.expand(questions.shape[0], -1), questions], dim=1)
        reference = eager_generate(model, full, args.max_new_tokens)
        result["eager_tokens"] = reference.tolist()
        same = torch.equal(reference, new_tokens)
        print("verify: identical to eager attention" if same else
              f"verify: MISMATCH vs eager attention: {reference.tolist()}")
        status = 0 if same else 1
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f)
    return status


if __name__ == "__main__":
    from cpattn.errors import CpattnError

    try:
        sys.exit(main())
    except CpattnError as exc:   # e.g. no room for the shards: one line saying what to change, not a traceback
        sys.exit(f"long_context_job: error: {exc}")
