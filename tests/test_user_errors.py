"""Issue 11: what a user meets when something is wrong is one line (CLI) or one CpattnError that keeps its cause
(API), within seconds: unreachable addresses, no Ray at all, a missing or broken -c file, a backend that cannot
serve; and no noise on every run (setup.sh, numpy)."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from cpattn.errors import BackendUnavailableError, ConfigError, CpattnError, ServiceError
from user_env import ANSI, CPATTN, ROOT, user_env


def _closed_port() -> int:
    """A port nothing listens on (bound and released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# "Within seconds": the command's own start (Python, Ray's import) is ~3 s on a quiet 2-core box and 10+ under a
# loaded one; the failures these guard against took 13 minutes (Ray's connection retries) or a whole Ray start.
WITHIN_SECONDS = 30


def _cli(args: list[str], timeout: float = 60, **env) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    result = subprocess.run([*CPATTN, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                            env=user_env(**env))
    return result, time.monotonic() - t0


def _one_error_line(result: subprocess.CompletedProcess, command: str) -> str:
    err = result.stderr.strip()
    assert result.returncode == 1, (result.returncode, err)
    assert len(err.splitlines()) == 1 and err.startswith(f"cpattn {command}: error: "), err
    return err


# Item 3: unreachable addresses fail within seconds (Ray retried 20 x ~41 s: 13 min 41 s) ----------------------
@pytest.mark.parametrize("command", [["status"], ["stop"], ["serve", "--num-shards", "1"]])
def test_unreachable_address_fails_within_seconds(command):
    address = f"127.0.0.1:{_closed_port()}"
    result, took = _cli([*command, "--address", address])
    err = _one_error_line(result, command[0])
    assert f"cannot reach the Ray cluster at {address}" in err and "Connection refused" in err, err
    assert took < WITHIN_SECONDS, took


def test_submit_to_an_unreachable_job_server_fails_within_seconds():
    url = f"http://127.0.0.1:{_closed_port()}"
    result, took = _cli(["submit", "--address", url, "--", "python", "x.py"])
    err = _one_error_line(result, "submit")
    assert f"cannot reach the Ray job server (dashboard) at {url}" in err, err
    assert took < WITHIN_SECONDS, took


def test_connect_to_an_unreachable_address_raises_service_error_within_seconds():
    address = f"127.0.0.1:{_closed_port()}"
    script = textwrap.dedent(f"""
        import time, cpattn
        t0 = time.monotonic()
        try:
            cpattn.connect(address={address!r})
        except cpattn.CpattnError as exc:
            print(type(exc).__name__, type(exc.__cause__).__name__, round(time.monotonic() - t0, 2))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                         env=user_env()).stdout.split()
    assert out[:2] == ["ServiceError", "ConnectionRefusedError"] and float(out[2]) < 10, out


@pytest.mark.parametrize("scheme, expected", [("", "does not answer as a Ray cluster's GCS"),
                                              ("ray://", "does not answer as a Ray Client server")])
def test_a_port_that_is_not_a_ray_gcs_fails_within_seconds(scheme, expected):
    """Something accepts the connection but never answers as a GCS (or a Ray Client server): one bounded probe,
    not 20 x 41 s (Ray Client: 30 s, then "check the port"). (In a process of its own: the probe sets Ray's
    config for a moment, which a live Ray session must not see.)"""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    accepted = []
    threading.Thread(target=lambda: accepted.append(listener.accept()), daemon=True).start()
    script = textwrap.dedent(f"""
        import time
        from cpattn.cluster import reach
        from cpattn.errors import ServiceError
        reach.GCS_PROBE_TIMEOUT_S = 1   # bounds the probe to ~3 s (2 in use)
        t0 = time.monotonic()
        try:
            reach.prepare_cluster("{scheme}127.0.0.1:{listener.getsockname()[1]}")
        except ServiceError as exc:
            print(round(time.monotonic() - t0, 2), exc)
    """)
    try:
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                             env=user_env()).stdout
    finally:
        listener.close()
    took, _, message = out.partition(" ")
    assert f"accepts connections but {expected}" in message, out
    assert float(took) < 10


# Item 5: one error family --------------------------------------------------------------------------------------
def test_no_ray_running_is_a_service_error_with_its_cause(tmp_path):
    """cpattn.connect() with no cluster on the machine: a raw ConnectionError before. Other engineers' and this
    suite's own Ray instances run on this machine, so the test hides them: an empty RAY_TMPDIR (no cluster
    recorded by `ray start`) and no local GCS process found."""
    script = textwrap.dedent("""
        import functools, ray._private.services as services
        services.find_gcs_addresses = functools.lru_cache()(lambda: [])   # no GCS process on this machine
        import cpattn
        try:
            cpattn.connect()
        except cpattn.CpattnError as exc:
            print(type(exc).__name__, type(exc.__cause__).__name__)
            print(exc)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                            env=user_env(RAY_TMPDIR=str(tmp_path)))
    assert result.stdout.splitlines()[0] == "ServiceError ConnectionError", result.stdout + result.stderr
    assert "no running Ray cluster found on this machine" in result.stdout and "ray start --head" in result.stdout


def test_missing_and_broken_config_files(tmp_path, capsys):
    from cpattn.config import load_config
    from cpattn.launch.cli import main

    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match="does not exist") as exc:
        load_config(missing)
    assert isinstance(exc.value.__cause__, FileNotFoundError)
    assert main(["serve", "-c", str(missing)]) == 1
    assert capsys.readouterr().err == f"cpattn serve: error: config file '{missing}' does not exist: check the " \
                                      "path (e.g. examples/service_local.yaml, relative to the current directory)\n"

    broken = tmp_path / "broken.yaml"
    broken.write_text("num_shards: 4\n  block_size: [16\n")
    import yaml

    with pytest.raises(ConfigError, match=r"broken.yaml, line 2, column 13: invalid YAML") as exc:
        load_config(broken)
    assert isinstance(exc.value.__cause__, yaml.YAMLError)
    assert main(["serve", "-c", str(broken)]) == 1
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and f"{broken}, line 2, column 13: invalid YAML" in err, err


