"""Running commands as a user does: the environment a user has, the `cpattn` console script, and cleanup of
the Ray processes a test started (by their session id: never `ray stop`, which stops every Ray on the machine)."""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
# The console script pip installed, as a user types it; the module where the test runs outside the venv.
CPATTN = [str(BIN / "cpattn")] if (BIN / "cpattn").exists() else [sys.executable, "-m", "cpattn.launch.cli"]


def user_env(**extra) -> dict:
    """This process's environment minus what a user would not have: no RAY_AUTH_MODE (Ray 2.60's default,
    token auth, applies; this pytest process's own ray.init switches it to token mode), no
    RAY_ADDRESS, no PYTHONPATH (the installed package runs). The venv's bin first on PATH, as after
    `source .venv/bin/activate`."""
    drop = {"RAY_AUTH_MODE", "RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "PYTHONPATH"}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env.update(extra)
    return env


def command(line: str) -> list[str]:
    """A README command line -> argv: the comment dropped, `cpattn` as the console script."""
    import shlex

    argv = shlex.split(line, comments=True)
    if argv and argv[0] == "cpattn":
        argv = CPATTN + argv[1:]
    elif argv and argv[0] in ("ray", "python"):
        argv = [str(BIN / argv[0]) if (BIN / argv[0]).exists() else argv[0]] + argv[1:]
    return argv


def session_pids(sid: int) -> list[int]:
    """Processes of session ``sid`` (a process started with start_new_session=True and everything it spawned:
    Ray puts its workers in process groups of their own, but they stay in the session)."""
    import ray  # noqa: F401  (puts the psutil Ray bundles on sys.path)
    import psutil

    pids = []
    for proc in psutil.process_iter(["pid", "status"]):
        try:
            if proc.info["status"] != psutil.STATUS_ZOMBIE and os.getsid(proc.info["pid"]) == sid:
                pids.append(proc.info["pid"])
        except (ProcessLookupError, PermissionError, psutil.Error):
            pass
    return pids


def wait_session_empty(sid: int, timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while True:
        left = session_pids(sid)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def kill_session(sid: int) -> None:
    """SIGKILL every process of session ``sid`` (only ever one this test started)."""
    for pid in session_pids(sid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    wait_session_empty(sid, 10)


ANSI = re.compile(r"\x1b\[[0-9;]*m")


def readme_blocks(language: str = "") -> list[tuple[str, str]]:
    """(the line before the block, the block's text) for every fenced block of README.md in ``language``."""
    lines = (ROOT / "README.md").read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].startswith("```"):
            lang, before, body = lines[i][3:].strip(), lines[i - 1] if i else "", []
            i += 1
            while i < len(lines) and not lines[i].startswith("```"):
                body.append(lines[i])
                i += 1
            if lang == language:
                blocks.append((before, "\n".join(body) + "\n"))
        i += 1
    return blocks


def readme_block(marker: str) -> list[str]:
    """The command lines of the README block right after the HTML comment naming ``marker``."""
    found = [body for before, body in readme_blocks() if marker in before]
    assert len(found) == 1, f"README.md has no single block marked {marker!r}"
    return [line for line in found[0].splitlines() if line.strip()]
