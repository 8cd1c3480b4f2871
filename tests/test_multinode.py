"""Shards spread over a local multi-node Ray cluster (three raylets on this machine), still exact.

ray.cluster_utils.Cluster needs a Ray instance of its own, so the scenarios (tests/multinode_check.py: SPREAD,
then tests/multinode_node_loss.py on the same cluster) run in one subprocess; it cleans its cluster up itself,
and we kill its process group if it hangs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import background_fixtures

ROOT = Path(__file__).resolve().parents[1]


def _env(**extra) -> dict:
    """This checkout importable; no RAY_ADDRESS inherited, so Ray starts where the test says."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return dict(env, PYTHONPATH=str(ROOT), **extra)


def _run_script(name: str, timeout_s: float, aborted=None) -> dict:
    """Run tests/<name> in its own process group; return its RESULT line as a dict. ``aborted`` (an Event): kill
    it early once set (tests/background_fixtures.py, at the session's end)."""
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / name)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT / "tests", start_new_session=True,
                            env={**_env(), "PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}"})
    try:
        stdout, stderr = background_fixtures.communicate(proc, timeout_s, aborted)
    finally:
        if proc.poll() is None:
            proc.kill()
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, stderr[-4000:]
    return json.loads(next(l for l in stdout.splitlines() if l.startswith("RESULT "))[len("RESULT "):])


# Both scenarios on one local cluster, in one process (a cluster start was most of each test's time); it may run at
# the session's start, beside other tests (tests/background_fixtures.py).
background_fixtures.register(__file__, lambda background: _run_script("multinode_check.py", 300, background.aborted))


@pytest.fixture(scope="module")
def scenarios() -> dict:
    return background_fixtures.result(__file__)


def test_spread_places_shards_on_every_node_and_stays_exact(scenarios):
    result = scenarios["spread"]
    # SPREAD over four one-CPU nodes (the head has none): one shard per node, every such node used.
    assert len(result["cpu_nodes"]) == 4
    assert sorted(result["shard_nodes"]) == result["cpu_nodes"]
    assert result["max_err"] < 1e-12, result
    assert all(n > 0 for n in result["blocks_used"])


def test_node_loss_with_replicas_moves_the_shard_to_a_spare_node_and_stays_exact(scenarios):
    result = scenarios["node_loss"]
    assert result["shards_replaced"] >= 1
    assert result["removed"] not in result["shard_nodes_after"]
    assert result["spare"] in result["shard_nodes_after"]
    assert result["max_err"] < 1e-12, result
