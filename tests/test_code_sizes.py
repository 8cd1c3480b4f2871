"""Size goals of issue 19: no file over 400 lines in cpattn/, no class over 250 lines.

Measured with ast (a class spans from its ``class`` line to its last line). ``PENDING`` lists what is
still over a limit, with its size when the entry was written: the test fails when anything else goes over,
when a pending entry grows, and when a pending entry has come under its limit (then delete the entry),
so the list only shrinks.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_FILE_LINES = 400
MAX_CLASS_LINES = 250

# Split once issue 18's decode work there has settled (issue 19, part e): (kind, path[:class]) -> size.
PENDING = {
    ("file", "cpattn/cluster/shard.py"): 529,
    ("class", "cpattn/cluster/shard.py:ShardWorker"): 453,
    ("file", "cpattn/cluster/gateway.py"): 420,
    ("class", "cpattn/cluster/gateway.py:Gateway"): 345,
    ("class", "cpattn/step.py:Step"): 279,
}


def measure() -> dict[tuple[str, str], int]:
    """Every file and class of cpattn/ over its limit: (kind, name) -> lines."""
    over = {}
    for path in sorted((ROOT / "cpattn").rglob("*.py")):
        name = path.relative_to(ROOT).as_posix()
        text = path.read_text()
        if len(text.splitlines()) > MAX_FILE_LINES:
            over[("file", name)] = len(text.splitlines())
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                over[("class", f"{name}:{node.name}")] = node.end_lineno - node.lineno + 1
    return over


def test_no_file_or_class_over_its_limit():
    over = measure()
    new = {k: v for k, v in over.items() if k not in PENDING}
    assert not new, (f"over the limits ({MAX_FILE_LINES} lines a file, {MAX_CLASS_LINES} a class): {new}; split "
                     "by concern (a state owner, a helper module) rather than raising a limit")
    grown = {k: (PENDING[k], v) for k, v in over.items() if k in PENDING and v > PENDING[k]}
    assert not grown, f"pending splits grew (was, now): {grown}; move the new code to its own module"
    done = sorted(k for k in PENDING if k not in over)
    assert not done, f"{done} are now under their limit: delete them from PENDING"
