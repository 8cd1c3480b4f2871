"""examples/long_context_job.py on a GPU: the Llama-3-8B shape (fewer layers, so it takes well under two
minutes) with its attention on cpattn shards matches transformers' SDPA step by step within bf16's own error
(examples/check_job_vs_sdpa.py says why that tolerance), on one GPU (the shard computed in-process) and on two
(one in-process, one over NCCL); and the job itself runs on CUDA with chunked prefill and a JSON report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("transformers")

from examples_loader import load_example  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def _load(name: str):
    return load_example(name)


@pytest.mark.parametrize("shards", [1, 2])
def test_cpattn_matches_sdpa_on_gpu(ray_session, tmp_path, shards):
    if shards > torch.cuda.device_count():
        pytest.skip(f"needs {shards} GPUs")
    check = _load("check_job_vs_sdpa")
    out = tmp_path / "check.json"
    status = check.main(["--device", "cuda", "--layers", "4", "--prompt-len", "2048", "--chunk-size", "1024",
                         "--decode-steps", "8", "--shards", str(shards), "--json-out", str(out)])
    report = json.loads(out.read_text())
    assert status == 0, report
    assert report["ok"] and report["greedy_mismatches_not_near_tie"] == 0
    assert report["steps_over_bound"] == 0
    assert 0 in report["local_shards"]                      # the shard on this GPU computed in-process
    # The prefill chunks on FLASH_ATTN where flash-attn serves here (the job's default on cuda), else on the backend.
    assert report["prefill_backend"] == ("FLASH_ATTN" if _flash_attn_serves() else report["backend"])
    assert report["data_plane"] == ("none" if shards == 1 else "nccl")


def _flash_attn_serves() -> bool:
    from cpattn.attention import get_attn_backend
    from cpattn.errors import BackendUnavailableError

    try:
        get_attn_backend("FLASH_ATTN", head_size=128, dtype=torch.bfloat16, block_size=16, num_q_heads=32,
                         num_kv_heads=8, device="cuda")
    except BackendUnavailableError:
        return False
    return True


def test_job_runs_on_cuda_with_json(tmp_path):
    """The job as a user runs it: a subprocess with its own embedded Ray, 2 layers of the Llama-3-8B shape,
    an 8K prompt in 2K chunks, 8 new tokens; the JSON has the table's numbers, and layer 0's last decode step
    matches float64 attention over the whole context (--oracle-check)."""
    out = tmp_path / "job.json"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "long_context_job.py"), "--device", "cuda", "--layers", "2",
         "--prompt-len", "8192", "--chunk-size", "2048", "--max-new-tokens", "8", "--json-out", str(out),
         "--oracle-check", "--no-progress"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
        env=dict(env, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))))   # + staged
    assert result.returncode == 0, result.stderr[-3000:]
    job = json.loads(out.read_text())
    assert job["status"] == "ok" and len(job["tokens"][0]) == 8
    assert job["model"]["hidden"] == 4096 and job["model"]["kv_heads"] == 8 and job["model"]["dtype"] == "bfloat16"
    assert job["prefill_tokens_per_s"] > 0 and job["decode_ms_per_token_median"] > 0
    assert sum(s["tokens"] for s in job["kv_per_shard"]) == 8192 + 7
    assert job["environment"]["gpu"]
    assert job["decode_backend"] == "TRITON" and job["prefill_backend"] == ("FLASH_ATTN" if _flash_attn_serves()
                                                                            else "TRITON")
    assert job["oracle"]["ok"] and job["oracle"]["keys"] == 8192 + 7   # layer 0 vs float64 over every key


def _save_windowed_model(kind: str, path: Path) -> None:
    """A small model of ``kind`` at GPU head size (128) saved as local weights: Mistral (a 256-token window on every
    layer), Gemma 2 (windows on every other layer, soft caps, query_pre_attn_scalar 144), gpt-oss (windows, sinks)."""
    import transformers as tf

    common = dict(vocab_size=4096, hidden_size=1024, intermediate_size=2048, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=128, max_position_embeddings=8192)
    if kind == "mistral":
        config, cls = tf.MistralConfig(sliding_window=256, **common), tf.MistralForCausalLM
    elif kind == "gemma2":
        config, cls = tf.Gemma2Config(sliding_window=256, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                                      query_pre_attn_scalar=144, **common), tf.Gemma2ForCausalLM
    else:
        config, cls = tf.GptOssConfig(sliding_window=256, num_local_experts=4, num_experts_per_tok=2,
                                      **common), tf.GptOssForCausalLM
    torch.manual_seed(0)
    cls(config).eval().save_pretrained(path)


@pytest.mark.parametrize("kind", ["mistral", "gemma2", "gpt_oss"])
@pytest.mark.parametrize("shards", [1, 2])
def test_windowed_models_match_transformers_on_gpu(ray_session, tmp_path, kind, shards):
    """--model DIR with windows, soft caps, a scale of its own and sinks, through the job's service on the GPU
    (TRITON decode, the prefill backend the job picks), step by step against transformers' own attention (SDPA for
    Mistral; eager for Gemma 2 and gpt-oss, which have no SDPA) within bf16's own error."""
    if shards > torch.cuda.device_count():
        pytest.skip(f"needs {shards} GPUs")
    _save_windowed_model(kind, tmp_path / kind)
    check = _load("check_job_vs_sdpa")
    out = tmp_path / "check.json"
    status = check.main(["--device", "cuda", "--model", str(tmp_path / kind), "--prompt-len", "2048",
                         "--chunk-size", "512", "--decode-steps", "8", "--shards", str(shards), "--json-out", str(out)])
    report = json.loads(out.read_text())
    assert status == 0, report
    assert report["ok"] and report["steps_over_bound"] == 0 and report["greedy_mismatches_not_near_tie"] == 0
    assert report["reference_attn"] == ("sdpa" if kind == "mistral" else "eager")
