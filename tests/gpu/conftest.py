"""GPU tests without CUDA: left out of the run and reported as skipped in one summary line (not one `s` mark and
one summary line per test), so a CPU run's output shows what ran; the final count still includes them."""

import sys
from pathlib import Path

import pytest
import torch

NO_CUDA, NO_CUDA_LINE = "needs CUDA (run on the GPU machine)", sys._getframe().f_lineno


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    gpu = [item for item in items if "gpu" in item.keywords]
    if not gpu:
        return
    items[:] = [item for item in items if "gpu" not in item.keywords]
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        return
    where = str(Path(__file__).relative_to(config.rootpath)) if Path(__file__).is_relative_to(config.rootpath) \
        else __file__
    for item in gpu:   # counted as skipped; -ra folds them into one line (same place, same reason)
        reporter.stats.setdefault("skipped", []).append(pytest.TestReport(
            item.nodeid, item.location, {"gpu": 1}, "skipped", (where, NO_CUDA_LINE, f"Skipped: {NO_CUDA}"), "call"))
