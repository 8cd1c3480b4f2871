"""Shared fixtures: one embedded local Ray for the whole session (service tests start their services in it)."""

from __future__ import annotations

import logging

import pytest


@pytest.fixture(scope="session")
def ray_session():
    """ray.init once (local, no dashboard); every service test gets a unique service name on top of it."""
    import ray

    if ray.is_initialized():   # another fixture or test already started it
        yield ray
        return
    ray.init(address="local", num_cpus=8, include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


def service_config(**overrides):
    """A small float64 service config for CPU tests; every call gets a unique service name."""
    import cpattn

    from service_oracle import unique_name

    base = dict(num_shards=3, num_layers=2, num_q_heads=4, num_kv_heads=2, head_size=8, block_size=4,
                dtype="float64", num_blocks_per_shard=64, pcp_min_tokens=6, dcp_interleave=1,
                num_cpus_per_shard=0.25, rpc_timeout_s=30.0, collective_timeout_s=30.0, test_hooks=True)
    base.update(overrides)
    base.setdefault("name", unique_name("svc-test"))
    return cpattn.ServiceConfig(**base)


@pytest.fixture
def start_service(ray_session):
    """Factory: start_service(**config overrides) -> Service; every service started is shut down at teardown."""
    import cpattn

    started = []

    def start(**overrides):
        svc = cpattn.start(service_config(**overrides))
        started.append(svc)
        return svc

    yield start
    for svc in started:
        svc.shutdown()