def test_ray_errors_reach_the_cli_user_as_one_line(monkeypatch, capsys):
    """An error from Ray that cpattn did not wrap still ends the command with one line and status 1."""
    import ray

    from cpattn.launch import cli, status

    def lost(*args, **kwargs):
        raise ray.exceptions.RaySystemError("\x1b[31mGCS connection lost\x1b[0m\nremote frames ...")

    monkeypatch.setattr(status, "attach", lost)
    assert cli.main(["status"]) == 1
    err = capsys.readouterr().err
    assert err == "cpattn status: error: RaySystemError: System error: GCS connection lost (CPATTN_DEBUG=1 shows " \
                  "the traceback)\n", err


# Item 6: a backend that cannot serve, reported once, before anything starts -------------------------------------
def test_serve_with_a_backend_that_cannot_serve_fails_before_ray_starts():
    result, took = _cli(["serve", "--backend", "FLASHINFER", "--num-shards", "2"])
    err = result.stderr
    assert result.returncode == 1 and took < WITHIN_SECONDS, (took, err)
    assert "Traceback" not in err and not ANSI.search(err) and "ray::" not in err, err
    assert err.startswith("cpattn serve: error: attention backend FLASHINFER cannot serve ")
    assert err.count("FLASHINFER: device cpu not supported (supports cuda)") == 1, err
    assert "embedded Ray" not in result.stdout and "Token authentication" not in err   # Ray never started


