"""``cpattn submit``: a Ray job through the Job Submission SDK, logs streamed, exit code = job status."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time

from cpattn.errors import ConfigError, ServiceError

# Never uploaded with the working directory: environments, VCS data and caches.
DEFAULT_EXCLUDES = [".venv", "venv", ".git", "__pycache__", "*.pyc", ".pytest_cache", ".hypothesis", "out"]
POLL_S = 2.0             # the job's status, read while its logs stream
NOTICE_EVERY_S = 30.0    # a pending job's reminder


def build_runtime_env(args: argparse.Namespace) -> dict:
    env_vars = {}
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--env {item!r} is not KEY=VALUE: write e.g. --env CPATTN_SHARDS=8")
        env_vars[key] = value
    runtime_env: dict = {"working_dir": args.working_dir, "excludes": list(DEFAULT_EXCLUDES)}
    if env_vars:
        runtime_env["env_vars"] = env_vars
    if args.pip:
        runtime_env["pip"] = list(args.pip)
    return runtime_env


def submit(args: argparse.Namespace) -> int:
    entrypoint = list(args.entrypoint)
    if entrypoint and entrypoint[0] == "--":
        entrypoint = entrypoint[1:]
    if not entrypoint:
        raise ConfigError("submit needs a command after `--`: e.g. cpattn submit -- python examples/long_context_job.py")
    import logging
    import shlex

    from ray.job_submission import JobStatus

    # Ray's SDK logs INFO lines on every job (packaging, upload, websocket), and warns that .git and .venv are
    # now left out of working_dir uploads, which DEFAULT_EXCLUDES already does.
    for name in ("ray.dashboard.modules.dashboard_sdk", "ray.dashboard.modules.job.sdk",
                 "ray._private.runtime_env.packaging"):
        logging.getLogger(name).setLevel(logging.WARNING)
    logging.getLogger("ray._private.runtime_env.working_dir").setLevel(logging.ERROR)

    runtime_env = build_runtime_env(args)   # its own errors before the job server is asked anything
    client = connect_job_server(args.address)
    try:
        job_id = _submit_with_retry(client, entrypoint=shlex.join(entrypoint), runtime_env=runtime_env,
                                    submission_id=args.submission_id, entrypoint_num_cpus=args.entrypoint_num_cpus,
                                    entrypoint_num_gpus=args.entrypoint_num_gpus)
    except (RuntimeError, ValueError, OSError, ray_error()) as exc:
        raise ServiceError(f"the job server at {client.get_address()} refused the job: {_first_line(exc)}") from exc
    print(f"submitted job {job_id}", file=sys.stderr, flush=True)
    if args.no_wait:
        print(job_id)
        return 0
    # A supervisor's SIGTERM (systemd, a CI runner, `kill`) stops the job as Ctrl-C does: never left running.
    signal.signal(signal.SIGTERM, _terminated)
    try:
        asyncio.run(_follow(client, job_id, args.pending_timeout_s, _waiting_for(args)))
        job_status = _final_status(client, job_id)
    except (KeyboardInterrupt, Terminated) as stop:
        client.stop_job(job_id)
        print(f"stopping job {job_id}", file=sys.stderr)
        return 143 if isinstance(stop, Terminated) else 130
    except (RuntimeError, ValueError, OSError, ray_error()) as exc:
        raise ServiceError(f"lost the job server at {client.get_address()} while following job {job_id}: "
                           f"{_first_line(exc)} (`ray job status {job_id}` shows it)") from exc
    why = "" if job_status == JobStatus.SUCCEEDED else _status_message(client, job_id)
    print(f"job {job_id} {job_status.value}{': ' + why if why else ''}", file=sys.stderr)
    return {JobStatus.SUCCEEDED: 0, JobStatus.STOPPED: 2}.get(job_status, 1)


def connect_job_server(address: str | None):
    """A JobSubmissionClient for ``address`` (a dashboard URL, a GCS address or 'auto'; default RAY_ADDRESS,
    else the cluster on this machine), checked first: reachable within seconds, a Ray job server, and with
    Ray's token authentication when the cluster asks for it. Raises ServiceError saying what to check."""
    import os

    from ray.job_submission import JobSubmissionClient

    from cpattn.cluster.reach import prepare_job_server

    url = prepare_job_server(address or os.environ.get("RAY_API_SERVER_ADDRESS") or os.environ.get("RAY_ADDRESS"))
    # Ray's SDK lets these variables override its address argument; the URL checked above is the one to use.
    os.environ.pop("RAY_API_SERVER_ADDRESS", None)
    os.environ.pop("RAY_ADDRESS", None)
    try:
        return JobSubmissionClient(url)
    except (RuntimeError, ValueError, OSError, ray_error()) as exc:
        raise ServiceError(f"cannot use the Ray job server at {url}: {_first_line(exc)}") from exc


