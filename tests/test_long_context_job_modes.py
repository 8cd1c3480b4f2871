"""examples/long_context_job.py beyond the CPU default, checked without a GPU: --device cuda refused clearly where
no GPU is visible, the Llama-3-8B shape (built on the meta device: no memory), the --attn sdpa baseline (the same
greedy tokens as transformers' eager generate), the progress bar's KV per shard, and the GPU check's comparison."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from examples_loader import load_example  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def _load(name: str):
    return load_example(name)


def _resolve(argv: list[str]):
    job_args = _load("job_args")
    return job_args.resolve(job_args.parser("test").parse_args(argv))


def test_cuda_without_a_gpu_is_one_line_saying_what_to_change():
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    result = subprocess.run([sys.executable, str(EXAMPLES / "long_context_job.py"), "--device", "cuda"],
                            capture_output=True, text=True, timeout=120, cwd=ROOT,
                            env=dict(env, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
                                     CUDA_VISIBLE_DEVICES=""))
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "long_context_job: error: --device cuda: no CUDA device is visible to this process (torch.cuda.is_available() "
        "is False): run it where a GPU is visible; as a Ray job ask for one with `ray job submit "
        "--entrypoint-num-gpus 0.5 ...` or `cpattn submit --entrypoint-num-gpus 0.5 ...`; or drop --device cuda to "
        "run on the CPU"]


def test_flags_that_cannot_work_are_refused_before_anything_starts(monkeypatch):
    from cpattn.errors import ConfigError

    with pytest.raises(ConfigError, match="--attn sdpa runs the model alone .*: drop --service"):
        _resolve(["--attn", "sdpa", "--service", "cpattn"])
    with pytest.raises(ConfigError, match="--attn sdpa keeps the model's dtype, drop --kv-cache-dtype"):
        _resolve(["--attn", "sdpa", "--kv-cache-dtype", "fp8_e4m3"])
    with pytest.raises(ConfigError, match="--synthetic-prefix 4096 must be between 0 and --prompt-len 2048"):
        _resolve(["--synthetic-prefix", "4096"])
    with pytest.raises(ConfigError, match="--synthetic-prefix writes random KV no model produced: drop --questions"):
        _resolve(["--synthetic-prefix", "1024", "--questions", "2"])
    with pytest.raises(ConfigError, match="--oracle-check checks a decode step of a prefilled prompt on cpattn"):
        _resolve(["--attn", "sdpa", "--oracle-check"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ConfigError, match="use --dtype bfloat16 with --device cuda"):
        _resolve(["--device", "cuda", "--dtype", "float64"])


def test_device_defaults(monkeypatch):
    cpu = _resolve([])
    assert (cpu.model, cpu.dtype, cpu.shards, cpu.gpus_per_shard, cpu.pcp_min_tokens) == (None, "float32", 4, 0.0, 128)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR", raising=False)
    cuda = _resolve(["--device", "cuda"])
    assert (cuda.model, cuda.dtype, cuda.shards, cuda.gpus_per_shard) == ("llama3-8b", "bfloat16", 1, 1.0)
    # In a Ray job's entrypoint holding (half) a GPU, the first shard takes the other half of it.
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert _resolve(["--device", "cuda"]).gpus_per_shard == 0.5


def test_llama3_8b_shape_on_the_meta_device():
    models = _load("job_models")
    model = models.build_model("llama3-8b", seed=0, num_layers=None, dtype="bfloat16", device="meta")
    c = model.config
    assert (c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.hidden_size,
            c.intermediate_size, c.vocab_size) == (32, 32, 8, 128, 4096, 14336, 128256)
    assert models.rope_theta(c) == 500000.0 and c.max_position_embeddings >= 2**20 + 4096
    assert next(model.parameters()).device.type == "meta"
    assert sum(p.numel() for p in model.parameters()) == 8_030_261_248   # Meta-Llama-3-8B's parameter count
    assert models.weight_bytes(model) == 2 * 8_030_261_248
    # 128 KiB of bf16 KV per token: 1M tokens hold 128 GiB, more than one H200 beside the weights.
    assert models.kv_bytes_per_token(c, 2) == 131072


def test_mistral_7b_shape_on_the_meta_device(monkeypatch):
    """--model mistral-7b: Llama-3-8B's layers with a 4,096 window on each (the probe reads it even on the meta
    device), so the job's service windows every layer."""
    models, attention, job = _load("job_models"), _load("job_attention"), _load("long_context_job")
    model = models.build_model("mistral-7b", seed=0, num_layers=None, dtype="bfloat16", device="meta")
    assert type(model).__name__ == "MistralForCausalLM" and next(model.parameters()).device.type == "meta"
    assert sum(p.numel() for p in model.parameters()) == 7_241_732_096   # Mistral-7B-v0.1's parameter count
    layers = attention.probe_layers(model)
    assert layers.windows == [4096] * 32 and layers.soft_caps == [None] * 32 and not any(layers.sinks)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    args = _resolve(["--device", "cuda", "--model", "mistral-7b", "--prompt-len", "1048576", "--shards", "2",
                     "--chunk-size", "8192"])
    cfg = job.service_config(model.config, args, "bfloat16", 1048576, layers)
    assert cfg.sliding_window == 4096 and cfg.layer_windows() == [4096] * 32 and cfg.row_window() == 4096


