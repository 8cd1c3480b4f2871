"""Correctness of examples/long_context_job.py on a GPU: the same model (same weights) with its attention on cpattn
and with transformers' SDPA on one device, step by step.

A ~2K prompt is prefilled in chunks and N greedy steps decoded by SDPA with transformers' DynamicCache (bf16);
cpattn then runs the same model teacher-forced on SDPA's tokens, so every step's logits compare like for like,
and a float32 copy of the model with SDPA gives the floor bf16 itself sets. Passing means, at every step:

- cpattn's logits are as close to the float32 model's as SDPA-bf16's are: max |logit - float32 logit| at most
  ``--floor-factor`` (2) times SDPA-bf16's plus ``--abs-tol`` (0.02), both in units of the float32 logits' standard
  deviation. Why this tolerance: bf16 keeps 8 bits of mantissa (relative rounding 2**-8 = 0.4%), every layer rounds
  its attention output and residual stream, and two correct bf16 attentions differ in summation order (tiles,
  splits, shard merges) as much as either differs from float32; so the float32 distance of transformers' own
  bf16 path is the scale to judge by, measured on the same prompt instead of guessed.
- the same greedy token as SDPA-bf16, except where SDPA's top two logits are within twice that allowed error (a
  near tie that bf16 rounding may break either way; counted and reported).
- without the float32 copy (``--no-fp32``, or a float32 run) the bound is |cpattn - SDPA| <= ``--max-rel-diff``
  (0.1) logit std.
- max |softmax(cpattn) - softmax(SDPA)| is reported too (probability mass, scale-free).

    python examples/check_job_vs_sdpa.py --device cuda                       # Llama-3-8B shape, 32 layers, 1 GPU
    python examples/check_job_vs_sdpa.py --device cuda --layers 4 --shards 2   # 2 GPUs, in-process + NCCL
    python examples/check_job_vs_sdpa.py --device cpu --decode-steps 4         # tiny model, CPU (float32)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from job_args import default_gpus_per_shard  # noqa: E402
from job_attention import probe_layers  # noqa: E402
from job_models import NoSdpaError, build_model  # noqa: E402
from job_sdpa import SdpaLM  # noqa: E402
from long_context_job import CpattnLM, make_prompt, service_config_on  # noqa: E402


@torch.no_grad()
def logits_per_step(lm, prompt: torch.Tensor, chunk_size: int, steps: int, forced: torch.Tensor | None = None):
    """Logits [steps, B, V] (float32, CPU) of each decode step: the prefill's last, then after each fed token.
    Feeds ``forced`` [B, steps] tokens (teacher forcing) or, when None, its own greedy ones. Returns (logits,
    fed tokens [B, steps])."""
    for start in range(0, prompt.shape[1], chunk_size):
        logits = lm.forward(prompt[:, start:start + chunk_size])
    out, fed = [], []
    for i in range(steps):
        out.append(logits.float().cpu())
        token = forced[:, i:i + 1] if forced is not None else logits.argmax(-1, keepdim=True).cpu()
        fed.append(token)
        if i + 1 < steps:
            logits = lm.forward(token)
    return torch.stack(out), torch.cat(fed, dim=1)


def compare(cp: torch.Tensor, sdpa: torch.Tensor, fp32: torch.Tensor | None, floor_factor: float = 2.0,
            abs_tol: float = 0.02, max_rel_diff: float = 0.1) -> dict:
    """Per-step agreement of cpattn's logits with SDPA's (and the float32 model's, when given); all [S, B, V].

    The allowed logit error of a step (in units of its logits' std): ``floor_factor`` x SDPA-bf16's distance to
    float32 + ``abs_tol``, or ``max_rel_diff`` of |cpattn - SDPA| without float32. A greedy token may differ from
    SDPA's only where SDPA's top two logits are within twice that error (a near tie either rounding may break)."""
    s, b, _ = cp.shape
    ref = fp32 if fp32 is not None else sdpa
    scale = ref.std(dim=-1)                                            # [S, B] logit scale of each step
    diff_cp_sdpa = (cp - sdpa).abs().amax(-1) / scale                  # [S, B], in logit std units
    report = {"steps": s, "batch": b, "logit_std": scale.mean().item(),
              "max_rel_logit_diff_vs_sdpa": diff_cp_sdpa.amax().item(),
              "max_prob_diff_vs_sdpa": (cp.softmax(-1) - sdpa.softmax(-1)).abs().amax().item(),
              "per_step_rel_diff_vs_sdpa": diff_cp_sdpa.amax(-1).tolist()}
    if fp32 is not None:
        err_cp = (cp - fp32).abs().amax(-1) / scale
        err_sdpa = (sdpa - fp32).abs().amax(-1) / scale
        bound = floor_factor * err_sdpa + abs_tol
        over = err_cp > bound
        report.update(max_rel_err_cpattn_vs_fp32=err_cp.amax().item(), max_rel_err_sdpa_vs_fp32=err_sdpa.amax().item())
    else:   # no float32 floor (a float32 run, or --no-fp32): a fixed bound relative to the logit scale
        bound = torch.full_like(diff_cp_sdpa, max_rel_diff)
        over = diff_cp_sdpa > bound
    top2 = sdpa.topk(2, dim=-1).values
    near_tie = (top2[..., 0] - top2[..., 1]) <= 2 * bound * scale
    same = cp.argmax(-1) == sdpa.argmax(-1)
    report.update(steps_over_bound=int(over.sum()), greedy_mismatches=int((~same).sum()),
                  greedy_mismatches_not_near_tie=int((~same & ~near_tie).sum()))
    report["ok"] = report["steps_over_bound"] == 0 and report["greedy_mismatches_not_near_tie"] == 0
    return report


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    p.add_argument("--model", default=None, help="llama3-8b (cuda default), tiny (cpu default) or a local directory")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--chunk-size", type=int, default=512)
    p.add_argument("--decode-steps", type=int, default=16)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shards", type=int, default=1)
    p.add_argument("--gpus-per-shard", type=float, default=None,
                   help="default: 0 on cpu; on cuda as long_context_job.py (0.5 in a Ray job holding half a GPU, "
                        "else 1)")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--backend", default="auto")
    p.add_argument("--prefill-backend", default=None,
                   help="as long_context_job.py's (default on cuda: FLASH_ATTN where it serves beside --backend, else "
                        "the decode backend)")
    p.add_argument("--no-fp32", action="store_true", help="skip the float32 floor (a fixed bound is used instead)")
    p.add_argument("--floor-factor", type=float, default=2.0)
    p.add_argument("--abs-tol", type=float, default=0.02, help="in units of the logits' standard deviation")
    p.add_argument("--max-rel-diff", type=float, default=0.1,
                   help="without the float32 floor: max |cpattn - SDPA| logit difference in units of the logit std")
    p.add_argument("--json-out", default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    import copy

    import cpattn

    args = parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        from cpattn.errors import ConfigError

        raise ConfigError("--device cuda: no CUDA device is visible to this process: run it on a GPU machine, or "
                          "use --device cpu (the tiny model)")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    args.model = args.model or ("llama3-8b" if cuda else "tiny")
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    gpus = args.gpus_per_shard if args.gpus_per_shard is not None else (default_gpus_per_shard() if cuda else 0.0)
    t0 = time.perf_counter()
    try:
        model, reference_attn = build_model(args.model, args.seed, args.layers, args.dtype, device, attn="sdpa"), "sdpa"
    except NoSdpaError as exc:   # Gemma 2: the reference is transformers' eager attention
        print(f"{exc}: the reference runs transformers' eager attention", flush=True)
        reference_attn = "eager"
        model = build_model(args.model, args.seed, args.layers, args.dtype, device, attn=reference_attn)
    prompt = make_prompt(model.config.vocab_size, args.prompt_len, args.batch, args.seed)

    sdpa_logits, tokens = logits_per_step(SdpaLM(model, args.batch, reference_attn), prompt, args.chunk_size,
                                          args.decode_steps)
    fp32_logits = None
    if not args.no_fp32 and args.dtype != "float32":
        reference = copy.deepcopy(model).float()
        fp32_logits, _ = logits_per_step(SdpaLM(reference, args.batch, reference_attn), prompt, args.chunk_size,
                                         args.decode_steps, forced=tokens)
        del reference
        if cuda:
            torch.cuda.empty_cache()

    job_args = argparse.Namespace(shards=args.shards, batch=args.batch, block_size=16, questions=0, question_len=0,
                                  max_new_tokens=args.decode_steps, backend=args.backend, chunk_size=args.chunk_size,
                                  prefill_backend=args.prefill_backend,
                                  kv_cache_dtype=args.kv_cache_dtype, cpus_per_shard=1.0 if cuda else 0.5,
                                  gpus_per_shard=gpus, placement_strategy="PACK", pcp_min_tokens=256,
                                  device=args.device, address=None)
    layers = probe_layers(model)   # windows, soft caps, scales and sinks of the model's layers
    cfg, _ = service_config_on(model.config, job_args, args.dtype, args.prompt_len + args.decode_steps, layers)
    svc = cpattn.start(cfg)
    try:
        backend = svc.info()["shards"][0]["backend"]
        prefill_backend = svc.info()["shards"][0]["prefill_backend"]
        lm = CpattnLM(model, svc, args.batch, sinks=any(layers.sinks))
        cp_logits, _ = logits_per_step(lm, prompt, args.chunk_size, args.decode_steps, forced=tokens)
        local = sorted(svc.gateway.local)
        wire = svc.gateway.plane.backend if svc.gateway.plane else "none"
        lm.free()
    finally:
        svc.shutdown()
    report = compare(cp_logits, sdpa_logits, fp32_logits, args.floor_factor, args.abs_tol, args.max_rel_diff)
    report.update(model=args.model, layers=model.config.num_hidden_layers, dtype=args.dtype, prompt_len=args.prompt_len,
                  chunk_size=args.chunk_size, shards=args.shards, backend=backend, prefill_backend=prefill_backend,
                  local_shards=local, data_plane=wire, reference_attn=reference_attn,
                  kv_cache_dtype=args.kv_cache_dtype, sdpa_tokens=tokens.tolist(), wall_s=time.perf_counter() - t0)
    print(json.dumps({k: v for k, v in report.items() if k not in ("sdpa_tokens", "per_step_rel_diff_vs_sdpa")}))
    print(f"check: cpattn matches transformers' {reference_attn} within bf16 tolerance" if report["ok"]
          else "check: FAILED (see the numbers above)")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=1))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    from cpattn.errors import CpattnError

    try:
        sys.exit(main())
    except CpattnError as exc:
        sys.exit(f"check_job_vs_sdpa: error: {exc}")
