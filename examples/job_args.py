"""Command line of examples/long_context_job.py: its flags, the defaults that differ between --device cpu and
--device cuda, and the checks that refuse a run that cannot work before anything starts."""

from __future__ import annotations

import argparse

# Defaults per device: the CPU values are the tiny model's CI run; the CUDA values run the Llama-3-8B shape, the
# first shard on this process's GPU (computed in-process over CUDA IPC), see default_gpus_per_shard.
DEVICE_DEFAULTS = {
    "cpu": {"model": None, "dtype": "float32", "shards": 4, "cpus_per_shard": 0.5, "gpus_per_shard": 0.0,
            "pcp_min_tokens": 128},
    "cuda": {"model": "llama3-8b", "dtype": "bfloat16", "shards": 1, "cpus_per_shard": 1.0, "gpus_per_shard": None,
             "pcp_min_tokens": 2048},
}


def default_gpus_per_shard() -> float:
    """0.5 in a Ray job's entrypoint that holds a GPU (Ray set its CUDA_VISIBLE_DEVICES; the entrypoint asked for
    half of one, `--entrypoint-num-gpus 0.5`): Ray's fractional GPUs are best-fit, so the first shard takes the
    other half of this GPU and is computed in-process, the next ones whole GPUs of their own. 1 elsewhere (a
    plain process holds no Ray GPU and computes on GPU 0, where Ray puts the first one-GPU shard)."""
    import os

    in_job = "RAY_JOB_CONFIG_JSON_ENV_VAR" in os.environ
    return 0.5 if in_job and os.environ.get("CUDA_VISIBLE_DEVICES") else 1.0


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="where the model runs (cuda: this process's GPU, bf16, the Llama-3-8B shape by default)")
    p.add_argument("--model", default=None, help="tiny (the CPU default), llama3-8b (its shape, random weights on the "
                                                 "GPU: the CUDA default), mistral-7b (its shape: a 4,096 window on "
                                                 "every layer) or a local Hugging Face model directory")
    p.add_argument("--layers", type=int, default=None, help="layers of the model (default: the model's own; tiny: 2)")
    p.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16", "float64"],
                   help="model and KV dtype (default: float32 on cpu, bfloat16 on cuda)")
    p.add_argument("--attn", default="cpattn", choices=["cpattn", "sdpa"],
                   help="sdpa: the baseline, transformers' SDPA attention with its own DynamicCache on one device")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt-len", type=int, default=2048, help="random prompt tokens (ignored with --prompt-file)")
    p.add_argument("--prompt-file", default=None, help="text file to tokenize as the prompt (needs --model DIR)")
    p.add_argument("--synthetic-prefix", type=int, default=0,
                   help="the first N prompt tokens get random KV written without running the model (decode timing "
                        "at long context for a fraction of the prefill's time); prefill then covers the rest")
    p.add_argument("--batch", type=int, default=1, help="prompts decoded together, one cpattn sequence each")
    p.add_argument("--chunk-size", type=int, default=256, help="prefill chunk: tokens per forward / cpattn step")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--service", default=None, help="attach to this running service (`cpattn serve`) "
                                                   "instead of starting one")
    p.add_argument("--namespace", default="cpattn")
    p.add_argument("--address", default=None, help="Ray cluster (default: RAY_ADDRESS, set by Ray Jobs; "
                                                   "else an embedded local Ray)")
    p.add_argument("--shards", type=int, default=None, help="default: 4 on cpu, 1 on cuda")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--backend", default="auto", help="the service's attention backend (decode steps, and prefill "
                                                     "steps unless --prefill-backend names another)")
    p.add_argument("--prefill-backend", default=None,
                   help="backend of the prefill chunks (ServiceConfig.prefill_backend: same, auto or a name); default "
                        "on cuda: FLASH_ATTN where it serves these settings beside --backend on this GPU (flash-attn-4 "
                        "prefills ~1.65x faster than TRITON, whose split-KV decode is ~10x faster at 1M), else same; "
                        "on cpu: same")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"],
                   help="the service's KV cache element type (ServiceConfig.kv_cache_dtype); fp8 halves bf16's KV")
    p.add_argument("--cpus-per-shard", type=float, default=None, help="default: 0.5 on cpu, 1 on cuda")
    p.add_argument("--gpus-per-shard", type=float, default=None,
                   help="default: 0 on cpu; on cuda 0.5 in a Ray job holding half a GPU (--entrypoint-num-gpus "
                        "0.5: the first shard shares its GPU), else 1")
    p.add_argument("--placement-strategy", default="PACK", choices=["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"])
    p.add_argument("--pcp-min-tokens", type=int, default=None,
                   help="prefill chunks this long split across shards (default: 128 on cpu, 2048 on cuda)")
    p.add_argument("--questions", type=int, default=0, help="N > 0: the prompt is a document prefilled once and "
                                                             "forked into N sequences, each with its own question")
    p.add_argument("--question-len", type=int, default=16, help="random tokens of each question (--questions)")
    p.add_argument("--verify", action="store_true", help="also run eager attention and fail unless tokens match")
    p.add_argument("--oracle-check", action="store_true",
                   help="check layer 0's attention of the last decode step against float64 over the whole context "
                        "(its K/V recomputed from the token ids; cheap even at 1M tokens) and fail beyond bf16/fp8 "
                        "error")
    p.add_argument("--json-out", default=None, help="write tokens, timings, config and versions as JSON here")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--decode-graph", default="auto", choices=["auto", "off"],
                   help="auto: on CUDA each decode step replays the model's whole forward as one CUDA graph "
                        "(svc.decode_graph); off: decode steps run eagerly")
    return p


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the per-device defaults and refuse what cannot run, saying what to change (ConfigError)."""
    from cpattn.errors import ConfigError

    for name, value in DEVICE_DEFAULTS[args.device].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.gpus_per_shard is None:
        args.gpus_per_shard = default_gpus_per_shard()
    problems = []
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            problems.append("--device cuda: no CUDA device is visible to this process (torch.cuda.is_available() is "
                            "False): run it where a GPU is visible; as a Ray job ask for one with `ray job submit "
                            "--entrypoint-num-gpus 0.5 ...` or `cpattn submit --entrypoint-num-gpus 0.5 ...`; or "
                            "drop --device cuda to run on the CPU")
        if args.dtype == "float64":
            problems.append("--dtype float64 is a CPU dtype here (the GPU kernels take float16/bfloat16/float32): use "
                            "--dtype bfloat16 with --device cuda")
    if args.attn == "sdpa":
        for flag, value in (("--service", args.service), ("--questions", args.questions), ("--verify", args.verify)):
            if value:
                problems.append(f"--attn sdpa runs the model alone with its own cache (no cpattn service): drop {flag}")
        if args.prefill_backend is not None:
            problems.append("--prefill-backend sets the cpattn service's backend: --attn sdpa has none, drop "
                            "--prefill-backend")
        if args.kv_cache_dtype != "auto":
            problems.append("--kv-cache-dtype sets the cpattn service's cache: --attn sdpa keeps the model's dtype, "
                            "drop --kv-cache-dtype")
    if args.service and args.prefill_backend is not None:
        problems.append("--prefill-backend sets the service the job starts; an attached one (--service) keeps its own "
                        "prefill_backend (`cpattn serve --prefill-backend ...`): drop --prefill-backend")
    if args.synthetic_prefix:
        if not 0 < args.synthetic_prefix < args.prompt_len or args.prompt_file:
            problems.append(f"--synthetic-prefix {args.synthetic_prefix} must be between 0 and --prompt-len "
                            f"{args.prompt_len} (exclusive), with a random prompt (no --prompt-file)")
        if args.questions or args.verify:
            problems.append("--synthetic-prefix writes random KV no model produced: drop --questions and --verify")
    if args.oracle_check and (args.attn != "cpattn" or args.synthetic_prefix or args.questions
                              or args.max_new_tokens < 2):
        problems.append("--oracle-check checks a decode step of a prefilled prompt on cpattn: use --attn cpattn, "
                        "--max-new-tokens 2 or more, and no --synthetic-prefix or --questions")
    if args.chunk_size < 1 or args.max_new_tokens < 0 or args.batch < 1 or args.shards < 1:
        problems.append("--chunk-size, --batch and --shards must be >= 1 and --max-new-tokens >= 0")
    if problems:
        raise ConfigError("; ".join(problems))
    return args
