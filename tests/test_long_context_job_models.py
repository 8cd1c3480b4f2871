"""examples/long_context_job.py with models other than a plain Llama, loaded from a local directory (``--model
DIR``): Mistral (a window on every layer), Gemma 2 (every other layer windowed, soft caps, its own softmax scale),
Gemma 3 (q/k norms, a RoPE base per layer type), Qwen2/Qwen3 (windows above max_window_layers) and gpt-oss
(windows and sinks). Tiny random models are saved and loaded
as a user's weights would be; the job reads each layer's attention from the model and its service serves the same.
Checked against transformers' eager attention on the full sequence, logit by logit (float32), with a control that
shows the comparison would see a window ignored."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from examples_loader import load_example  # noqa: E402

VOCAB = 256
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, max_position_embeddings=4096)


def _config(kind: str):
    import transformers as tf

    if kind == "mistral":
        return tf.MistralConfig(num_hidden_layers=2, sliding_window=24, **COMMON), tf.MistralForCausalLM
    if kind == "gemma2":   # query_pre_attn_scalar 24 with head_dim 16: a scale other than head_dim ** -0.5
        return tf.Gemma2Config(num_hidden_layers=4, sliding_window=20, attn_logit_softcapping=5.0,
                               final_logit_softcapping=30.0, query_pre_attn_scalar=24, **COMMON), tf.Gemma2ForCausalLM
    if kind == "gemma3":   # q/k norms, a RoPE base per layer type, windows on 5 of every 6 layers
        return tf.Gemma3TextConfig(num_hidden_layers=3, sliding_window=20, query_pre_attn_scalar=24,
                                   **COMMON), tf.Gemma3ForCausalLM
    if kind == "qwen3":
        return tf.Qwen3Config(num_hidden_layers=3, use_sliding_window=True, sliding_window=20, max_window_layers=1,
                              **COMMON), tf.Qwen3ForCausalLM
    if kind == "qwen2":
        return tf.Qwen2Config(num_hidden_layers=3, use_sliding_window=True, sliding_window=20, max_window_layers=1,
                              **COMMON), tf.Qwen2ForCausalLM
    if kind == "gpt_oss":
        return tf.GptOssConfig(num_hidden_layers=2, sliding_window=20, num_local_experts=4, num_experts_per_tok=2,
                               **COMMON), tf.GptOssForCausalLM
    raise KeyError(kind)


# What each layer asks of its attention function: (windows, soft caps, scale, sinks).
EXPECTED = {
    "mistral": ([24, 24], [None, None], 16 ** -0.5, [False, False]),
    "gemma2": ([20, None, 20, None], [5.0] * 4, 24 ** -0.5, [False] * 4),
    "gemma3": ([20, 20, 20], [None] * 3, 24 ** -0.5, [False] * 3),
    "qwen2": ([None, 20, 20], [None] * 3, 16 ** -0.5, [False] * 3),
    "qwen3": ([None, 20, 20], [None] * 3, 16 ** -0.5, [False] * 3),
    "gpt_oss": ([20, None], [None, None], 16 ** -0.5, [True, True]),
}


def _save_tokenizer(path) -> None:
    """A word-level tokenizer over the model's vocabulary (w0 .. w254, [UNK]), saved beside the weights."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(VOCAB - 1)} | {"[UNK]": VOCAB - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(path)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """Each kind's random model saved as local weights (save_pretrained), seeded; gemma2 with a tokenizer."""
    root = tmp_path_factory.mktemp("models")
    dirs = {}
    for i, kind in enumerate(EXPECTED):
        config, cls = _config(kind)
        torch.manual_seed(10 + i)
        cls(config).eval().save_pretrained(root / kind)
        dirs[kind] = root / kind
    _save_tokenizer(dirs["gemma2"])
    return dirs


def _build(dirs, kind):
    return load_example("job_models").build_model(str(dirs[kind]), num_layers=None, dtype="float32")


@pytest.mark.parametrize("kind", list(EXPECTED))
def test_probe_reads_each_layers_window_cap_scale_and_sinks(model_dirs, kind):
    layers = load_example("job_attention").probe_layers(_build(model_dirs, kind))
    windows, caps, scale, sinks = EXPECTED[kind]
    assert layers.windows == windows and layers.soft_caps == caps and layers.sinks == sinks and not layers.problems
    assert layers.scales == pytest.approx([scale] * len(windows), rel=1e-12)
    fields = layers.service_fields()   # one value where every layer has it, else per layer
    assert fields["sliding_window"] == (windows[0] if len(set(windows)) == 1 else windows)


def _eager_logits(model, ids: torch.Tensor) -> torch.Tensor:
    model.set_attn_implementation("eager")
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


# Every pattern once (CI's minutes): windows on all layers (mistral; gemma3 and qwen2/3 differ only in what the probe
# reads), on some with caps and a scale of its own (gemma2), with sinks (gpt_oss).
@pytest.mark.parametrize("kind", ["mistral", "gemma2", "gpt_oss"])
def test_logits_match_eager_attention_over_shards(ray_session, model_dirs, kind):
    """Prefill in chunks (two of them split across 3 shards by PCP), then decode steps: every step's last logits
    equal the eager model's over the whole sequence. The prompt is 5x the window, so windows decide the result;
    the same model with its windows removed is far off (the comparison sees a window ignored)."""
    import cpattn

    job, attention = load_example("long_context_job"), load_example("job_attention")
    model = _build(model_dirs, kind)
    layers = attention.probe_layers(model)
    args = load_example("job_args").resolve(load_example("job_args").parser("test").parse_args(
        ["--shards", "3", "--block-size", "4", "--chunk-size", "40", "--pcp-min-tokens", "24"]))
    prompt = torch.randint(0, VOCAB, (1, 100), generator=torch.Generator().manual_seed(7))
    new = 4
    cfg = job.service_config(model.config, args, "float32", prompt.shape[1] + new, layers)
    cfg = cfg.model_copy(update={"name": f"job-models-{kind}-{id(model)}", "ray_address": None})
    svc = cpattn.start(cfg)
    try:
        lm = job.CpattnLM(model, svc, 1, sinks=any(layers.sinks))
        ids, got = prompt, []
        for start in range(0, prompt.shape[1], 40):
            logits = lm.forward(prompt[:, start:start + 40])
        got.append(logits)
        for _ in range(new - 1):
            token = logits.argmax(-1, keepdim=True)
            ids = torch.cat([ids, token], dim=1)
            logits = lm.forward(token)
            got.append(logits)
        lm.free()
    finally:
        svc.shutdown()
    got = torch.stack(got, dim=1)[0]                       # [steps, vocab]
    positions = list(range(prompt.shape[1] - 1, ids.shape[1]))
    ref = _eager_logits(model, ids)[0, positions]
    err = ((got - ref).norm() / ref.norm()).item()
    assert err < 1e-5, err
    if any(w is not None for w in layers.windows):
        model.config.sliding_window = 1 << 20   # the same weights, the windowed layers seeing everything
        for module in model.modules():
            if getattr(module, "sliding_window", None) is not None:
                module.sliding_window = 1 << 20
        full = _eager_logits(model, ids)[0, positions]
        assert ((full - ref).norm() / ref.norm()).item() > 1e3 * max(err, 1e-7)


def test_a_layer_the_service_does_not_serve_is_refused_not_run():
    """A model whose layer asks for a window or cap the service does not serve fails at that call, saying which."""
    import cpattn

    attention = load_example("job_attention")
    fn = attention.StepAttention()
    fn.expect(cpattn.ServiceConfig(num_shards=1, num_layers=2, num_q_heads=4, num_kv_heads=2, head_size=16,
                                   sliding_window=[None, 20]))
    fn.step = object()   # never reached: the check comes first

    class Layer:
        layer_idx = 0

    q = torch.zeros(1, 4, 3, 16)
    with pytest.raises(ValueError, match="layer 0 asks for sliding_window=20, softcap=None; the service serves "
                                         "sliding_window=None"):
        fn(Layer(), q, q[:, :2], q[:, :2], None, scaling=0.25, sliding_window=20)
    Layer.layer_idx = 1
    with pytest.raises(ValueError, match="softcap=30.0"):
        fn(Layer(), q, q[:, :2], q[:, :2], None, scaling=0.25, sliding_window=20, softcap=30.0)


def test_a_layers_own_scale_is_kept_by_scaling_q():
    """Gemma 2's query_pre_attn_scalar: cpattn scales by head_size ** -0.5, so q reaches it scaled by the ratio."""
    attention = load_example("job_attention")
    fn = attention.StepAttention()
    seen = {}

    class Step:
        def attend(self, layer, q, k, v, **kw):
            seen.update(q=q, kw=kw)
            return torch.zeros_like(q)

    class Layer:
        layer_idx = 0

    fn.step = Step()
    q = torch.randn(1, 4, 3, 16)
    fn(Layer(), q, q[:, :2], q[:, :2], None, scaling=24 ** -0.5, s_aux=torch.zeros(4))
    assert torch.allclose(seen["q"], q.transpose(1, 2).reshape(3, 4, 16) * (24 ** -0.5 * 16 ** 0.5))
    assert seen["kw"]["sinks"].shape == (4,)