def test_start_with_a_backend_that_cannot_serve_raises_before_anything_starts(nothing_may_start):
    import cpattn

    cfg = cpattn.ServiceConfig(num_shards=2, num_layers=1, num_q_heads=2, num_kv_heads=1, head_size=8,
                               backend="FLASHINFER", dtype="float32")
    with pytest.raises(BackendUnavailableError) as exc:
        cpattn.start(cfg)
    assert isinstance(exc.value, CpattnError)
    assert "device cpu not supported (supports cuda)" in exc.value.reasons["FLASHINFER"]


def test_shard_creation_errors_are_reported_without_remote_frames():
    """GPU shards select their backend where they run; what Ray reports for a shard's failed __init__ is
    reduced to the cpattn error and its reasons."""
    from cpattn.cluster.shard_set import creation_error

    ray_text = ("The actor died because of an error raised in its creation task, \x1b[36mray::svc-shard-0:"
                "ShardWorker.__init__()\x1b[39m (pid=1, ip=10.0.0.1)\n  File \"shard.py\", line 65, in __init__\n"
                "    self.backend = get_attn_backend(\n           ^^^^^^\n"
                "cpattn.errors.BackendUnavailableError: attention backend FLASHINFER cannot serve head_size=100\n"
                "  FLASHINFER: head_size 100 not supported\n")
    assert creation_error(RuntimeError(ray_text)) == ("BackendUnavailableError: attention backend FLASHINFER cannot "
                                                      "serve head_size=100\n  FLASHINFER: head_size 100 not supported")


