"""examples/long_context_job.py: a tiny random Llama with its attention on cpattn generates exactly the
tokens of transformers' own eager attention (chunked prefill over many blocks and PCP, then greedy decode)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

import background_fixtures

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


# The two runs below, as `python examples/long_context_job.py ...` (each starts its own embedded Ray).
PLAIN = dict(prompt_len=300, chunk=64, new=10, batch=2, seed=3)
QUESTIONS = dict(prompt_len=70, chunk=32, new=4, questions=3, question_len=5, seed=4)


JOB_TIMEOUT_S = 240   # two at once: 150 s each when they ran one at a time


def _run_jobs(background) -> dict:
    """Both runs started at once, side by side (each is mostly its imports and its Ray's start, which leave the
    second core idle), and waited for; tests/background_fixtures.py may run this at the session's start, beside
    other tests. {"dir": their files, "returncode": {name: exit status, or None when it did not end in time}}."""
    out = Path(tempfile.mkdtemp(prefix="cpattn-jobs-"))
    argv = {
        "plain": ["--prompt-len", str(PLAIN["prompt_len"]), "--chunk-size", str(PLAIN["chunk"]), "--max-new-tokens",
                  str(PLAIN["new"]), "--batch", str(PLAIN["batch"]), "--seed", str(PLAIN["seed"]), "--shards", "3",
                  "--block-size", "16", "--pcp-min-tokens", "48"],
        "questions": ["--prompt-len", str(QUESTIONS["prompt_len"]), "--chunk-size", str(QUESTIONS["chunk"]),
                      "--max-new-tokens", str(QUESTIONS["new"]), "--questions", str(QUESTIONS["questions"]),
                      "--question-len", str(QUESTIONS["question_len"]), "--seed", str(QUESTIONS["seed"]),
                      "--shards", "3", "--block-size", "16", "--no-progress"],
    }
    procs = {}
    try:
        for name, args in argv.items():   # output to files: a pipe nobody reads yet could fill and stall a job
            with open(out / f"{name}.out", "w") as stdout, open(out / f"{name}.err", "w") as stderr:
                procs[name] = subprocess.Popen([sys.executable, str(JOB), *args, "--json-out", str(out / f"{name}.json")],
                                               stdout=stdout, stderr=stderr, cwd=ROOT, env=_env())
        returncode = {}
        for name, proc in procs.items():
            deadline = time.monotonic() + JOB_TIMEOUT_S
            while proc.poll() is None and time.monotonic() < deadline and not background.aborted.is_set():
                time.sleep(0.1)
            returncode[name] = proc.poll()
        return {"dir": out, "returncode": returncode}
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()


background_fixtures.register(__file__, _run_jobs, time_bounds=False)


@pytest.fixture(scope="module")
def jobs():
    with background_fixtures.result_in_dir(__file__) as finished:
        yield finished


def _finished(jobs, name: str):
    """(stdout, the JSON the job wrote) once it exited 0."""
    code, out = jobs["returncode"][name], jobs["dir"] / name
    if code is None:
        pytest.fail(f"the {name} job did not finish within {JOB_TIMEOUT_S} s")
    assert code == 0, out.with_suffix(".err").read_text()[-3000:]
    return out.with_suffix(".out").read_text(), json.loads(out.with_suffix(".json").read_text())


def test_job_matches_eager_attention(jobs):
    prompt_len, new, batch, seed = PLAIN["prompt_len"], PLAIN["new"], PLAIN["batch"], PLAIN["seed"]
    stdout, job = _finished(jobs, "plain")
    assert "tokens/s" in stdout and "KV MiB" in stdout   # the summary table

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


def test_questions_fork_one_document_and_match_eager_attention(jobs):
    """--questions: the document is prefilled once and forked (its pages shared, not copied); each fork's
    question and greedy continuation equal eager attention over document + question."""
    prompt_len, new, questions, question_len, seed = (QUESTIONS[k] for k in ("prompt_len", "new", "questions",
                                                                               "question_len", "seed"))
    stdout, job = _finished(jobs, "questions")
    assert f"shared document: {questions} forks hold" in stdout
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
