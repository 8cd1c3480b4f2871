"""Two tests at a time on CI's 2 cores (scripts/test.sh runs pytest-xdist with two workers), without letting a
loaded machine decide a test whose claim is a time bound.

Every test is in one of three lanes:

- ``alone``: its claim includes a wall-clock bound or rides a short timeout (a killed shard's replacement within
  END_STEP_SETTLE_S, a step error within collective_timeout_s + 10 s, a CLI error within 10 s, a partition
  shorter than shard_hang_timeout_s). It runs while no other Ray or subprocess test runs; a ``light`` test may
  run beside it, at the lowest CPU priority (nice 19), so it takes only the CPU the alone test leaves idle.
- ``heavy``: starts Ray, a service or subprocesses, with generous timeouts only; two run at once.
- ``light``: in-process, no Ray, one torch thread, nice 19 while it runs (as root, as on CI; without the
  privilege to return to the previous priority it runs as it is): runs beside anything.

The lanes are a readers-writer lock over two files (fcntl.flock, released by the kernel if a worker dies): heavy
tests share it, an alone test holds it exclusively, light tests never touch it. A turnstile makes a waiting alone
test go next instead of waiting for a gap between heavy tests. The lock covers each test's whole protocol (setup,
call, teardown), so module fixtures (a service, the netns cluster) start and stop under their first and last
test's lane. Only xdist workers take lanes: a plain `pytest tests/x.py`, and a pytest that a test starts as a
subprocess (it inherits the worker's environment), run as they always did.

A module listed nowhere is heavy: a new test with a time bound (or a short timeout it must not miss) belongs in
ALONE_MODULES or ALONE_TESTS, a new in-process module without Ray in LIGHT_MODULES.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

# Modules whose every test is alone; single tests by node-id suffix below.
ALONE_MODULES = {
    "test_multihost_netns.py",          # partitions shorter/longer than shard_hang_timeout_s; step error bound
    "test_reliability_chaos.py",        # kills under traffic; restarts within 60 s
    "test_reliability_shard_loss.py",   # replacement and step-error bounds
    "test_coordinator_restart.py",      # replacement refilled before the step settles
    "test_service_failures.py",         # rpc_timeout_s=5 bounds
    "test_data_plane_binding.py",       # rendezvous failures within 3 s
    "test_user_errors.py",              # a CLI error within 10 s (5 s in-process)
    "test_multinode.py",                # one module fixture runs both scenarios: node loss, step-error bounds
}
ALONE_TESTS = (
    "test_reliability_tenants.py::test_open_steps_are_capped_and_never_starve_the_health_check",   # hang 1 s
    "test_reliability_tenants.py::test_a_collective_timeout_without_shard_loss_rebuilds_the_group_and_the_retry_works",
    "test_reliability_tenants.py::test_a_dead_clients_step_groups_and_sequences_come_back_within_two_lease_periods",
    "test_reliability_tenants.py::test_joins_that_never_finish_cannot_hold_the_shards_threads",   # join_timeout + 10
    "test_reliability_tenants.py::test_a_client_stalled_mid_step_holds_no_shard_thread_once_its_shards_gave_up",
    "test_reliability_authority.py::test_an_expired_ticket_and_the_join_limits_in_process",   # joins end in 3 s
    "test_data_plane.py::test_idle_shard_lost_mid_step_single_replica",   # kill mid-step, collective_timeout_s=5
    "test_data_plane.py::test_two_replicas_shard_lost_mid_step_is_invisible",
    "test_cli.py::test_serve_embedded_stops_cleanly_however_it_is_told",          # exits within 10 s of a signal
    "test_service_window_fp8.py::test_fp8_cache_with_replicas_survives_a_killed_shard",
    "test_prefix_sharing.py::test_fp8_cache_windows_and_refill_on_forks",             # a killed shard refilled
)
# In-process, no Ray, no subprocess (checked by tests/test_suite_lanes.py).
LIGHT_MODULES = {
    "test_cascade_attention.py", "test_code_sizes.py", "test_coordinator_state.py", "test_dcp_single_process.py",
    "test_decode_fold.py", "test_decode_run_plans.py", "test_fp8_kv_cache.py", "test_import_cycles.py",
    "test_invariants.py", "test_kernel_warmup.py", "test_kvstore.py", "test_merge.py", "test_messages.py", "test_page_delta.py",
    "test_prefix_sharing_kv.py", "test_prefix_sharing_state.py", "test_selector.py", "test_service_placement.py",
    "test_step_inputs.py", "test_step_ledger.py", "test_steady_rows_host.py", "test_torch_backend.py",
    "test_triton_interpret.py", "test_window_rows.py", "test_window_softcap_sinks.py", "test_worked_example.py",
    "test_suite_lanes.py",
}


def lane(nodeid: str) -> str:
    """'alone', 'heavy' or 'light' for a test's node id (tests/<module>::<name>[params])."""
    module = nodeid.split("::", 1)[0].rsplit("/", 1)[-1]
    base = nodeid.split("[", 1)[0]
    if module in ALONE_MODULES or any(base.endswith(t) for t in ALONE_TESTS):
        return "alone"
    return "light" if module in LIGHT_MODULES else "heavy"


