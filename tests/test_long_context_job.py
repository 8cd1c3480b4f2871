"""examples/long_context_job.py: a tiny random Llama with its attention on cpattn generates exactly the
tokens of transformers' own eager attention (chunked prefill over many blocks and PCP, then greedy decode)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _env(**extra) -> dict:
    """This checkout importable; no RAY_ADDRESS inherited, so Ray starts where the test says."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return dict(env, PYTHONPATH=str(ROOT), **extra)
JOB = ROOT / "examples" / "long_context_job.py"

pytest.importorskip("transformers")


def _load_job_module():
    spec = importlib.util.spec_from_file_location("long_context_job", JOB)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_job_matches_eager_attention(tmp_path):
    prompt_len, chunk, new, batch, seed = 300, 64, 10, 2, 3
    out = tmp_path / "result.json"
    # A subprocess: the job starts its own embedded Ray, as `python examples/long_context_job.py` does.
    result = subprocess.run(
        [sys.executable, str(JOB), "--prompt-len", str(prompt_len), "--chunk-size", str(chunk), "--max-new-tokens",
         str(new), "--batch", str(batch), "--seed", str(seed), "--shards", "3", "--block-size", "16",
         "--pcp-min-tokens", "48", "--json-out", str(out)],
        capture_output=True, text=True, timeout=150, cwd=ROOT,
        env=_env())
    assert result.returncode == 0, result.stderr[-3000:]
    assert "tokens/s" in result.stdout and "KV MiB" in result.stdout   # the summary table
    job = json.loads(out.read_text())

    # The reference, in this process: the same seeded model and prompt, transformers' eager generate.
    module = _load_job_module()
    model = module.build_model(None, seed=seed, num_layers=2, dtype="float32")
    prompt = module.make_prompt(model.config.vocab_size, prompt_len, batch, seed)
    with torch.no_grad():
        eager = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new, do_sample=False,
                               pad_token_id=0)[:, prompt_len:]
    assert job["tokens"] == eager.tolist()
    assert job["backend"].startswith("TORCH")
    assert job["status"] == "ok" and job["attn"] == "cpattn" and job["prefill_tokens_per_s"] > 0
    assert job["decode_ms_per_token_median"] > 0 and job["service"]["num_shards"] == 3
    # Every token's KV stayed on the service: (300 + 9 decoded) tokens per sequence over 3 shards.
    assert sum(s["tokens"] for s in job["kv_per_shard"]) == batch * (prompt_len + new - 1)


def test_attention_function_rejects_custom_scale():
    module = _load_job_module()

    class Layer:
        layer_idx = 0

    module.ATTENTION.step = object()
    try:
        q = torch.zeros(1, 4, 3, 16)
        with pytest.raises(ValueError, match="scale 0.1 is not head_size"):
            module.ATTENTION(Layer(), q, q[:, :2], q[:, :2], None, scaling=0.1)
    finally:
        module.ATTENTION.step = None


def test_questions_fork_one_document_and_match_eager_attention(tmp_path):
    """--questions: the document is prefilled once and forked (its pages shared, not copied); each fork's
    question and greedy continuation equal eager attention over document + question."""
    prompt_len, chunk, new, questions, question_len, seed = 70, 32, 4, 3, 5, 4
    out = tmp_path / "result.json"
    result = subprocess.run(
        [sys.executable, str(JOB), "--prompt-len", str(prompt_len), "--chunk-size", str(chunk), "--max-new-tokens",
         str(new), "--questions", str(questions), "--question-len", str(question_len), "--seed", str(seed),
         "--shards", "3", "--block-size", "16", "--json-out", str(out), "--no-progress"],
        capture_output=True, text=True, timeout=150, cwd=ROOT, env=_env())
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"shared document: {questions} forks hold" in result.stdout
    job = json.loads(out.read_text())
    module = _load_job_module()
    model = module.build_model(None, seed=seed, num_layers=2, dtype="float32")
    document = module.make_prompt(model.config.vocab_size, prompt_len, 1, seed)
    asked = module.make_questions(model.config.vocab_size, questions, question_len, seed)
    full = torch.cat([document.expand(questions, -1), asked], dim=1)
    with torch.no_grad():
        eager = model.generate(full, attention_mask=torch.ones_like(full), max_new_tokens=new, do_sample=False,
                               pad_token_id=0)[:, full.shape[1]:]
    assert job["tokens"] == eager.tolist()
    # Right after forking, the document's pages are held once: 70 tokens over 3 shards in pages of 16.
    forked = job["forked_kv"]
    assert [s["blocks_used"] for s in forked] == [2, 2, 2]
    assert [s["blocks_shared"] for s in forked] == [2, 2, 2]
    assert sum(s["tokens"] for s in forked) == questions * prompt_len