def ray_error() -> type:
    from ray.exceptions import RayError

    return RayError


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _submit_with_retry(client, timeout_s: float = 60.0, **job) -> str:
    """submit_job, retried while a freshly started cluster's job agent is not up yet (HTTP 500 'No available agent')."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return client.submit_job(**job)
        except RuntimeError as exc:
            if "No available agent" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(1.0)


class Terminated(Exception):
    """SIGTERM arrived while a job was followed."""


def _terminated(signum, frame) -> None:
    raise Terminated()


def _waiting_for(args: argparse.Namespace) -> str:
    """What a PENDING job waits for: a node with the entrypoint's resources, and its runtime_env being set up."""
    asked = [f"{n:g} {kind}" for n, kind in ((args.entrypoint_num_gpus, "GPU"), (args.entrypoint_num_cpus, "CPU"))
             if n]
    setup = "its runtime_env (working_dir upload" + (", pip installs" if args.pip else "") + ") to be set up"
    return f"a node with {' and '.join(asked)} free, or {setup}" if asked else setup


async def _follow(client, job_id: str, pending_timeout_s: float, waiting_for: str) -> None:
    """Stream the job's logs until they end. While the job is PENDING (no node has what the entrypoint asked
    for free, or its runtime_env is being set up), say so every NOTICE_EVERY_S; past ``pending_timeout_s`` stop it and raise ServiceError (Ray itself
    would wait RAY_JOB_START_TIMEOUT_SECONDS, 15 minutes, in silence)."""
    from ray.job_submission import JobStatus

    tail = asyncio.ensure_future(_stream_logs(client, job_id))
    started, notice_at = time.monotonic(), NOTICE_EVERY_S
    try:
        while not tail.done():
            if await asyncio.to_thread(client.get_job_status, job_id) != JobStatus.PENDING:
                await tail
                return
            waited = time.monotonic() - started
            if waited > pending_timeout_s:
                await asyncio.to_thread(client.stop_job, job_id)
                raise ServiceError(f"job {job_id} did not start within --pending-timeout-s={pending_timeout_s:g}: "
                                   f"it was waiting for {waiting_for}. It was told to stop (Ray lists it as PENDING until "
                                   "its start timeout, RAY_JOB_START_TIMEOUT_SECONDS, fails it). `ray status` shows "
                                   "what the cluster has: ask for less, add a node, or allow a larger "
                                   "--pending-timeout-s")
            if waited >= notice_at:
                notice_at += NOTICE_EVERY_S
                print(f"cpattn: job {job_id} pending for {waited:.0f}s: waiting for {waiting_for} "
                      f"(stopped after --pending-timeout-s={pending_timeout_s:g})", file=sys.stderr, flush=True)
            await asyncio.wait({tail}, timeout=POLL_S)
        await tail
    finally:
        tail.cancel()


async def _stream_logs(client, job_id: str) -> None:
    async for lines in client.tail_job_logs(job_id):
        print(lines, end="", flush=True)


def _status_message(client, job_id: str) -> str:
    """Why a job did not succeed, as the job server says (a bad resource request says so only there)."""
    try:
        return (client.get_job_info(job_id).message or "").strip().splitlines()[0]
    except Exception:   # (an empty message, or the server gone: the status alone is printed)
        return ""


def _final_status(client, job_id: str):
    # The log stream can end a moment before the job's status turns terminal.
    deadline = time.monotonic() + 30
    while True:
        job_status = client.get_job_status(job_id)
        if job_status.is_terminal() or time.monotonic() > deadline:
            return job_status
        time.sleep(0.5)