def test_sdpa_baseline_makes_the_tokens_of_eager_generate(tmp_path):
    """--attn sdpa (chunked prefill into transformers' DynamicCache, greedy decode) on the CPU: the same tokens as
    transformers' own eager generate, which is what the cpattn path's --verify checks too."""
    job = _load("long_context_job")
    prompt_len, chunk, new, batch, seed = 300, 64, 10, 2, 3
    out = tmp_path / "sdpa.json"
    assert job.main(["--attn", "sdpa", "--prompt-len", str(prompt_len), "--chunk-size", str(chunk),
                     "--max-new-tokens", str(new), "--batch", str(batch), "--seed", str(seed), "--json-out", str(out),
                     "--no-progress"]) == 0
    result = json.loads(out.read_text())
    model = job.build_model(None, seed=seed, num_layers=2, dtype="float32")
    prompt = job.make_prompt(model.config.vocab_size, prompt_len, batch, seed)
    assert result["tokens"] == job.eager_generate(model, prompt, new).tolist()
    assert result["status"] == "ok" and result["attn"] == "sdpa" and result["backend"] == "sdpa"
    assert len(result["timings"]["decode_ms"]) == new - 1
    assert result["prefill_tokens"] == batch * prompt_len and result["prefill_tokens_per_s"] > 0
    assert result["decode_ms_per_token_median"] > 0 and result["decode_ms_per_token_mean"] > 0
    # K and V of 2 layers, 2 kv heads of 16 float32, for 309 tokens of 2 rows
    assert result["kv_gib_per_shard"] * 2**30 == 2 * 2 * 2 * 16 * 4 * batch * (prompt_len + new - 1)
    assert result["model"]["name"] == "tiny" and result["environment"]["torch"] == torch.__version__
    assert result["config"]["chunk_size"] == chunk


def test_sdpa_baseline_with_a_random_prefix_decodes_at_its_length(tmp_path):
    job = _load("long_context_job")
    out = tmp_path / "sdpa.json"
    assert job.main(["--attn", "sdpa", "--prompt-len", "200", "--synthetic-prefix", "150", "--chunk-size", "32",
                     "--max-new-tokens", "3", "--json-out", str(out), "--no-progress"]) == 0
    result = json.loads(out.read_text())
    assert result["prefill_tokens"] == 50 and result["synthetic_prefix"] == 150 and result["context_tokens"] == 200
    assert result["kv_gib_per_shard"] * 2**30 == 2 * 2 * 2 * 16 * 4 * (200 + 2)


