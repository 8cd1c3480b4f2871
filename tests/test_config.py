"""ServiceConfig validation (field, value and fix in every message), YAML loading, and the error hierarchy."""

import json
import pickle
import time

import pytest
import torch

import cpattn
from cpattn.config import ServiceConfig, load_config
from cpattn.errors import (BackendUnavailableError, CapacityError, ConfigError, CpattnError, InvalidRequestError,
                           ShardLostError)


def test_defaults_are_valid():
    cfg = ServiceConfig()
    assert (cfg.num_shards, cfg.num_q_heads, cfg.num_kv_heads, cfg.head_size, cfg.block_size) == (4, 32, 8, 128, 16)
    assert cfg.backend == "auto" and cfg.dtype == "bfloat16" and cfg.torch_dtype is torch.bfloat16
    assert cpattn.ServiceConfig is ServiceConfig


def test_fields_come_from_the_groups_in_order_each_with_its_help_text():
    """ServiceConfig inherits its fields from config_groups (issue 19): the same fields, in the groups' order (as
    --help, errors and model_dump list them), each group's docstrings still its help texts."""
    from cpattn.config_groups import GROUPS

    in_groups = [name for group in GROUPS for name in group.model_fields]
    assert list(ServiceConfig.model_fields) == in_groups and len(set(in_groups)) == len(in_groups) == 56
    assert in_groups[:3] == ["num_shards", "num_layers", "num_q_heads"] and in_groups[-1] == "kv_scales"
    for name, info in ServiceConfig.model_fields.items():
        assert info.description and info.description == next(g.model_fields[name].description for g in GROUPS
                                                              if name in g.model_fields), name
    assert ServiceConfig.model_fields["rpc_timeout_s"].description == "Timeout of every blocking Ray call."
    with pytest.raises(ValueError, match="Instance is frozen"):   # still frozen, as before the split
        ServiceConfig().num_shards = 2


@pytest.mark.parametrize("fields, match", [
    (dict(num_q_heads=12, num_kv_heads=8), r"num_q_heads 12 is not a multiple of num_kv_heads 8: pick num_kv_heads"),
    (dict(head_size=100), r"head_size 100 must be a multiple of 8 and at most 256: use e\.g\. 64"),
    (dict(head_size=512), r"head_size 512 must be a multiple of 8 and at most 256"),
    (dict(block_size=16, dcp_interleave=3), r"block_size 16 is not a multiple of dcp_interleave 3: use a dcp_int"),
    (dict(num_shards=1, kv_replicas=2), r"kv_replicas 2 needs at least as many shards, num_shards is 1: raise"),
    (dict(backend="flash-attn!"), r"backend 'flash-attn!' is not a backend name: use one of auto, TORCH"),
    (dict(num_shards=0), r"num_shards=0: .*greater than or equal to 1"),
    (dict(block_size=-4), r"block_size=-4: .*greater than or equal to 1"),
    (dict(dtype="int8"), r"dtype='int8': .*'float16', 'bfloat16', 'float32' or 'float64'"),
    (dict(device="tpu"), r"device='tpu': .*'auto', 'cpu' or 'cuda'"),
    (dict(rpc_timeout_s=0), r"rpc_timeout_s=0: .*greater than 0"),
    (dict(num_shard=4), r"unknown field 'num_shard': valid fields are num_shards, num_layers"),
])
def test_bad_values_name_field_value_and_fix(fields, match):
    with pytest.raises(ConfigError, match=match) as info:
        ServiceConfig(**fields)
    assert isinstance(info.value, CpattnError) and isinstance(info.value, ValueError)


def test_several_bad_fields_are_all_reported():
    with pytest.raises(ConfigError) as info:
        ServiceConfig(num_shards=0, num_layers=0)
    assert "num_shards=0" in str(info.value) and "num_layers=0" in str(info.value)


def test_config_is_frozen():
    cfg = ServiceConfig()
    with pytest.raises(Exception):
        cfg.num_shards = 8
    assert cfg.num_shards == 4


def test_derived_values():
    cfg = ServiceConfig(num_layers=2, num_kv_heads=4, num_q_heads=8, head_size=64, block_size=16, dtype="float32",
                        kv_cache_bytes_per_shard=10 * 2**20)
    per_block = 2 * 2 * 16 * 4 * 64 * 4          # layers * (K,V) * tokens * heads * dim * bytes
    assert cfg.bytes_per_block() == per_block
    assert cfg.blocks_per_shard() == (10 * 2**20) // per_block
    assert ServiceConfig(num_blocks_per_shard=7).blocks_per_shard() == 7
    assert ServiceConfig().resolved_device() == "cpu"
    assert ServiceConfig(num_gpus_per_shard=1).resolved_device() == "cuda"


