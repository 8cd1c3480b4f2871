"""The suite's lanes (tests/suite_lanes.py): every name they list exists, light modules start nothing, and the lock
keeps an alone test apart from heavy ones while light ones pass."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import pytest

import suite_lanes
from suite_lanes import ALONE_MODULES, ALONE_TESTS, LIGHT_MODULES, Lanes, lane

TESTS = Path(__file__).resolve().parent
STARTS_SOMETHING = re.compile(r"\bray\b|subprocess|multiprocessing|start_service|ray_session|cpattn\.start|connect\(")


def test_every_listed_module_and_test_exists():
    for module in ALONE_MODULES | LIGHT_MODULES:
        assert (TESTS / module).exists(), module
    for test in ALONE_TESTS:
        module, name = test.split("::")
        assert re.search(rf"^def {name}\(", (TESTS / module).read_text(), re.M), test
    assert not ALONE_MODULES & LIGHT_MODULES


@pytest.mark.parametrize("module", sorted(LIGHT_MODULES - {"test_suite_lanes.py"}))
def test_light_modules_start_no_ray_and_no_process(module):
    found = STARTS_SOMETHING.findall((TESTS / module).read_text())
    assert not found, f"{module} uses {sorted(set(found))}: it is not light (tests/suite_lanes.py)"


def test_lane_of_a_node_id():
    assert lane("tests/test_reliability_chaos.py::test_random_shard_kills_during_a_workload") == "alone"
    assert lane("tests/test_cli.py::test_serve_embedded_stops_cleanly_however_it_is_told") == "alone"
    assert lane("tests/test_cli.py::test_readme_cluster_walkthrough") == "heavy"
    assert lane("tests/test_kvstore.py::test_x[1-2]") == "light"
    assert lane("tests/test_reliability_authority.py::test_the_actors_expose_only_their_tables") == "heavy"


def _acquired_within(lanes: Lanes, kind: str, seconds: float) -> tuple[bool, threading.Event]:
    """Try ``kind`` in a thread; whether it got in within ``seconds``, and the event that lets it out."""
    got, release = threading.Event(), threading.Event()

    def run():
        with lanes.hold(kind):
            got.set()
            release.wait(10)

    threading.Thread(target=run, daemon=True).start()
    return got.wait(seconds), release


def test_alone_excludes_heavy_and_lets_light_pass(tmp_path):
    base = tmp_path / "lanes"
    first, second, third = Lanes(base), Lanes(base), Lanes(base)   # one per worker: separate open files
    with first.hold("alone"):
        assert _acquired_within(second, "light", 1.0)[0]
        heavy_in, let_heavy_out = _acquired_within(second, "heavy", 0.5)
        assert not heavy_in
    assert _acquired_within(third, "light", 1.0)[0]
    time.sleep(0.2)
    let_heavy_out.set()
    # Two heavy tests share; an alone test waits for both.
    with first.hold("heavy"):
        assert _acquired_within(second, "heavy", 1.0)[0]
        alone_in, _ = _acquired_within(third, "alone", 0.5)
        assert not alone_in
    suite_lanes.remove(base)


@pytest.mark.skipif(__import__("os").geteuid() != 0, reason="going back to a lower nice value needs root")
def test_a_light_test_runs_at_nice_19_and_gets_its_priority_back(tmp_path):
    import os

    lanes = Lanes(tmp_path / "lanes")
    before = os.getpriority(os.PRIO_PROCESS, 0)
    with lanes.hold("light"):
        assert os.getpriority(os.PRIO_PROCESS, 0) == 19
    assert os.getpriority(os.PRIO_PROCESS, 0) == before
    suite_lanes.remove(tmp_path / "lanes")
