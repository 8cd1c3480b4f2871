"""Size goals of issue 19: no file over 400 lines in cpattn/, no class over 250 lines.

Measured with ast (a class spans from its ``class`` line to its last line). ``PENDING`` may list what is
over a limit while its split waits, with its size then: the test fails when anything else goes over, when a
pending entry grows, and when a pending entry has come under its limit (then delete the entry), so the list
only shrinks. It is empty: everything is within the limits.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_FILE_LINES = 400
MAX_CLASS_LINES = 250

# What is over a limit and waits for its split (none since issue 19): (kind, path[:class]) -> lines.
PENDING: dict[tuple[str, str], int] = {}


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