def test_data_plane_choice():
    """NCCL only when the client and every wire shard have a GPU each; an explicit nccl that cannot is an error."""
    import torch

    from cpattn.cluster.gateway import choose_data_plane
    from cpattn.cluster.messages import ShardInfo

    cpu = torch.device("cpu")
    infos = [ShardInfo(bundle_index=0, gpu_uuid=None), ShardInfo(bundle_index=1, gpu_uuid=None)]
    assert choose_data_plane(ServiceConfig(), cpu, infos) == "gloo"
    assert choose_data_plane(ServiceConfig(data_plane="gloo"), cpu, infos) == "gloo"
    with pytest.raises(ConfigError, match="data_plane 'nccl' needs .* GPU of its own"):
        choose_data_plane(ServiceConfig(data_plane="nccl"), cpu, infos)


def test_load_config_yaml_with_overrides(tmp_path):
    path = tmp_path / "svc.yaml"
    path.write_text("num_shards: 2\nhead_size: 64\nbackend: TORCH\ndcp_interleave: 16\n")
    cfg = load_config(path)
    assert (cfg.num_shards, cfg.head_size, cfg.backend, cfg.dcp_interleave) == (2, 64, "TORCH", 16)
    cfg = load_config(str(path), num_shards=8, head_size=None)       # None: flag not given, file wins
    assert (cfg.num_shards, cfg.head_size) == (8, 64)
    assert cpattn.load_config is load_config


def test_load_config_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("head_size: 100\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: head_size 100 must be a multiple of 8"):
        load_config(bad)
    with pytest.raises(ConfigError, match=r"bad\.yaml: num_shards=0"):
        load_config(bad, head_size=64, num_shards=0)
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="expected a mapping of ServiceConfig fields, got list"):
        load_config(listy)
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert load_config(empty) == ServiceConfig()
    # Raw TypeError / UnicodeDecodeError before: each a ConfigError naming what to give instead.
    latin = tmp_path / "latin.yaml"
    latin.write_bytes("name: caf\xe9\n".encode("latin-1"))
    keyed = tmp_path / "keyed.yaml"
    keyed.write_text("num_shards: 2\n1: 2\n")
    for path, match in ((None, "config path None must be a str or pathlib.Path"), (5, "config path 5 must be"),
                        (latin, r"latin\.yaml' is not UTF-8 text \(invalid continuation byte at byte 9\)"),
                        (keyed, r"keyed\.yaml: key 1 is not a ServiceConfig field name")):
        with pytest.raises(ConfigError, match=match):
            load_config(path)


@pytest.mark.parametrize("fields", [dict(num_shards=True), dict(rpc_timeout_s=False), dict(sliding_window=[True, 8]),
                                    dict(shard_resources={"cpattn_shard": True}), dict(max_tokens_per_client=True)])
def test_a_bool_is_not_a_number(fields, tmp_path):
    """pydantic reads True as 1: `num_shards: true` started one shard. Refused in Python and in YAML alike; the
    bool fields and numbers written as strings (CLI flags) are unchanged."""
    (name, value), = fields.items()
    with pytest.raises(ConfigError, match=rf"{name}=.*: {name} takes numbers, not true/false"):
        ServiceConfig(**fields)
    path = tmp_path / "c.yaml"
    path.write_text(f"{name}: {json.dumps(value)}\n")
    with pytest.raises(ConfigError, match=rf"c\.yaml: {name}=.*takes numbers, not true/false"):
        load_config(path)
    assert ServiceConfig(num_shards="2", detached=True).num_shards == 2


@pytest.mark.parametrize("err", [
    CapacityError("shard 1: needs 5 KV blocks, 2 free", shard=1, needed=5, free=2),
    ShardLostError("shard 3 died", shard=3, sequences=["a", "b"]),
    BackendUnavailableError("no backend", {"TORCH": ["dtype int8 not supported"]}),
    InvalidRequestError("head_size 100 is not 128"),
    ConfigError("num_shards=0: ..."),
])
def test_errors_pickle_across_actors(err):
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is type(err) and str(back) == str(err)
    assert vars(back) == vars(err)
    assert isinstance(back, CpattnError)


# Issue 20: configs that cannot work (each used to start and then fail, hang or exhaust memory).
UNWORKABLE = [
    (dict(logits_soft_cap=float("inf")), r"logits_soft_cap inf of layer 0 must be finite and > 0"),
    (dict(logits_soft_cap=[None, float("nan")], num_layers=2), r"logits_soft_cap nan of layer 1 must be finite"),
    (dict(health_check_interval_s=float("inf")), r"health_check_interval_s=inf: .*finite"),
    (dict(sliding_window=2**70), r"sliding_window 1180591620717411303424 of layer 0 must be in 1\.\.2147483647"),
    (dict(collective_timeout_s=float("inf")), r"collective_timeout_s=inf: .*finite"),
    (dict(rpc_timeout_s=float("inf")), r"rpc_timeout_s=inf: .*finite"),
    (dict(rpc_timeout_s=1e300), r"rpc_timeout_s=1e\+300: .*less than or equal to 86400"),
    (dict(client_lease_s=float("nan")), r"client_lease_s=nan: .*finite"),
    (dict(join_timeout_s=0), r"join_timeout_s=0: .*greater than 0"),
    (dict(max_sequences=10**12), r"max_sequences 1000000000000 over 4 shards needs .* GiB of bookkeeping"),
    (dict(num_blocks_per_shard=10**12), r"num_blocks_per_shard 1000000000000 means .* GiB of KV cache per shard"),
    (dict(num_blocks_per_shard=2 * 10**8, num_layers=1, num_kv_heads=1, num_q_heads=1, head_size=8, block_size=1),
     r"num_blocks_per_shard 200000000 over 4 shards needs .* bookkeeping"),
]


