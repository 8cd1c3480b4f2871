"""What examples/long_context_job.py shows and writes: the progress bar on stderr, the final table, the JSON."""

from __future__ import annotations

import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

GIB = 2**30


class Progress:
    """One bar over prefill and decode tokens on stderr: tokens, tokens/s, KV per shard in GiB and ETA (tqdm's).

    ``kv_per_shard(tokens_done)`` estimates the KV bytes one shard holds (None: not shown): counted locally,
    because asking the service (stats()) would end a decode run. The postfix is refreshed at most twice a second."""

    def __init__(self, total: int, kv_per_shard, enabled: bool = True):
        from tqdm import tqdm

        self.bar = tqdm(total=total, unit="tok", desc="prefill", disable=not enabled, file=sys.stderr,
                        dynamic_ncols=True, smoothing=0.1)
        self.kv_per_shard = kv_per_shard
        self.done = 0
        self.phase = "prefill"
        self.last_postfix = 0.0

    def update(self, tokens: int, phase: str | None = None) -> None:
        self.done += tokens
        if phase and phase != self.phase:   # (a disabled tqdm has no description to compare with)
            self.phase = phase
            self.bar.set_description(phase)
        now = time.perf_counter()
        if self.kv_per_shard is not None and (now - self.last_postfix > 0.5 or self.done >= self.bar.total):
            self.last_postfix = now
            self.bar.set_postfix_str(f"KV/shard {self.kv_per_shard(self.done) / GIB:.2f} GiB", refresh=False)
        self.bar.update(tokens)

    def close(self) -> None:
        self.bar.close()


def decode_stats(decode_ms: list[float]) -> dict:
    """Median and mean ms per decoded token (the first token comes from the prefill's last logits: not timed)."""
    if not decode_ms:
        return {"decode_ms_per_token_median": None, "decode_ms_per_token_mean": None}
    return {"decode_ms_per_token_median": statistics.median(decode_ms),
            "decode_ms_per_token_mean": statistics.fmean(decode_ms)}


def phase_rates(timings: dict, prefill_tokens: int) -> dict:
    s = timings["prefill_s"]
    return {"prefill_s": s, "prefill_tokens": prefill_tokens,
            "prefill_tokens_per_s": prefill_tokens / s if s > 0 else None,
            **decode_stats(timings.get("decode_ms", []))}


def summary_table(stats: dict | None, timings: dict, prompt_tokens: int, new_tokens: int, backend: str) -> str:
    """Phases (tokens, seconds, tokens/s), decode ms per token, and one row per shard (blocks, tokens, KV)."""
    rows = [("prefill", prompt_tokens, timings["prefill_s"]), ("decode", new_tokens, timings["decode_s"])]
    lines = [f"backend {backend}", f"{'phase':<8} {'tokens':>8} {'seconds':>9} {'tokens/s':>10}"]
    for phase, n, s in rows:
        lines.append(f"{phase:<8} {n:>8} {s:>9.3f} {n / s if s > 0 else float('nan'):>10.1f}")
    rates = decode_stats(timings.get("decode_ms", []))
    if rates["decode_ms_per_token_median"] is not None:
        lines.append(f"decode ms/token: median {rates['decode_ms_per_token_median']:.2f}, "
                     f"mean {rates['decode_ms_per_token_mean']:.2f} (per step of the batch)")
    if stats is None:
        return "\n".join(lines)
    lines.append("")
    lines.append(f"{'shard':>5} {'node_ip':<15} {'device':<8} {'blocks':>7} {'tokens':>8} {'KV MiB':>8} {'KV GiB':>7}")
    for row in stats["shards"]:
        lines.append(f"{row['rank']:>5} {str(row['node_ip']):<15} {str(row['device']):<8} {row['blocks_used']:>7} "
                     f"{row['tokens']:>8} {row['bytes'] / 2**20:>8.3f} {row['bytes'] / GIB:>7.2f}")
    return "\n".join(lines)


def environment(device: torch.device) -> dict:
    """Versions and the machine, for the JSON."""
    import ray
    import transformers

    env = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "ray": ray.__version__, "machine": platform.node(), "device": str(device), "git_commit": _git_commit()}
    if device.type == "cuda":
        env.update(gpu=torch.cuda.get_device_name(device), cuda=torch.version.cuda,
                   gpu_memory_gib=torch.cuda.get_device_properties(device).total_memory / GIB,
                   visible_gpus=torch.cuda.device_count())
    return env


def peak_gpu_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None   # a Ray job's working_dir upload has no .git