# Item 7: no noise on every run ---------------------------------------------------------------------------------
def test_setup_is_silent_and_quick_when_nothing_changed():
    subprocess.run(["bash", "scripts/setup.sh"], cwd=ROOT, capture_output=True, timeout=600, check=True)
    t0 = time.monotonic()
    again = subprocess.run(["bash", "scripts/setup.sh"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and again.stdout == "" and again.stderr == "", again.stderr
    assert time.monotonic() - t0 < 5


def test_numpy_is_a_declared_dependency():
    tomllib = pytest.importorskip("tomllib")
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(d.split(">")[0].split("=")[0].strip() == "numpy" for d in deps), deps


def test_start_and_connect_arguments_are_checked_before_ray():
    """cpattn.start("x") raised AttributeError, start(config, num_shards=2) dropped the keywords silently, and
    connect(name=123) / timeout_s=nan raised TypeError or ValueError from inside Ray."""
    import cpattn
    from cpattn.errors import InvalidRequestError

    for args, kwargs, match in ((("x",), {}, "takes a cpattn.ServiceConfig or its fields as keywords, got str"),
                                ((cpattn.ServiceConfig(),), {"num_shards": 2}, "got ServiceConfig and fields num_shards")):
        with pytest.raises(ConfigError, match=match):
            cpattn.start(*args, **kwargs)
    for kwargs, match in ((dict(name=123), r"name 123 must be the service's name, a non-empty str"),
                          (dict(namespace=""), r"namespace '' must be"),
                          (dict(timeout_s=float("nan")), r"timeout_s nan must be a number of seconds in \(0, 86400\]"),
                          (dict(timeout_s=-1), "timeout_s -1 must be"), (dict(timeout_s=True), "timeout_s True must")):
        with pytest.raises(InvalidRequestError, match=match):
            cpattn.connect(**kwargs)


def test_a_serve_that_fails_after_its_coordinator_started_leaves_nothing(ray_session, monkeypatch):
    """`cpattn serve --rpc-timeout-s 0.001` timed out reading the started service and exited, leaving a detached
    coordinator, shards and placement group whose operator credential was never printed: nobody could stop them.
    The read times out here by injection: with a real 1 ms bound the answer sometimes came in time (CI, 2026-12-07),
    and the test then failed and left that service running."""
    import ray
    from ray.util import get_placement_group

    import cpattn.cluster.service as service
    from cpattn.cluster.placement import placement_group_name, shard_actor_name
    from cpattn.launch.cli import build_parser
    from cpattn.launch.serve import serve
    from service_oracle import unique_name

    real_launch, real_get, launched = service.launch_coordinator, ray.get, []

    def launch(*args, **kwargs):
        launched.append(real_launch(*args, **kwargs))
        return launched[-1]

    def get(refs, *args, **kwargs):
        if launched and not hasattr(launch, "timed_out"):   # the first read of the started service
            launch.timed_out = True
            raise ray.exceptions.GetTimeoutError("injected: no answer within rpc_timeout_s")
        return real_get(refs, *args, **kwargs)

    monkeypatch.setattr(service, "launch_coordinator", launch)
    monkeypatch.setattr(ray, "get", get)
    name = unique_name("serve-fails")
    args = build_parser().parse_args(["serve", "--name", name, "--num-shards", "1", "--num-layers", "1",
                                      "--num-q-heads", "2", "--num-kv-heads", "1", "--head-size", "8", "--block-size",
                                      "4", "--dtype", "float64", "--num-cpus-per-shard", "0.25",
                                      "--num-blocks-per-shard", "8", "--rpc-timeout-s", "10"])
    with pytest.raises(CpattnError, match="did not answer within rpc_timeout_s=10s, and was stopped"):
        serve(args)
    assert launched and launch.timed_out
    monkeypatch.undo()
    for actor in (name, shard_actor_name(name, 0)):
        with pytest.raises(ValueError):
            ray.get_actor(actor, namespace="cpattn")
    with pytest.raises(ValueError):
        get_placement_group(placement_group_name(name))


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a machine with CUDA serves device='cuda'")
def test_device_cuda_without_cuda_is_one_line_naming_num_gpus_per_shard():
    """A shard failed with AttributeError: module 'torch._C' has no attribute '_cuda_setDevice' (and `cpattn serve`
    printed it as a 14-line remote traceback). The shard's constructor, as its actor runs it."""
    from conftest import service_config
    from cpattn.cluster.shard import ShardWorker

    with pytest.raises(ConfigError, match=r"shard 0: device 'cuda', but this shard's process sees no CUDA device: "
                                          r"give shards GPUs with num_gpus_per_shard > 0 \(now 0\)"):
        ShardWorker(service_config(num_shards=1, device="cuda", backend="TORCH"), 0)


@pytest.mark.parametrize("failures", [2, 3])
def test_a_ray_client_connection_whose_server_failed_to_start_is_tried_again(monkeypatch, capsys, failures):
    """Ray 2.60's Ray Client server fails to start about 1 connection's server in 5 on a busy machine (seen in CI
    as `cpattn serve: error: ... (Initialization failure from server:)`, its cause cut off): each of the first
    attempts says why it is tried again, and a last failure names the server's own last line."""
    import ray

    from cpattn.cluster import reach

    calls = []

    def init(**kwargs):
        calls.append(kwargs["address"])
        if len(calls) <= failures:
            raise ConnectionAbortedError("Initialization failure from server:\nTraceback (most recent call last):\n"
                                         "  File \"proxier.py\", line 772, in Datapath\nRuntimeError: Starting Ray "
                                         "client server failed. See ray_client_server_23002.err for detailed logs.")

    monkeypatch.setattr(reach, "prepare_cluster", lambda address: address)
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    if failures < reach.RAY_CLIENT_ATTEMPTS:
        reach.join_cluster("ray://head:10001", "ns")
    else:
        with pytest.raises(ServiceError, match=r"cannot connect to the Ray cluster at ray://head:10001 \(Initialization "
                                               r"failure from server: RuntimeError: Starting Ray client server failed"):
            reach.join_cluster("ray://head:10001", "ns")
    assert calls == ["ray://head:10001"] * min(failures + 1, reach.RAY_CLIENT_ATTEMPTS)
    notices = [line for line in capsys.readouterr().err.splitlines() if line.startswith("cpattn: the Ray Client")]
    assert len(notices) == min(failures, reach.RAY_CLIENT_ATTEMPTS - 1)
    assert "could not start this connection's server (RuntimeError: Starting Ray client server failed" in notices[0]
