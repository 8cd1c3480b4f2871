"""Shared fixtures: one embedded local Ray for the whole session (service tests start their services in it)."""

from __future__ import annotations

import logging
import os

import pytest

import background_fixtures
import interpreter_run
import suite_lanes
from case_log import pytest_runtest_logreport, pytest_runtest_logstart  # noqa: F401 (hooks: CPATTN_CASE_LOG)


def pytest_configure(config):
    """Under xdist (scripts/test.sh): each worker's lanes (tests/suite_lanes.py); the controller names the run."""
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:
        import torch

        torch.set_num_threads(1)   # two workers on two cores: one torch thread each
        config.stash[_LANES] = suite_lanes.Lanes(suite_lanes.lock_base(workerinput["testrunuid"]))
    elif getattr(config.option, "numprocesses", None):
        import uuid

        config.option.testrunuid = config.option.testrunuid or uuid.uuid4().hex   # known here, for the cleanup
        # Before the workers start: the token Ray's first local start would write (~/.ray/auth_token), written
        # once here, so that two workers starting Ray at once cannot each write a different one.
        from ray._private.authentication.authentication_token_setup import generate_and_save_token
        from ray._raylet import AuthenticationTokenLoader

        if not AuthenticationTokenLoader.instance().has_token(ignore_auth_mode=True):
            generate_and_save_token()


def pytest_unconfigure(config):
    if getattr(config, "workerinput", None) is None and getattr(config.option, "testrunuid", None):
        suite_lanes.remove(suite_lanes.lock_base(config.option.testrunuid))


_LANES = pytest.StashKey()
_AFTER_BACKGROUND = pytest.StashKey()   # modules whose tests start once no background scenario runs


def _in_xdist(config) -> bool:
    return getattr(config, "workerinput", None) is not None or bool(getattr(config.option, "numprocesses", None))


@pytest.hookimpl(trylast=True)   # after -k/-m deselection
def pytest_collection_modifyitems(config, items):
    """In xdist workers: modules in the order of suite_lanes.module_order (tests keep their order in a module).
    In one process with background scenarios to run (tests/background_fixtures.py): the modules with an alone
    test after the others, so that the scenarios overlap tests without time bounds of their own; before those, the
    modules whose scenario has no time bound, so that it has the suite so far to run in (not the first minute)."""
    if getattr(config, "workerinput", None) is None:
        if not _in_xdist(config) and _background_modules(items) and background_fixtures.can_raise_priority():
            has_alone = {_module(i) for i in items if suite_lanes.lane(i.nodeid) == "alone"}
            untimed = background_fixtures.untimed()
            # stable: module order kept otherwise; the interpreter run's results last (tests/interpreter_run.py)
            items[:] = sorted(items, key=lambda i: (_module(i) == interpreter_run.MODULE, _module(i) in has_alone,
                                                    _module(i) in untimed))
            config.stash[_AFTER_BACKGROUND] = has_alone
        return
    by_module: dict[str, list] = {}
    for item in items:
        by_module.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    kinds = {path: {suite_lanes.lane(i.nodeid) for i in group} for path, group in by_module.items()}
    ordered = [item for path in suite_lanes.module_order(list(by_module), kinds) for item in by_module[path]]
    assert len(ordered) == len(items)
    items[:] = ordered


def _module(item) -> str:
    return item.nodeid.split("::", 1)[0].rsplit("/", 1)[-1]


def _background_modules(items) -> list[str]:
    """The selected modules with a background scenario, in the order their tests run (the first needed first)."""
    modules = dict.fromkeys(_module(i) for i in items)
    return [m for m in modules if m in background_fixtures.registered()]


@pytest.hookimpl(wrapper=True)
def pytest_runtestloop(session):
    """Start the selected modules' background scenarios (one process, not --collect-only); at the end, those
    never picked up (-x, Ctrl-C) are aborted and joined."""
    if session.config.option.collectonly or _in_xdist(session.config):
        return (yield)
    background_fixtures.start(_background_modules(session.items))
    beside = _start_interpreter_run(session.items)
    try:
        return (yield)
    finally:
        background_fixtures.abort_and_join()
        if beside:
            interpreter_run.SESSION.cleanup()


def _start_interpreter_run(items) -> bool:
    """The Triton interpreter's tests at nice 19 from the start (tests/interpreter_run.py), when their module is
    selected, this process may run things in the background and the run can happen here."""
    if interpreter_run.MODULE not in {_module(i) for i in items} or os.environ.get("CPATTN_TEST_BACKGROUND") == "0":
        return False
    if interpreter_run.unavailable() is not None:
        return False
    interpreter_run.SESSION.start()
    return True


def pytest_terminal_summary(terminalreporter):
    for line in background_fixtures.summary() + [interpreter_run.SESSION.summary()]:
        if line:
            terminalreporter.write_line(line)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Each test's setup, call and teardown in its lane: only in an xdist worker. In one process, every test of a
    module with an alone test (and any alone test) starts once no background scenario runs."""
    lanes = item.config.stash.get(_LANES, None)
    if lanes is None:
        after_background = item.config.stash.get(_AFTER_BACKGROUND, set())
        if background_fixtures.running() and (suite_lanes.lane(item.nodeid) == "alone"
                                               or _module(item) in after_background):
            background_fixtures.wait_all()
        yield
        return
    with lanes.hold(suite_lanes.lane(item.nodeid)):
        yield


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


@pytest.fixture
def clean_backend_registry():
    """Backend registration is process-global: restore the registry in place after the test."""
    from cpattn.attention import registry
    from cpattn.attention.selector import clear_selector_cache

    paths = dict(registry._paths)
    priority = {k: list(v) for k, v in registry.PRIORITY.items()}
    clear_selector_cache()
    yield registry
    registry._paths.clear()
    registry._paths.update(paths)
    registry.PRIORITY.clear()
    registry.PRIORITY.update(priority)
    clear_selector_cache()


@pytest.fixture
def nothing_may_start(monkeypatch):
    """Starting Ray or a coordinator fails the test: for errors that must come before anything starts."""
    from cpattn import client
    from cpattn.cluster import service

    def must_not_run(*args, **kwargs):
        raise AssertionError("Ray or the coordinator was started for a request that had to fail first")

    for module, name in ((client, "ensure_ray"), (service, "ensure_ray"), (client, "launch_coordinator"),
                         (service, "launch_coordinator")):
        monkeypatch.setattr(module, name, must_not_run)
