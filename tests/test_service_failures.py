"""A shard lost mid-service, and start-up failures: typed errors within the configured timeouts, nothing left running."""

from __future__ import annotations

import time

import pytest
import ray

import cpattn
from cpattn.errors import BackendUnavailableError, ServiceError, ShardLostError
from conftest import service_config
from service_oracle import Oracle, local_tokens, run_step

TIMEOUTS = dict(rpc_timeout_s=5.0, collective_timeout_s=5.0, health_check_interval_s=0.2)


def _step_after_a_loss(svc, oracle, request) -> None:
    """The step right after a shard is lost. Its ShardLostError comes at once when the lost shard is replaced
    within the coordinator's settle time (END_STEP_SETTLE_S); on a loaded machine the replacement can take longer,
    and the step ends with "run the step again" first: the user does as told, and the retry names the loss."""
    try:
        run_step(svc, oracle, request)
    except ServiceError as exc:
        if "run the step again" not in str(exc):
            raise
        run_step(svc, oracle, request)


def _placement_groups() -> dict[str, str]:
    return {pg_id: info["state"] for pg_id, info in ray.util.placement_group_table().items()}


def _coordinator_exists(cfg) -> bool:
    try:
        ray.get_actor(cfg.name, namespace=cfg.namespace)
        return True
    except ValueError:
        return False


def _assert_gone(cfg, pgs_before: dict[str, str], shards: list) -> None:
    deadline = time.monotonic() + 20
    while True:
        ours = {pg: state for pg, state in _placement_groups().items() if pg not in pgs_before}
        alive_pgs = [pg for pg, state in ours.items() if state != "REMOVED"]
        if not _coordinator_exists(cfg) and not alive_pgs:
            break
        assert time.monotonic() < deadline, f"left running: coordinator={_coordinator_exists(cfg)} pgs={alive_pgs}"
        time.sleep(0.2)
    named = {(a["namespace"], a["name"]) for a in ray.util.list_named_actors(all_namespaces=True)}
    assert (cfg.namespace, cfg.name) not in named
    for h in shards:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(h.ping.remote(), timeout=20)


@pytest.mark.parametrize("killed_rank", [1])
def test_killed_shard_raises_shard_lost_naming_sequences_and_shutdown_cleans_up(ray_session, killed_rank):
    pgs_before = _placement_groups()
    cfg = service_config(num_shards=3, block_size=4, dcp_interleave=4, **TIMEOUTS)
    svc = cpattn.start(cfg)
    shards = list(svc.gateway.shards)
    try:
        assert len(shards) == 3
        oracle = Oracle(cfg, 9)
        a, b, c = svc.add_sequence(), svc.add_sequence(), svc.add_sequence()
        run_step(svc, oracle, {a: 12, b: 3, c: 5})   # a and c reach rank 1 (tokens 4..7); b does not
        holders = sorted(s for s in (a, b, c) if local_tokens(oracle.length(s), 3, killed_rank, 4) > 0)
        assert holders == sorted([a, c])
        ray.kill(shards[killed_rank], no_restart=True)
        t0 = time.monotonic()
        with pytest.raises(ShardLostError, match=rf"shard {killed_rank}\b") as info:
            _step_after_a_loss(svc, oracle, {a: 1, b: 1})
        elapsed = time.monotonic() - t0
        assert elapsed < cfg.collective_timeout_s + cfg.rpc_timeout_s + 60, elapsed   # a retry waits for the replacement
        err = info.value
        assert err.shard in (None, killed_rank)
        # The step's affected sequence is named (attribute and message); b held nothing there.
        assert a in err.sequences and a in str(err)
        assert b not in err.sequences
        assert set(err.sequences) <= set(holders)
        # The other sequence whose KV was on the lost shard is named as soon as it is used.
        with pytest.raises(ShardLostError, match=c) as info:
            run_step(svc, oracle, {c: 1})
        assert c in info.value.sequences
        current = ray.get(svc.gateway.coordinator.get_shards.remote(svc.operator_credential), timeout=30)
        shards += current.shards   # replacements, if any
    finally:
        svc.shutdown()
    _assert_gone(cfg, pgs_before, shards)