def lock_base(run_id: str) -> Path:
    """Where one xdist run's lock files live (its run id: the same in every worker, unique per run)."""
    return Path("/tmp") / f"cpattn-lanes-{run_id}"


def remove(base: Path) -> None:
    for suffix in (".turn", ".main"):
        Path(f"{base}{suffix}").unlink(missing_ok=True)


class Lanes:
    """The lock files of one xdist run, shared by its workers."""

    def __init__(self, base: Path):
        self._turnstile = open(f"{base}.turn", "a+")
        self._main = open(f"{base}.main", "a+")

    @contextlib.contextmanager
    def hold(self, kind: str):
        if kind == "light":
            with _lowest_priority():
                yield
            return
        fcntl.flock(self._turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(self._main, fcntl.LOCK_EX if kind == "alone" else fcntl.LOCK_SH)
        finally:
            if kind != "alone":   # an alone test keeps the turnstile: nothing queues past it
                fcntl.flock(self._turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(self._main, fcntl.LOCK_UN)
            if kind == "alone":
                fcntl.flock(self._turnstile, fcntl.LOCK_UN)


# Rough serial seconds per module on an idle 2-core machine (the heaviest; others count as 5; the light ones scaled
# from a run under load): the order in which
# the workers take modules. Modules with alone tests go first, each followed by light modules that can run beside
# it, then the heavy ones, largest first, so that the run does not end on one long module with the other worker idle.
MODULE_SECONDS = {
    "test_cli.py": 190, "test_user_day.py": 95, "test_multinode.py": 75, "test_reliability_tenants.py": 75,
    "test_multihost_netns.py": 70, "test_long_context_job.py": 60, "test_coordinator_restart.py": 50,
    "test_prefix_sharing.py": 50, "test_reliability_chaos.py": 48, "test_benchmark_smoke.py": 47,
    "test_service_failures.py": 45, "test_data_plane.py": 45, "test_service_e2e.py": 45,
    "test_reliability_shard_loss.py": 40, "test_user_errors.py": 30, "test_readme.py": 30,
    "test_long_context_job_modes.py": 25, "test_service_window_fp8.py": 25, "test_decode_runs.py": 20,
    "test_long_context_job_models.py": 45,
    # light
    "test_dcp_single_process.py": 110, "test_decode_fold.py": 18, "test_fp8_kv_cache.py": 11,
    "test_decode_run_plans.py": 5,
}


def module_order(modules: list[str], kinds: dict[str, set[str]]) -> list[str]:
    """``modules`` (paths: tests/x.py) in the order to hand them out; ``kinds``: module -> the lanes of its tests."""
    weight = lambda m: -MODULE_SECONDS.get(m.rsplit("/", 1)[-1], 5)   # noqa: E731
    with_alone = sorted((m for m in modules if "alone" in kinds[m]), key=weight)
    light = sorted((m for m in modules if kinds[m] == {"light"}), key=weight)
    heavy = sorted((m for m in modules if m not in with_alone and m not in light), key=weight)
    order = []
    for i, module in enumerate(with_alone):
        order.append(module)
        order.extend(light[i::len(with_alone)])
    return order + heavy if with_alone else light + heavy


@contextlib.contextmanager
def _lowest_priority():
    """This thread (the test's; torch runs one thread) at nice 19 for the block, when it may go back after."""
    if os.geteuid() != 0:
        yield
        return
    before = os.getpriority(os.PRIO_PROCESS, 0)   # Linux: 0 is the calling thread
    os.setpriority(os.PRIO_PROCESS, 0, 19)
    try:
        yield
    finally:
        os.setpriority(os.PRIO_PROCESS, 0, before)
