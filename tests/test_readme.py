"""The README's examples, extracted and run (or parsed) as printed, so the docs cannot drift from the code.

The cluster block (`ray start --head` ... `cpattn stop`) runs in tests/test_cli.py on the test's own head;
here: the ten-line client snippet, run the way a user who cloned into a directory named `cpattn` runs it
from the parent directory (issue 11, item 8), and every other command line of the README parsed by the
parser of the program it calls.
"""

from __future__ import annotations

import ast
import importlib.util
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import background_fixtures
from user_env import ROOT, kill_session, readme_blocks, user_env


def _run_client_snippet(background) -> dict:
    """The snippet run as printed, from the parent of a checkout named cpattn; tests/background_fixtures.py may
    run this at the session's start, beside other tests. Its exit status (None: not within 180 s) and output."""
    (snippet,) = [body for before, body in readme_blocks("python")]
    work = Path(tempfile.mkdtemp(prefix="cpattn-snippet-"))
    try:
        (work / "snippet.py").write_text(snippet)
        (work / "cpattn").symlink_to(ROOT, target_is_directory=True)   # a checkout named cpattn, next to it
        proc = subprocess.Popen([sys.executable, "snippet.py"], cwd=work, env=user_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            out, err = background_fixtures.communicate(proc, 180, background.aborted)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            return {"snippet": snippet, "returncode": None, "out": out, "err": err}
        finally:
            kill_session(proc.pid)
        return {"snippet": snippet, "returncode": proc.returncode, "out": out, "err": err}
    finally:
        shutil.rmtree(work, ignore_errors=True)


background_fixtures.register(__file__, _run_client_snippet, time_bounds=False)


def test_client_snippet_runs_as_printed_from_the_parent_of_a_cpattn_checkout():
    ran = background_fixtures.result(__file__)
    assert len(ran["snippet"].strip().splitlines()) == 10   # "The client API in ten lines"
    err = ran["err"]
    assert ran["returncode"] is not None, "the snippet did not finish within 180 s:\n" + err[-3000:]
    assert "has no attribute 'ServiceConfig'" not in err, "the cpattn directory shadowed the package:\n" + err
    assert ran["returncode"] == 0, err[-3000:]
    shards = ast.literal_eval(ran["out"].strip().splitlines()[-1])   # print(svc.stats()["shards"]): one dict per shard
    assert len(shards) == 4 and sum(s["tokens"] for s in shards) == 0   # the sequence was freed


def _command_lines() -> list[str]:
    lines = []
    for _, body in readme_blocks():
        lines += [line.strip() for line in body.splitlines() if line.strip()]
    return lines


def test_every_cpattn_command_in_the_readme_parses():
    from cpattn.launch.cli import _PASSTHROUGH, build_parser

    commands = [line for line in _command_lines() if line.startswith("cpattn ")]
    assert len(commands) >= 5
    for line in commands:
        argv = shlex.split(line, comments=True)[1:]
        if argv[0] in _PASSTHROUGH:
            continue
        try:
            build_parser().parse_args(argv)
        except SystemExit:
            pytest.fail(f"README command does not parse: {line}")


def test_every_long_context_job_command_in_the_readme_parses():
    spec = importlib.util.spec_from_file_location("long_context_job", ROOT / "examples" / "long_context_job.py")
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)
    found = 0
    for line in _command_lines():
        argv = shlex.split(line, comments=True)
        if "examples/long_context_job.py" not in argv:
            continue
        found += 1
        try:
            job.parse_args(argv[argv.index("examples/long_context_job.py") + 1:])
        except SystemExit:
            pytest.fail(f"README job command does not parse: {line}")
    assert found >= 3


def test_readme_scripts_exist():
    for line in _command_lines():
        argv = shlex.split(line, comments=True)
        if argv and argv[0] == "bash":
            assert (ROOT / argv[1]).exists(), line