def test_progress_shows_kv_per_shard(capsys):
    report = _load("job_report")
    bar = report.Progress(100, lambda done: done * 2**30 // 100, enabled=True)
    bar.update(50, "prefill")
    bar.update(50, "decode")
    bar.close()
    err = capsys.readouterr().err
    assert "decode" in err and "KV/shard 1.00 GiB" in err and "100/100" in err


def test_check_comparison_passes_bf16_noise_and_fails_a_wrong_token():
    check = _load("check_job_vs_sdpa")
    gen = torch.Generator().manual_seed(0)
    fp32 = torch.randn(4, 1, 1000, generator=gen) * 3
    sdpa = fp32 + 0.01 * torch.randn(fp32.shape, generator=gen)
    close = fp32 + 0.015 * torch.randn(fp32.shape, generator=gen)
    report = check.compare(close, sdpa, fp32)
    assert report["ok"] and report["greedy_mismatches"] == 0 and report["steps_over_bound"] == 0
    wrong = close.clone()
    wrong[2, 0, 7] = fp32[2, 0].max() + 5.0        # a different greedy token at step 2, far from any tie
    report = check.compare(wrong, sdpa, fp32)
    assert not report["ok"] and report["greedy_mismatches_not_near_tie"] == 1 and report["steps_over_bound"] == 1
    assert not check.compare(close + 1.0 * (torch.arange(1000) == 3), sdpa, None)["ok"]   # fixed bound, no floor


def test_oracle_reference_streams_exact_softmax(monkeypatch):
    oracle = _load("job_oracle")
    monkeypatch.setattr(oracle, "KEY_SLICE", 7)   # many slices: the running max and rescaling are exercised
    gen = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(2, 4, 16, generator=gen), torch.randn(2, 2, 30, 16, generator=gen), \
        torch.randn(2, 2, 30, 16, generator=gen)
    kk, vv = (x.double().repeat_interleave(2, dim=1) for x in (k, v))                  # GQA: 2 q heads per kv head
    p = torch.softmax((q.double().unsqueeze(2) @ kk.transpose(-1, -2)).squeeze(2) * 16 ** -0.5, dim=-1)
    expected = (p.unsqueeze(2) @ vv).squeeze(2)
    assert torch.allclose(oracle.reference_attention(q, k, v), expected, rtol=1e-12, atol=1e-12)


def test_oracle_check_of_layer0_at_full_context(ray_session, tmp_path):
    """--oracle-check: layer 0 of the last decode step, through the service (2 shards, PCP prefill), equals float64
    attention over every key recomputed from the token ids; the JSON says so."""
    job = _load("long_context_job")
    out = tmp_path / "job.json"
    assert job.main(["--prompt-len", "200", "--chunk-size", "64", "--max-new-tokens", "3", "--shards", "2",
                     "--pcp-min-tokens", "48", "--oracle-check", "--json-out", str(out), "--no-progress"]) == 0
    result = json.loads(out.read_text())
    assert result["oracle"]["ok"] and result["oracle"]["keys"] == 202 and result["oracle"]["rel_err"] < 1e-5


def test_rows_table_for_results(tmp_path):
    rows = _load("job_rows")
    ok = {"status": "ok", "attn": "cpattn", "service": {"num_shards": 2, "kv_cache_dtype": "bfloat16"},
          "model": {"dtype": "bfloat16"}, "context_tokens": 1048576, "prefill_tokens": 1048576, "prefill_s": 300.0,
          "prefill_tokens_per_s": 3495.25, "decode_ms_per_token_median": 25.5, "decode_ms_per_token_mean": 26.25,
          "kv_gib_per_shard": 64.0, "oracle": {"rel_err": 0.0031}, "synthetic_prefix": 0,
          "decode_backend": "TRITON", "prefill_backend": "FLASH_ATTN"}
    (tmp_path / "cp2-1m.json").write_text(json.dumps(ok))
    (tmp_path / "sdpa-1m.json").write_text(json.dumps({"status": "oom", "oom": "OOM at 917504 tokens"}))
    assert rows.main([str(tmp_path), str(tmp_path / "all.json"), "cp2-1m", "sdpa-1m", "cp1-1m"]) == 0
    table = (tmp_path / "all.md").read_text().splitlines()
    assert table[2] == ("| cp2-1m | cpattn TRITON, prefill FLASH_ATTN | 2 | bfloat16 | 1,048,576 | 1,048,576 | 300.0 | 3,495 | 25.50 (26.25) | 64.0 "
                        "| 3.1e-03 | ok |")
    assert table[3].endswith("| oom: OOM at 917504 tokens |") and table[4].endswith("| not run: rc= |")
    assert set(json.loads((tmp_path / "all.json").read_text())) == {"cp2-1m", "sdpa-1m", "cp1-1m"}
    # A second call into the same file keeps the first's rows and takes its own anew
    (tmp_path / "cp1-1m.json").write_text(json.dumps(dict(ok, status="ok")))
    assert rows.main([str(tmp_path), str(tmp_path / "all.json"), "cp1-1m"]) == 0
    merged = json.loads((tmp_path / "all.json").read_text())
    assert list(merged) == ["cp2-1m", "sdpa-1m", "cp1-1m"] and merged["cp1-1m"]["status"] == "ok"
    assert len((tmp_path / "all.md").read_text().splitlines()) == 5


def test_the_kv_cache_is_sized_for_the_random_prefix_too(monkeypatch):
    """The cp1fp8-1m-synth row (1M tokens, all but the last 8K random KV, fp8, one GPU) was refused at once: the job
    sized the cache for the prompt tensor (8K) and the new tokens only, 8,288 tokens, not for the random-KV prefix.
    Sized for all 1M, the fp8 cache is 64 GiB and fits one H200 beside the 15 GiB model; bf16 does not."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    job, models, report = _load("long_context_job"), _load("job_models"), _load("job_report")
    model = models.build_model("llama3-8b", seed=0, num_layers=None, dtype="bfloat16", device="meta")
    flags = ["--device", "cuda", "--prompt-len", "1048576", "--synthetic-prefix", "1040384", "--shards", "1",
             "--chunk-size", "8192", "--max-new-tokens", "64"]
    h200_free = int(139.8 * report.GIB) - models.weight_bytes(model)
    for kv_dtype, gib in (("fp8_e4m3", 64), ("auto", 128)):
        args = _resolve(flags + ["--kv-cache-dtype", kv_dtype])
        total = job.context_tokens(args, args.prompt_len - args.synthetic_prefix)   # the prompt tensor's length
        assert total == 1048576 + 64
        cfg = job.service_config(model.config, args, args.dtype, total)
        assert total <= cfg.blocks_per_shard() * cfg.block_size <= total + 3 * cfg.block_size
        kv = cfg.blocks_per_shard() * cfg.bytes_per_block()   # 32 layers x K,V x 8 heads x 128 x 1 or 2 bytes
        assert kv == pytest.approx(gib * report.GIB, rel=1e-3)
        problem = job.kv_fit_problem(cfg, h200_free, models.weight_bytes(model))
        if kv_dtype == "auto":
            assert problem.startswith("the KV cache of one shard (128.0 GiB, bfloat16) does not fit beside the model")
        else:
            assert problem is None


def test_prefill_backend_flag(monkeypatch):
    from cpattn.errors import ConfigError

    job = _load("long_context_job")
    assert _resolve([]).prefill_backend is None   # the service's default (same) on cpu
    with pytest.raises(ConfigError, match="--attn sdpa has none, drop --prefill-backend"):
        _resolve(["--attn", "sdpa", "--prefill-backend", "FLASH_ATTN"])
    with pytest.raises(ConfigError, match="an attached one .--service. keeps its own prefill_backend"):
        _resolve(["--service", "cpattn", "--prefill-backend", "FLASH_ATTN"])
    # --device cuda's default: FLASH_ATTN where it serves beside the decode backend, else the decode backend and why.
    import cpattn

    cfg = cpattn.ServiceConfig(num_layers=2, device="cpu", dtype="float32")
    assert job.default_prefill_backend(cfg) == ("same", "FLASH_ATTN cannot: device cpu not supported (supports cuda)")