def test_shutdown_leaves_nothing_running(ray_session):
    pgs_before = _placement_groups()
    cfg = service_config(num_shards=2, **TIMEOUTS)
    svc = cpattn.start(cfg)
    shards = list(svc.gateway.shards)
    assert _coordinator_exists(cfg)
    run_step(svc, Oracle(cfg, 1), {svc.add_sequence(): 3})
    svc.shutdown()
    _assert_gone(cfg, pgs_before, shards)
    with pytest.raises(cpattn.errors.InvalidRequestError, match="closed or shut down"):
        svc.add_sequence()
    # The name is free again.
    again = cpattn.start(cfg)
    try:
        run_step(again, Oracle(cfg, 2), {again.add_sequence(): 2})
    finally:
        again.shutdown()


def test_unknown_backend_fails_start_with_valid_options_and_leaves_nothing(ray_session):
    pgs_before = _placement_groups()
    cfg = service_config(num_shards=2, backend="NOPE")
    with pytest.raises(BackendUnavailableError, match=r"unknown attention backend 'NOPE': use auto or one of "
                                                      r"TORCH, FLASHINFER, FLASH_ATTN, TRITON") as info:
        cpattn.start(cfg)
    assert "NOPE" in info.value.reasons
    _assert_gone(cfg, pgs_before, [])


def test_explicit_backend_that_cannot_serve_here_fails_with_reasons_before_any_shard_starts(ray_session):
    """Issue 12 item 8: FLASHINFER on CPU is a BackendUnavailableError with .reasons (what get_attn_backend
    says), raised before the placement group or any shard exists, not a ServiceError after they started."""
    pgs_before = _placement_groups()
    cfg = service_config(num_shards=2, backend="FLASHINFER")
    with pytest.raises(BackendUnavailableError, match="FLASHINFER cannot serve") as info:
        cpattn.start(cfg)
    assert info.value.reasons["FLASHINFER"] and any("cpu" in r for r in info.value.reasons["FLASHINFER"])
    assert set(_placement_groups()) == set(pgs_before)   # not even placed (a removed one would still be listed)
    _assert_gone(cfg, pgs_before, [])


def test_hung_shard_surfaces_as_typed_error_not_a_hang(ray_session):
    pgs_before = _placement_groups()
    cfg = service_config(num_shards=2, **TIMEOUTS)
    svc = cpattn.start(cfg)
    shards = list(svc.gateway.shards)
    try:
        oracle = Oracle(cfg, 4)
        a = svc.add_sequence()
        run_step(svc, oracle, {a: 6})
        ray.get(shards[1].simulate_hang.remote(svc.operator_credential, True), timeout=10)
        t0 = time.monotonic()
        with pytest.raises(ShardLostError, match=r"shard 1\b") as info:
            _step_after_a_loss(svc, oracle, {a: 1})
        assert time.monotonic() - t0 < cfg.collective_timeout_s + 2 * cfg.rpc_timeout_s + 60
        assert a in info.value.sequences and a in str(info.value)
    finally:
        svc.shutdown()
    _assert_gone(cfg, pgs_before, shards)


def test_shards_that_do_not_start_in_time_are_a_service_error_and_leave_nothing(ray_session):
    """A shard start slower than start_timeout_s (a GPU shard compiling its kernels, a slow node) surfaced as a raw
    RayTaskError(GetTimeoutError) with the coordinator's traceback; now a ServiceError naming the setting to raise.
    One second is less than a CPU shard's process start (imports alone take seconds)."""
    pgs_before = _placement_groups()
    cfg = service_config(num_shards=1, start_timeout_s=1.0, **TIMEOUTS)
    with pytest.raises(ServiceError, match=r"the shards did not start within start_timeout_s=1s: raise "
                                           r"start_timeout_s, or see what they wait for in `ray status`"):
        cpattn.start(cfg)
    _assert_gone(cfg, pgs_before, [])
