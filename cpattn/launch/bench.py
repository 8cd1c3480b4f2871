"""``cpattn bench``: run ``benchmarks/service_bench.py`` from the checkout, passing every argument on."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def find_bench_script() -> Path | None:
    """benchmarks/service_bench.py in the current directory, else in the checkout cpattn was installed from."""
    candidates = [Path.cwd() / "benchmarks" / "service_bench.py",
                  Path(__file__).resolve().parents[2] / "benchmarks" / "service_bench.py"]
    return next((p for p in candidates if p.is_file()), None)


def main(argv: list[str]) -> int:
    script = find_bench_script()
    if script is None:
        print("cpattn bench: benchmarks/service_bench.py not found: run from a cpattn checkout "
              "(the benchmark is not part of the installed package)", file=sys.stderr)
        return 1
    # A subprocess: the benchmark owns its Ray instance and its argument parser (`cpattn bench --help`).
    env = dict(os.environ)
    root = str(script.parents[1])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return subprocess.call([sys.executable, str(script), *argv], env=env)
