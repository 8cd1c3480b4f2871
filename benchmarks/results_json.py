"""The JSON a benchmark writes beside its printed table: ``{"meta": ..., <rows>}`` at ``--json``."""

from __future__ import annotations

import json
import platform
from datetime import date
from pathlib import Path

import torch


def base_meta() -> dict:
    """What every result records: the date, the machine and torch's version."""
    return {"date": date.today().isoformat(), "machine": platform.node(), "torch": torch.__version__}


def write_results(path: str | Path, meta: dict, **payload) -> Path:
    """``{"meta": meta, **payload}`` to ``path`` (its folder made), and the line saying so."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, **payload}, indent=1))
    print(f"wrote {out}")
    return out