@pytest.mark.parametrize("fields,match", UNWORKABLE)
def test_unworkable_configs_fail_before_anything_starts(fields, match, monkeypatch):
    import ray

    def must_not_run(*a, **k):
        raise AssertionError("ray.remote reached with an unworkable config")

    monkeypatch.setattr(ray, "remote", must_not_run)
    with pytest.raises(ConfigError, match=match):
        cpattn.start(**fields)


def test_block_pool_is_compact_and_fifo():
    """The coordinator's pools hold arrays, not a Python object per block: 8 bytes a block (a deque of ints held
    36 or more)."""
    import tracemalloc

    from cpattn.kvstore import BlockPool

    tracemalloc.start()
    pool = BlockPool(1_000_000)
    size, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert size < 9 * 2**20
    first = pool.allocate(3)
    assert first == [0, 1, 2]
    pool.free([1])
    assert pool.allocate(999_997)[-1] == 999_999 and pool.allocate(1) == [1]   # freed blocks go to the back
    assert pool.num_free_blocks == 0


def test_sizes_lists_and_field_names_in_errors(tmp_path):
    """CLI audit (session 29): num_layers 10**12 raised MemoryError; a cache budget under one page was exceeded
    silently (2.5 GiB for 1 MiB); per-layer lists could not be given as flags; a mapping where a number belongs lost
    the field's name; a union field reported each of its branches."""
    cases = ((dict(num_layers=10**12), r"num_layers=1000000000000: Input should be less than or equal to 4096"),
             (dict(num_layers=80, head_size=256, block_size=256, kv_cache_bytes_per_shard=2**20),
              r"kv_cache_bytes_per_shard 1048576 holds no KV page: one page of 256 tokens over 80 layers takes"),
             (dict(num_shards={"a": 1}), r"^num_shards=\{'a': 1\}: Input should be a valid integer$"),
             (dict(sliding_window=4.5), r"^sliding_window=4.5: Input should be a valid integer, got a number with a "
                                        r"fractional part$"),
             (dict(sliding_window="[8,"), r"'\[8,' is not a JSON list: write e.g. '\[4096, null\]'"))
    for fields, match in cases:
        with pytest.raises(ConfigError, match=match):
            ServiceConfig(**fields)
    assert (ServiceConfig(backend="AUTO", prefill_backend="Same").backend, ServiceConfig(prefill_backend="SAME")
            .prefill_backend) == ("auto", "same")   # (names matched in any case; the keywords did not)
    cfg = ServiceConfig(num_layers=2, sliding_window="[4096, null]", logits_soft_cap="[30, null]")
    assert cfg.sliding_window == [4096, None] and cfg.logits_soft_cap == [30.0, None]
    path = tmp_path / "windowed.yaml"
    path.write_text("sliding_window: 512\n")
    assert load_config(path, sliding_window="none").sliding_window is None   # a flag sets the file's list back


def test_a_file_of_nested_aliases_or_brackets_is_refused_at_once(tmp_path):
    """A 400-byte file of nested YAML aliases (a "billion laughs") expands to 10^8 values: it took 33 s and 1 GB
    before pydantic refused it, and the error printed the whole value; 5,000 nested brackets raised RecursionError."""
    lines = ["l1: &l1 [" + ", ".join(["1.0"] * 10) + "]"]
    lines += [f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 10) + "]" for i in range(2, 9)]
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("\n".join(lines + ["kv_scales: *l8", "kv_cache_dtype: fp8_e4m3"]) + "\n")
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=r"bomb\.yaml: the file expands to \d{3},\d{3},\d{3} values \(through YAML "
                                          r"anchors and aliases"):
        load_config(bomb)
    assert time.monotonic() - t0 < 5
    deep = tmp_path / "deep.yaml"
    deep.write_text("kv_scales: " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(ConfigError, match=r"deep\.yaml: values nested too deeply"):
        load_config(deep)
    # Under the bound, a wrong value's repr in the error is cut short.
    wide = tmp_path / "wide.yaml"
    wide.write_text("ray_address: [" + ", ".join(["1"] * 5000) + "]\n")
    with pytest.raises(ConfigError) as info:
        load_config(wide)
    assert len(str(info.value)) < 600 and "characters)" in str(info.value), str(info.value)[:800]
    aliased = tmp_path / "aliased.yaml"   # anchors a real file may use stay fine
    aliased.write_text("num_layers: 2\nsliding_window: &w [4096, null]\nlogits_soft_cap: [30.0, 30.0]\n")
    assert load_config(aliased).sliding_window == [4096, None]