def test_an_attached_service_with_other_windows_is_refused(model_dirs):
    import cpattn
    from cpattn.errors import ConfigError

    job, attention = load_example("long_context_job"), load_example("job_attention")
    model = _build(model_dirs, "gemma2")
    served = cpattn.ServiceConfig(num_shards=1, num_layers=4, num_q_heads=4, num_kv_heads=2, head_size=16,
                                  dtype="float32", sliding_window=20, logits_soft_cap=5.0)
    with pytest.raises(ConfigError, match=r"sliding_window is 20, the model needs \[20, None, 20, None\]"):
        job.check_geometry(served, model.config, "float32", attention.probe_layers(model))


def test_the_job_with_local_weights_a_prompt_file_and_verify(ray_session, model_dirs, tmp_path):
    """As a user runs it: `--model DIR --prompt-file F --verify` (the tokenizer comes with the weights); then
    --oracle-check on Mistral (layer 0 windowed: the float64 reference over the window's keys only), and refused for
    Gemma 2 (its layer 0 is not recomputed the Llama way) before anything starts."""
    job = load_example("long_context_job")
    text = tmp_path / "prompt.txt"
    text.write_text(" ".join(f"w{(7 * i) % 250}" for i in range(90)))
    out = tmp_path / "gemma2.json"
    assert job.main(["--model", str(model_dirs["gemma2"]), "--prompt-file", str(text), "--chunk-size", "32",
                     "--max-new-tokens", "4", "--shards", "2", "--verify", "--no-progress",
                     "--json-out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["tokens"] == result["eager_tokens"] and result["context_tokens"] == 90
    assert result["attention"] == {"windows": [20, None, 20, None], "soft_caps": 5.0, "scales": 24 ** -0.5,
                                   "sinks": False}
    out = tmp_path / "mistral.json"
    assert job.main(["--model", str(model_dirs["mistral"]), "--prompt-len", "80", "--chunk-size", "32",
                     "--max-new-tokens", "3", "--shards", "2", "--oracle-check", "--no-progress",
                     "--json-out", str(out)]) == 0
    oracle = json.loads(out.read_text())["oracle"]
    assert oracle["ok"] and oracle["keys"] == 24 and oracle["rel_err"] < 1e-5
    # Every Mistral layer is windowed: the service gives back the pages before each window, so the job sizes its
    # cache for a window (24), a decode run's 128 tokens ahead and a page a shard (184 tokens: 8 pages of 16 a shard,
    # with 2 of slack), not for the 403 of the context.
    out = tmp_path / "mistral-long.json"
    assert job.main(["--model", str(model_dirs["mistral"]), "--prompt-len", "400", "--chunk-size", "32",
                     "--max-new-tokens", "3", "--shards", "2", "--verify", "--no-progress",
                     "--json-out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["tokens"] == result["eager_tokens"] and result["context_tokens"] == 400
    blocks = result["service"]["num_blocks_per_shard"]
    assert 2 * blocks * result["service"]["block_size"] < 403 and blocks == 8
    with pytest.raises(SystemExit, match="this model is 'gemma2': drop --oracle-check"):
        job.main(["--model", str(model_dirs["gemma2"]), "--oracle-check", "--no-progress"])


def test_sdpa_baseline_of_a_model_without_sdpa_is_refused_and_the_check_uses_eager(ray_session, model_dirs, tmp_path):
    """Gemma 2 and gpt-oss have no SDPA attention in transformers: the job's `--attn sdpa` row says so in one line,
    and examples/check_job_vs_sdpa.py compares cpattn with transformers' eager attention instead, logit by logit."""
    job = load_example("long_context_job")
    with pytest.raises(SystemExit, match="--attn sdpa: .*gemma2: transformers has no SDPA attention for this model "
                                         r"\(Gemma2ForCausalLM\): run it on cpattn with --verify"):
        job.main(["--model", str(model_dirs["gemma2"]), "--attn", "sdpa", "--no-progress"])
    check = load_example("check_job_vs_sdpa")
    out = tmp_path / "check.json"
    assert check.main(["--device", "cpu", "--model", str(model_dirs["gemma2"]), "--prompt-len", "60", "--chunk-size",
                       "32", "--decode-steps", "3", "--shards", "2", "--json-out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["ok"] and report["reference_attn"] == "eager" and report["max_rel_logit_diff_vs_sdpa"] < 1e-4
