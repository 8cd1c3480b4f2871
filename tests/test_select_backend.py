"""select_backend(config, device): the one backend choice every call site makes (issue 19).

An explicit GPU backend that cannot serve a setting (fp8 KV cache, sliding window, soft cap) fails before
Ray or any actor starts, for cpattn.start and `cpattn serve`, listing every reason; what this process's
platform lacks (CUDA, packages) is not held against shards that run elsewhere. Auto falls back to a backend
that can serve. The shard, the client's local shards, the bundle probe and the pre-start check all select
through select_backend and nothing else.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import cpattn
from cpattn.attention import AttentionBackend, register_backend, select_backend
from cpattn.attention import registry
from cpattn.errors import BackendUnavailableError

ROOT = Path(__file__).resolve().parents[1]
PLATFORM_REASON = "CUDA is not available in this process (test plugin)"
SETTINGS_REASONS = ["fp8 KV cache (fp8_e4m3) not implemented for PLAIN_GPU_PLUGIN yet",
                    "sliding_window not implemented for PLAIN_GPU_PLUGIN yet",
                    "logits_soft_cap not implemented for PLAIN_GPU_PLUGIN yet"]


class PlainGpuPluginBackend(AttentionBackend):
    """A GPU backend that serves no fp8 cache, window or soft cap, on a platform this process lacks."""

    name = "PLAIN_GPU_PLUGIN"
    supported_dtypes = ("float16", "bfloat16")
    supported_devices = ("cuda",)

    @classmethod
    def availability(cls, config):
        return [PLATFORM_REASON]


@pytest.fixture(autouse=True)
def plugin_first_on_cuda(clean_backend_registry):
    """Registers the plugin first in CUDA's auto order (the registry is restored afterwards)."""
    register_backend("PLAIN_GPU_PLUGIN", f"{__name__}:PlainGpuPluginBackend", priority=0, device_type="cuda")


def gpu_config(**fields) -> cpattn.ServiceConfig:
    base = dict(num_shards=2, num_layers=2, num_q_heads=4, num_kv_heads=2, head_size=64, block_size=16,
                dtype="bfloat16", device="cuda", num_gpus_per_shard=1, num_blocks_per_shard=8)
    return cpattn.ServiceConfig(**{**base, **fields})


UNSERVABLE = dict(backend="PLAIN_GPU_PLUGIN", kv_cache_dtype="fp8_e4m3", sliding_window=[128, None],
                  logits_soft_cap=30.0)


def test_start_with_explicit_gpu_backend_that_cannot_serve_the_settings_fails_first(nothing_may_start):
    with pytest.raises(BackendUnavailableError, match="attention backend PLAIN_GPU_PLUGIN cannot serve") as exc:
        cpattn.start(gpu_config(**UNSERVABLE))
    reasons = exc.value.reasons["PLAIN_GPU_PLUGIN"]
    for expected in SETTINGS_REASONS:
        assert any(r.startswith(expected) for r in reasons), (expected, reasons)
        assert expected in str(exc.value)
    assert PLATFORM_REASON not in reasons   # the shards' platform is probed where they run, not here


def test_serve_with_explicit_gpu_backend_that_cannot_serve_the_settings_fails_first(nothing_may_start, capsys):
    from cpattn.launch.cli import main

    flags = ["--num-shards", "2", "--num-layers", "2", "--num-q-heads", "4", "--num-kv-heads", "2",
             "--head-size", "64", "--block-size", "16", "--dtype", "bfloat16", "--device", "cuda",
             "--num-gpus-per-shard", "1", "--backend", "PLAIN_GPU_PLUGIN", "--kv-cache-dtype", "fp8_e4m3",
             "--sliding-window", "128", "--logits-soft-cap", "30"]
    assert main(["serve", *flags]) != 0
    err = capsys.readouterr().err
    assert "attention backend PLAIN_GPU_PLUGIN cannot serve" in err
    for expected in SETTINGS_REASONS:
        assert expected in err


def test_explicit_gpu_backend_serving_the_settings_passes_the_check_without_a_gpu_here():
    from cpattn.cluster.service import check_backend

    check_backend(gpu_config(backend="PLAIN_GPU_PLUGIN"))   # platform reasons are for the bundle probe


def test_auto_falls_back_to_a_backend_that_serves_the_settings():
    plain = gpu_config()
    assert select_backend(plain, platform_here=False) is PlainGpuPluginBackend   # first in the auto order
    demanding = gpu_config(**{**UNSERVABLE, "backend": "auto"})
    chosen = select_backend(demanding, platform_here=False)
    assert chosen is not PlainGpuPluginBackend
    assert select_backend(demanding, backend=chosen.get_name(), platform_here=False) is chosen
    cpu = gpu_config(**{**UNSERVABLE, "backend": "auto", "device": "cpu", "num_gpus_per_shard": 0,
                        "dtype": "float32"})
    assert select_backend(cpu).get_name() == "TORCH"


def test_the_call_sites_agree_on_the_choice():
    """Pre-start check, bundle probe and shard select the same backend for the same config."""
    from cpattn.cluster.service import check_backend
    from cpattn.cluster.shard_set import probe_backend

    cfg = gpu_config(**{**UNSERVABLE, "backend": "auto", "device": "cpu", "num_gpus_per_shard": 0,
                        "dtype": "float32"})
    check_backend(cfg)
    assert probe_backend(cfg, registry.registry_state()) == select_backend(cfg).get_name() == "TORCH"
    with pytest.raises(BackendUnavailableError, match="PLAIN_GPU_PLUGIN cannot serve"):
        probe_backend(cfg.model_copy(update={"backend": "PLAIN_GPU_PLUGIN"}), None)


CALL_SITES = {"cpattn/cluster/shard.py": "ShardWorker.__init__", "cpattn/cluster/client_group.py": "GroupMembership.join",
              "cpattn/cluster/shard_set.py": "probe_backend", "cpattn/cluster/service.py": "check_backend"}


def _calls(path: Path) -> dict[str, set[str]]:
    """Function (Class.method) -> names it calls."""
    found: dict[str, set[str]] = {}

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names = found.setdefault(prefix + child.name, set())
                for sub in ast.walk(child):
                    if isinstance(sub, ast.Call):
                        f = sub.func
                        names.add(f.id if isinstance(f, ast.Name) else getattr(f, "attr", ""))

    visit(ast.parse(path.read_text()), "")
    return found


def test_no_call_site_builds_a_backend_by_hand():
    for rel, function in CALL_SITES.items():
        calls = _calls(ROOT / rel)
        assert function in calls, f"{rel} has no {function}: update CALL_SITES"
        assert "select_backend" in calls[function], f"{rel} {function} must choose through select_backend"
    for path in (ROOT / "cpattn").rglob("*.py"):
        if path.name == "selector.py":
            continue
        called = set().union(*_calls(path).values()) if _calls(path) else set()
        assert not called & {"get_attn_backend", "load_backend_class"} or path.name == "registry.py", \
            f"{path.relative_to(ROOT)} chooses a backend by hand: use select_backend(config, device)"
