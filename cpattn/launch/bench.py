"""``cpattn bench``: run ``benchmarks/service_bench.py`` from the checkout, passing every argument on."""

from __future__ import annotations

import importlib.util
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
    # In this process, under its own name: `cpattn bench --help` says `usage: cpattn bench`, and errors go
    # through cpattn's one-line handling.
    spec = importlib.util.spec_from_file_location("service_bench", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(argv, prog="cpattn bench")
