"""Import a script of examples/ as a module (the job's tests, CPU and GPU)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load_example(name: str):
    sys.path.insert(0, str(EXAMPLES))   # the job's own modules (job_args.py, ...) import each other
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module   # as an import would (dataclasses resolve their annotations through it)
    spec.loader.exec_module(module)
    return module
