"""The `cpattn` command: help, config precedence and errors, status in-process, and a full round trip
(serve --address, a client in another process, status, submit, stop) on a Ray head of the test's own.

Every subprocess runs with the environment a user has (tests/user_env.py): no RAY_AUTH_MODE, so Ray 2.60's
default token authentication applies exactly as it does after `ray start --head`."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from cpattn.errors import ConfigError
from cpattn.launch.cli import build_parser, main
from cpattn.launch.serve import EmbeddedServer
from user_env import CPATTN, ROOT, command, kill_session, readme_block, user_env, wait_session_empty

CLI = CPATTN
SMALL = ["--num-shards", "2", "--num-layers", "1", "--num-q-heads", "2", "--num-kv-heads", "1", "--head-size", "8",
         "--block-size", "4", "--dtype", "float64", "--num-cpus-per-shard", "0.25", "--num-blocks-per-shard", "32"]
BANNER = "Token authentication is enabled"   # Ray's banner; cpattn's commands set the mode and do not print it
# A signalled serve stops the service, then Ray, each step bounded: ~2.5 s on a quiet 2-core box, once 10.4 s on CI
# with three instances stopping at once. The bound is serve's own plus 5 s; the regression it guards took 60-85 s.
STOP_BOUND_S = EmbeddedServer.STOP_TIMEOUT_S + EmbeddedServer.SHUTDOWN_TIMEOUT_S + 5


def _run(args, timeout=90, env=None, **kw):
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env or user_env(),
                          **kw)


# Help and config ----------------------------------------------------------------------------------
@pytest.mark.parametrize("command", [[], ["serve"], ["status"], ["stop"], ["submit"]])
def test_help(command, capsys):
    with pytest.raises(SystemExit) as exc:
        main([*command, "--help"])
    assert exc.value.code == 0
    out = " ".join(capsys.readouterr().out.split())   # argparse wraps lines at the terminal width
    assert out.startswith("usage: cpattn")
    if command == ["serve"]:
        assert "--num-shards" in out and "blocks until Ctrl-C" in out and "DCP interleave size" in out


def test_top_level_help_lists_every_command(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for command in ("serve", "status", "stop", "submit", "bench", "demo"):
        assert command in out


def test_bench_help_names_itself_and_says_what_the_default_costs():
    result = _run([*CLI, "bench", "--help"], timeout=60)
    assert result.returncode == 0, result.stderr
    out = " ".join(result.stdout.split())
    assert out.startswith("usage: cpattn bench [-h] [--quick]") and "service_bench.py" not in out.split("]")[0]
    assert "The default grid takes about 9 minutes and 17 GB of memory" in out and "--quick takes under a minute" in out


def _serve_args(argv):
    return build_parser().parse_args(["serve", *argv])


def test_flags_override_yaml(tmp_path):
    from cpattn.launch.serve import config_from_args

    path = tmp_path / "svc.yaml"
    path.write_text("num_shards: 3\nnum_layers: 2\nnum_q_heads: 4\nnum_kv_heads: 2\nhead_size: 16\ndtype: float32\n"
                    "name: from-file\n")
    cfg = config_from_args(_serve_args(["-c", str(path), "--num-shards", "5", "--name", "from-flag",
                                        "--pcp-enabled", "false"]))
    assert (cfg.num_shards, cfg.num_layers, cfg.dtype, cfg.name, cfg.pcp_enabled) == (5, 2, "float32", "from-flag", False)
    assert cfg.detached is True and cfg.ray_address is None
    assert config_from_args(_serve_args(["-c", str(path), "--address", "auto"])).ray_address == "auto"
    assert config_from_args(_serve_args(["--num-shards", "2"])).num_shards == 2


def test_bad_values_name_field_value_and_fix(tmp_path, capsys):
    from cpattn.launch.serve import config_from_args

    with pytest.raises(ConfigError, match=r"num_shards='many'"):
        config_from_args(_serve_args(["--num-shards", "many"]))
    path = tmp_path / "svc.yaml"
    path.write_text("num_q_heads: 12\nnum_kv_heads: 8\n")
    with pytest.raises(ConfigError, match=r"svc.yaml: .*num_q_heads 12 is not a multiple of num_kv_heads 8: pick"):
        config_from_args(_serve_args(["-c", str(path)]))
    path.write_text("num_shard: 4\n")
    with pytest.raises(ConfigError, match=r"unknown field 'num_shard': valid fields are num_shards"):
        config_from_args(_serve_args(["-c", str(path)]))
    # Through main: no Ray is started, the error goes to stderr, exit status 1.
    assert main(["serve", "--head-size", "100"]) == 1
    assert "head_size 100 must be a multiple of 8" in capsys.readouterr().err


def test_an_address_error_says_where_the_address_came_from(tmp_path):
    """A bad RAY_ADDRESS or YAML ray_address was blamed on --address, which the user never typed. Run as a user
    runs it (a process of its own: this one may already be attached to a Ray); each fails before any Ray starts."""
    from cpattn.launch.cli import _address_origin

    status = _run([*CLI, "status"], env=user_env(RAY_ADDRESS="not-an-address"), timeout=60)
    assert status.returncode == 1 and status.stderr.rstrip().endswith(
        "'not-an-address' is not host:port: write e.g. 10.0.0.5:6379 (the GCS port of `ray start --head`), or auto "
        "(that address came from RAY_ADDRESS: correct or unset it, or pass --address)"), status.stderr
    path = tmp_path / "svc.yaml"
    path.write_text("ray_address: 127.0.0.1:1\nnum_shards: 1\n")
    served = _run([*CLI, "serve", "-c", str(path)], timeout=60)
    assert served.returncode == 1 and "cannot reach the Ray cluster at 127.0.0.1:1" in served.stderr \
        and f"(that address came from ray_address in {path}: correct it there, or pass --address)" in served.stderr, \
        served.stderr
    typed = build_parser().parse_args(["status", "--address", "also-bad"])   # typed: nothing to add
    assert _address_origin(typed, "Ray address 'also-bad' is not host:port") == ""


def test_status_names_the_kernel_warm_up_of_gpu_shards():
    from cpattn.launch.status import format_status

    config = {"name": "gpu", "namespace": "ns", "dtype": "bfloat16", "block_size": 16, "dcp_interleave": 1,
              "placement_strategy": "PACK", "num_layers": 32, "num_q_heads": 32, "num_kv_heads": 8, "head_size": 128}
    shards = [{"rank": r, "node_id": "n1", "warmup_s": s, "backend": "FLASHINFER"} for r, s in ((0, 71.25), (1, 3.5))]
    rows = [{"rank": r, "node_ip": "10.0.0.1", "device": "cuda:0", "blocks_used": 0, "blocks_free": 9, "tokens": 0,
             "bytes": 0, "alive": True} for r in (0, 1)]
    stats = {"shards": rows, "num_sequences": 0, "steps_committed": 0, "steps_rolled_back": 0}
    text = format_status({"describe": {"config": config, "shards": shards}, "stats": stats})
    assert "kernels warmed at start in 71.2 s (the slowest of 2 GPU shard(s): mostly compiling)" in text, text


def test_list_tells_a_service_it_cannot_ask_from_one_that_does_not_answer():
    """`cpattn list` called every service whose operator credential is on another machine "not answering"."""
    from cpattn.launch.status import NO_CREDENTIAL, format_services

    shard = {"alive": True, "blocks_used": 3, "blocks_free": 5, "bytes": 2**20}
    table = format_services([
        {"name": "theirs", "namespace": "ns", "age_s": 5.0, "error": NO_CREDENTIAL},
        {"name": "hung", "namespace": "ns", "age_s": 5.0, "error": "GetTimeoutError"},
        {"name": "ours", "namespace": "ns", "age_s": 90.0,
         "stats": {"shards": [shard, dict(shard, alive=False)], "clients": {"c": {}}, "num_sequences": 4}}])
    rows = {line.split()[0]: line for line in table.splitlines()[1:]}
    assert "needs its operator credential" in rows["theirs"] and "not answering" not in rows["theirs"]
    assert "CPATTN_OPERATOR_CREDENTIAL" in rows["theirs"]
    assert rows["hung"].endswith("not answering (GetTimeoutError)")
    assert rows["ours"].split()[2:] == ["1/2", "1", "4", "6/16", "2.00", "2m"]


def test_submit_needs_an_entrypoint(capsys):
    assert main(["submit", "--address", "http://127.0.0.1:1"]) == 1
    assert "submit needs a command after `--`" in capsys.readouterr().err


def test_examples_load():
    from cpattn.config import load_config

    local = load_config(ROOT / "examples" / "service_local.yaml")
    cluster = load_config(ROOT / "examples" / "service_cluster.yaml")
    assert local.num_shards == 4 and local.resolved_device() == "cpu"
    assert cluster.placement_strategy == "SPREAD" and cluster.data_plane == "auto"


# Status against a service in this process ----------------------------------------------------------
def test_status_in_process(start_service, capsys):
    svc = start_service(num_shards=2)
    sid = svc.add_sequence()
    with svc.step({sid: 9}) as step:
        for layer in range(svc.config.num_layers):
            step.attend(layer, *(torch.randn(9, h, 8, dtype=torch.float64) for h in (4, 2, 2)))
    target = ["--name", svc.config.name, "--namespace", svc.config.namespace]
    # cpattn.start() wrote no credential file: its operator credential is the Service's, passed by flag.
    assert main(["status", *target]) == 1
    assert "needs the service's operator credential" in capsys.readouterr().err
    target += ["--operator-credential", svc.operator_credential]
    assert main(["status", *target]) == 0
    out = capsys.readouterr().out
    assert f"service {svc.config.name!r}" in out and "2 shards on 1 node(s)" in out
    assert "backend TORCH (torch " in out and "LSE base E" in out and "sequences 1" in out
    assert "kernels warmed" not in out   # CPU shards compile nothing (GPU: test_status_names_the_kernel_warm_up)
    assert main(["status", *target, "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    expected = svc.stats()
    assert [s["blocks_used"] for s in status["stats"]["shards"]] == [s["blocks_used"] for s in expected["shards"]]
    # 9 tokens interleaved over 2 shards with 4-token pages: 5 and 4 tokens, 2 and 1 pages.
    assert [s["tokens"] for s in status["stats"]["shards"]] == [5, 4]
    assert [s["blocks_used"] for s in status["stats"]["shards"]] == [2, 1]
    assert main(["status", "--name", "no-such-service", "--namespace", svc.config.namespace]) == 1
    assert "no cpattn service named 'no-such-service'" in capsys.readouterr().err


# A Ray head of our own ------------------------------------------------------------------------------
CLIENT_SCRIPT = textwrap.dedent("""
    import sys, torch, cpattn
    svc = cpattn.connect(name=sys.argv[1], namespace="cpattn", address=sys.argv[2])
    sid = svc.add_sequence()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(6, h, 8, dtype=torch.float64, generator=g) for h in (2, 1, 1))
    with svc.step({sid: 6}) as step:
        out = step.attend(0, q, k, v)
    # float64 causal reference (2 query heads share the one KV head)
    s = torch.einsum("thd,sd->hts", q, k[:, 0]) * 8 ** -0.5
    s = s.masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf"))
    ref = torch.einsum("hts,sd->thd", s.softmax(-1), v[:, 0])
    print("MAXERR", (out - ref).abs().max().item())
    svc.close()
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_head():
    """The README's `ray start --head`, with every fixed port chosen free (another Ray may run on this machine),
    --block in a session of its own, and RAY_TMPDIR private so that `--address auto` finds this head and no
    other. Torn down by killing its session's processes, never `ray stop`, which would stop every Ray on the
    machine."""
    import shutil
    import urllib.error
    import urllib.request

    first = readme_block("tests/test_cli.py")[0]
    assert command(first) == command("ray start --head --block") and "Ctrl-C there stops this head" in first
    tmp_root = f"/tmp/cpt{os.getpid()}"   # short: Ray's socket paths must stay under ~107 chars
    os.makedirs(tmp_root, exist_ok=True)
    env = user_env(RAY_TMPDIR=tmp_root)
    gcs_port, dash_port, agent_port, client_port = _free_port(), _free_port(), _free_port(), _free_port()
    cmd = command(first) + [
        "--node-ip-address=127.0.0.1", f"--port={gcs_port}", f"--dashboard-port={dash_port}",
        f"--dashboard-agent-listen-port={agent_port}", f"--ray-client-server-port={client_port}",
        "--include-dashboard=true", "--num-cpus=4", "--disable-usage-stats"]
    # A terminal's Ctrl-C: the head gets SIGINT's default disposition even when this suite was started in the
    # background (which ignores SIGINT for its children, and Python then installs no KeyboardInterrupt handler).
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            env=env, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    dashboard = f"http://127.0.0.1:{dash_port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                urllib.request.urlopen(dashboard + "/api/version", timeout=2)
                break
            except urllib.error.HTTPError:   # 401 without a token: the dashboard is up
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    pytest.fail("the test's Ray head did not start")
                time.sleep(0.2)
        yield {"gcs": f"127.0.0.1:{gcs_port}", "dashboard": dashboard, "env": env,
               "client": f"ray://127.0.0.1:{client_port}"}
        # The README's teardown: Ctrl-C in the head's terminal (SIGINT to its process group) stops the head and
        # everything it started, and nothing else.
        os.killpg(proc.pid, signal.SIGINT)
        left = wait_session_empty(proc.pid, 60)
        assert left == [], f"Ctrl-C left processes of the head running: {_cmdlines(left)}"
    finally:
        kill_session(proc.pid)
        proc.wait(timeout=30)
        shutil.rmtree(tmp_root, ignore_errors=True)


def _cmdlines(pids: list[int]) -> list[str]:
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                out.append(f.read().replace(b"\0", b" ").decode(errors="replace")[:160])
        except OSError:
            pass
    return out


def test_serve_status_submit_stop_on_a_cluster(ray_head, tmp_path):
    gcs, dashboard = ray_head["gcs"], ray_head["dashboard"]
    name = "cli-roundtrip"
    env = ray_head["env"]
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    (job_dir / "hello.py").write_text("import sys\nprint('hello from', sys.argv[1])\nsys.exit(int(sys.argv[2]))\n")
    # A job that succeeds runs in test_readme_cluster_walkthrough (`auto`); here the --help example's form,
    # a dashboard URL with nothing set, and a failing job's exit status. It needs no service: it runs while the
    # service is served and used (most of its time is the job's start and its status polls).
    failing = subprocess.Popen([*CLI, "submit", "--address", dashboard, "--working-dir", str(job_dir), "--",
                                "python", "hello.py", "failing-job", "3"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    # Ray's own CLI as the README prints it (the long-context job in the job's own service: 2 of the head's 4 CPUs).
    ray_own_line, ray_own_env = _ray_job_submit_line()
    ray_own = subprocess.Popen(command(ray_own_line), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               cwd=ROOT, env=dict(env, RAY_ADDRESS=gcs, **ray_own_env))   # this head of several
    try:
        _serve_use_and_stop(name, gcs, env)
        out, err = failing.communicate(timeout=120)
        own_out, own_err = ray_own.communicate(timeout=240)
    finally:
        for proc in (failing, ray_own):
            if proc.poll() is None:
                proc.kill()
    assert failing.returncode == 1 and "FAILED" in err, err
    assert "hello from failing-job" in out and BANNER not in err
    assert ray_own.returncode == 0, f"`{ray_own_line}` failed:\n{own_out[-2000:]}\n{own_err[-3000:]}"
    assert "generated: [[" in own_out and "succeeded" in own_out + own_err, own_out[-2000:]


def _ray_job_submit_line() -> tuple[str, dict]:
    """README's `ray job submit` line (Ray's own CLI) without its leading NAME=value settings, and those."""
    import shlex

    readme = (ROOT / "README.md").read_text().splitlines()
    found = [line for line in readme if "ray job submit --working-dir . -- python examples/long_context_job.py" in line]
    assert len(found) == 1, "README.md has no single `ray job submit` line for the long-context job"
    words = shlex.split(found[0], comments=True)
    settings = {}
    while words and "=" in words[0] and not words[0].startswith("-"):
        key, value = words.pop(0).split("=", 1)
        settings[key] = value
    assert settings == {"RAY_AUTH_MODE": "token"}, settings   # what the README says Ray's own CLI needs
    return shlex.join(words), settings


def _serve_use_and_stop(name: str, gcs: str, env: dict) -> None:
    served = _run([*CLI, "serve", "--address", gcs, "--name", name, *SMALL], env=env)
    assert served.returncode == 0, served.stderr
    assert f"cpattn service {name!r} (namespace 'cpattn') is up: 2 shards on 1 node(s), backend TORCH" in served.stdout

    # serve has exited; the detached service answers a client in yet another process, exactly.
    client = _run([sys.executable, "-c", CLIENT_SCRIPT, name, gcs], env=env)
    assert client.returncode == 0, client.stderr
    assert float(client.stdout.split("MAXERR")[1]) < 1e-12

    status = _run([*CLI, "status", "--address", gcs, "--name", name, "--json"], env=env)
    assert status.returncode == 0, status.stderr
    status = json.loads(status.stdout)
    assert status["stats"]["num_sequences"] == 1 and [s["tokens"] for s in status["stats"]["shards"]] == [3, 3]
    assert status["stats"]["backend"] == "TORCH" and status["describe"]["config"]["detached"] is True

    stopped = _run([*CLI, "stop", "--address", gcs, "--name", name], env=env)
    assert stopped.returncode == 0, stopped.stderr
    # Python's import report on stderr (nothing else changes): a service that is not there is said without
    # importing torch (a found one still imports it: Ray loads the coordinator's module for the actor handle).
    gone = _run([*CLI, "status", "--address", gcs, "--name", name], env=dict(env, PYTHONPROFILEIMPORTTIME="1"))
    assert gone.returncode == 1 and f"no cpattn service named {name!r}" in gone.stderr
    assert not _imported(gone, "torch"), "cpattn status imported torch"


def _imported(result: subprocess.CompletedProcess, module: str) -> bool:
    """Whether a command run with PYTHONPROFILEIMPORTTIME=1 imported ``module`` (its stderr's import report)."""
    return any(line.startswith("import time:") and line.rsplit("|", 1)[-1].strip() == module
               for line in result.stderr.splitlines())


def test_readme_cluster_walkthrough(ray_head):
    """README, "The `cpattn` command": the block after `ray start --head` (the fixture), run as printed, with
    the head's default token authentication and nothing set: serve --address auto, status, submit (the job
    attaches to the service), stop. Issue 11, item 1: submit failed with AuthenticationError."""
    lines = readme_block("tests/test_cli.py")[1:]
    assert lines[0] == "cpattn serve -c examples/service_local.yaml --address auto"
    results = []
    for line in lines:
        result = _run(command(line), timeout=150, env=ray_head["env"])
        assert result.returncode == 0, f"`{line}` failed:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
        assert BANNER not in result.stderr and "Traceback" not in result.stderr, result.stderr
        assert "Found multiple active Ray instances" not in result.stderr, result.stderr
        results.append(result)
    served, listed, status, submitted, stopped = results
    assert "cpattn service 'cpattn' (namespace 'cpattn') is up: 4 shards" in served.stdout
    row = next(line for line in listed.stdout.splitlines() if line.startswith("cpattn "))
    assert row.split()[:5] == ["cpattn", "cpattn", "4/4", "0", "0"], listed.stdout
    assert "service 'cpattn' (namespace 'cpattn'): 4 shards on 1 node(s)" in status.stdout
    assert "generated: [[" in submitted.stdout and "SUCCEEDED" in submitted.stderr
    assert "stopped cpattn service 'cpattn'" in stopped.stdout


def test_explicit_address_needs_no_auth_mode_and_a_wrong_token_is_one_line(ray_head):
    """Item 2: `cpattn status --address <ip:port>` with nothing set (it printed 20 InvalidAuthToken lines);
    a wrong token is one line naming where tokens are looked for."""
    gcs = ray_head["gcs"]
    status = _run([*CLI, "status", "--address", gcs, "--name", "no-such-service"], env=ray_head["env"])
    assert status.returncode == 1 and "InvalidAuthToken" not in status.stderr, status.stderr
    assert status.stderr.strip() == ("cpattn status: error: no cpattn service named 'no-such-service' in namespace "
                                     "'cpattn': start one with cpattn.start(...) or `cpattn serve`, or pass the "
                                     "right name/namespace (`cpattn list` shows every service on the cluster)")
    wrong = _run([*CLI, "status", "--address", gcs], env=dict(ray_head["env"], RAY_AUTH_TOKEN="0" * 32))
    assert wrong.returncode == 1 and len(wrong.stderr.strip().splitlines()) == 1, wrong.stderr
    assert f"the Ray cluster at {gcs} rejected the token found in RAY_AUTH_TOKEN" in wrong.stderr


def test_a_ray_client_address_under_token_auth_needs_nothing_set(ray_head):
    """The --help's `ray://head:10001` form on a cluster with token auth (Ray's default): Ray Client sends the
    token only in token mode, so every command waited 30 s and blamed the port ("cannot connect ... ray client
    connection timeout"). Now each asks the way the GCS form does: `cpattn list` over it works with nothing set
    (it also read the GCS tables in its own process, which a Ray Client driver has not: "Trying to use state API
    before ray.init()"), and a wrong token is one line. (One Ray Client connection: Ray's server side fails about
    1 start in 5 here, which cpattn retries, reach.RAY_CLIENT_ATTEMPTS.)"""
    client, gcs, env = ray_head["client"], ray_head["gcs"], ray_head["env"]
    deadline = time.monotonic() + 60   # the head's Ray Client server starts after its dashboard answers
    while True:
        try:
            socket.create_connection(("127.0.0.1", int(client.rsplit(":", 1)[1])), timeout=2).close()
            break
        except OSError:
            assert time.monotonic() < deadline, "the head's Ray Client server did not start"
            time.sleep(0.2)
    wrong = _run([*CLI, "status", "--address", client], env=dict(env, RAY_AUTH_TOKEN="0" * 32))
    assert wrong.returncode == 1 and wrong.stderr.strip() == (
        f"cpattn status: error: the Ray cluster at {client} rejected the token found in RAY_AUTH_TOKEN, the file "
        "named by RAY_AUTH_TOKEN_PATH, or ~/.ray/auth_token: use the cluster's token (`ray get-auth-token` on its "
        "head prints it), e.g. in RAY_AUTH_TOKEN"), wrong.stderr
    name = "over-ray-client"
    served = _run([*CLI, "serve", "--address", gcs, "--name", name, *SMALL, "--num-shards", "1"], env=env)
    try:
        assert served.returncode == 0 and f"cpattn service '{name}'" in served.stdout, served.stderr
        listed = _run([*CLI, "list", "--address", client], env=env)
        rows = [line.split() for line in listed.stdout.splitlines()]
        assert listed.returncode == 0 and any(row[:3] == [name, "cpattn", "1/1"] for row in rows), listed
    finally:
        stopped = _run([*CLI, "stop", "--address", gcs, "--name", name], env=env)
    assert stopped.returncode == 0 and f"stopped cpattn service '{name}'" in stopped.stdout, stopped.stderr


def test_placement_waits_out_loud_and_fails_with_the_fix(ray_head):
    """Issue 25: a service whose shards cannot be placed because another service holds the CPUs said nothing
    for 304 s. Now: a line every few seconds naming what is missing and who holds it, and a one-line failure
    well under a minute naming the service to stop. Also: serve honours RAY_ADDRESS (it started an embedded Ray
    and blocked), --address overrides it, and `cpattn list` shows every service."""
    gcs, env = ray_head["gcs"], ray_head["env"]
    # One shard holding all 4 of the head's CPUs (a shard process each costs seconds; the claim needs the CPUs held).
    hog = [*CLI, "serve", "--name", "hog", *SMALL, "--num-shards", "1", "--num-cpus-per-shard", "4"]
    served = _run(hog, env=dict(env, RAY_ADDRESS=gcs))   # no --address: RAY_ADDRESS, as status and stop do
    assert served.returncode == 0 and "cpattn service 'hog'" in served.stdout, served.stderr
    try:
        t0 = time.monotonic()
        # A placement wait of 1 s instead of the default 20 s (test_user_day asserts the default): the first
        # report line (REPORT_EVERY_S after the start), then the failure at the next report time, 15 s sooner.
        second = _run([*CLI, "serve", "--address", gcs, "--name", "second", *SMALL, "--placement-wait-s", "1"],
                      env=env)
        took = time.monotonic() - t0
        waits = [line for line in second.stderr.splitlines() if line.startswith("cpattn: waiting to place")]
        assert second.returncode == 1 and took < 50, (took, second.stderr)
        assert waits and "missing 0.5 CPU (of 0.5 needed, 0 free); held by service 'hog' (namespace 'cpattn'): 4 CPU" \
            in waits[0], second.stderr
        error = second.stderr.strip().splitlines()[-1]
        assert error.startswith("cpattn serve: error: could not place 2 shards of service 'second' within 1s") \
            and "stop service 'hog' (`cpattn stop --name hog`)" in error, second.stderr
        listed = _run([*CLI, "list", "--address", gcs],
                      env=dict(env, RAY_ADDRESS=f"127.0.0.1:{_free_port()}"))   # --address wins over RAY_ADDRESS
        assert listed.returncode == 0, listed.stderr
        names = [line.split()[0] for line in listed.stdout.splitlines()[1:]]
        assert names == ["hog"], listed.stdout   # the failed service left nothing behind
    finally:
        stopped = _run([*CLI, "stop", "--name", "hog"], env=dict(env, RAY_ADDRESS=gcs))
    assert stopped.returncode == 0, stopped.stderr


def _start_embedded(name: str) -> tuple[subprocess.Popen, list[str]]:
    """`cpattn serve` without an address, in a session of its own; returns once it serves, with its stdout."""
    # One shard (SMALL's last word wins): the three serves run side by side, and a shard process costs seconds.
    proc = subprocess.Popen([*CLI, "serve", "--name", name, *SMALL, "--num-shards", "1"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT, env=user_env(), start_new_session=True)
    return proc, []


def _wait_serving(proc: subprocess.Popen, lines: list[str]) -> str:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if "serving until Ctrl-C" in line:
            return line
    proc.kill()
    pytest.fail("serve did not come up:\n" + "".join(lines) + proc.stderr.read())


def _printed_commands(line: str) -> dict[str, str]:
    """The commands serve prints for other shells: {'status': 'cpattn status --address ...', 'stop': ...}."""
    import re

    return {m.split()[1]: m for m in re.findall(r"`(cpattn \w+ [^`]*)`", line)}


def test_serve_embedded_stops_cleanly_however_it_is_told():
    """Items 2 and 4, three embedded serves side by side: (a) the status command serve prints runs as printed
    (nothing set), then `cpattn stop` from another shell ends serve with status 0 (it kept blocking on an empty
    Ray instance); (b) Ctrl-C (SIGINT to the group) and (c) SIGTERM to the group (timeout, systemd) stop it
    with status 0 within seconds, leaving none of its processes (SIGTERM took 85 s, failed with "Failed to
    connect to GCS within 60 seconds" and left a ShardWorker). The three are told at once, each in a thread of
    its own, and each is timed from its own stop."""
    from concurrent.futures import ThreadPoolExecutor

    how = {"stop": "cli-embedded", signal.SIGINT: "cli-embedded-sigint", signal.SIGTERM: "cli-embedded-sigterm"}
    procs = {key: _start_embedded(name) for key, name in how.items()}
    try:
        serving = {key: _wait_serving(proc, lines) for key, (proc, lines) in procs.items()}
        with ThreadPoolExecutor(len(procs)) as pool:
            stops = {key: pool.submit(_stop_embedded, key, proc, serving[key]) for key, (proc, _) in procs.items()}
            for key, stop in stops.items():
                code, took, err, left, expected = stop.result()
                assert code == 0, (key, err)
                assert expected in err and "Failed to connect to GCS" not in err and BANNER not in err, (key, err)
                assert took < STOP_BOUND_S, (key, took, err)
                assert left == [], (key, left)
                credential_file = _credential_file(procs[key][1])   # its Ray instance is gone: so is the file
                assert not os.path.exists(credential_file) and not os.path.exists(os.path.dirname(credential_file))
    finally:
        _cleanup([proc for proc, _ in procs.values()])


def _credential_file(lines: list[str]) -> str:
    import re

    found = [m.group(1) for m in map(re.compile(r"read it from (\S+),").search, lines) if m]
    assert len(found) == 1, lines
    return found[0]


def _stop_embedded(key, proc: subprocess.Popen, serving: str):
    """Tell one embedded serve to stop (`cpattn stop` as printed, or a signal to its group); wait for it.
    Returns (exit status, seconds from the stop to the exit, its stderr, processes left, what it must say)."""
    if key == "stop":
        printed = _printed_commands(serving)
        assert printed["status"].endswith(" --name cli-embedded"), printed
        status = _run(command(printed["status"]))
        assert status.returncode == 0 and "1 shards on 1 node(s)" in status.stdout, status.stderr
        assert BANNER not in status.stderr
        assert proc.poll() is None   # still serving
        stopped = _run(command(printed["stop"]))
        assert stopped.returncode == 0, stopped.stderr
        expected = "service 'cli-embedded' was stopped"
    else:
        os.killpg(proc.pid, key)
        expected = "stopping the service"
    t0 = time.monotonic()
    try:
        code = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"{key}: serve did not exit within 60 s; it printed:\n{proc.stderr.read()[-4000:]}")
    took = time.monotonic() - t0
    left = wait_session_empty(proc.pid, 5)
    return code, took, proc.stderr.read(), left, expected


def _cleanup(procs: list[subprocess.Popen]) -> None:
    """Kill each serve and whatever its session still holds; one failure does not leave the others running."""
    errors = []
    for proc in procs:
        try:
            if proc.poll() is None:
                proc.kill()
            kill_session(proc.pid)
        except Exception as exc:
            errors.append(exc)
    if errors:
        raise errors[0]


def _job_status(dashboard: str, job_id: str, env: dict) -> str:
    """The job's status as the job server has it (through submit's own connection, which finds the head's token)."""
    code = ("import sys; from cpattn.launch.submit import connect_job_server; "
            "print(connect_job_server(sys.argv[1]).get_job_status(sys.argv[2]).value)")
    read = _run([sys.executable, "-c", code, dashboard, job_id], env=env)
    assert read.returncode == 0, read.stderr
    return read.stdout.strip()


def test_submit_stops_a_job_that_cannot_start_and_a_job_whose_submit_got_sigterm(ray_head, tmp_path):
    """A job asking for a GPU on a cluster with none waited 15 minutes in silence (Ray's own start timeout), and a
    SIGTERM to `cpattn submit` left its job running. Now: submit gives up at --pending-timeout-s, naming what the
    job waits for and the fix, and tells the job to stop; SIGTERM stops a running job as Ctrl-C does."""
    dashboard, env = ray_head["dashboard"], ray_head["env"]
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    (job_dir / "sleepy.py").write_text("import time\nprint('sleepy started', flush=True)\ntime.sleep(600)\n")
    base = [*CLI, "submit", "--address", dashboard, "--working-dir", str(job_dir)]
    follower = subprocess.Popen([*base, "--", "python", "sleepy.py"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, cwd=ROOT, env=env)
    try:
        pending = _run([*base, "--entrypoint-num-gpus", "1", "--pending-timeout-s", "3", "--", "python", "sleepy.py"],
                       env=env, timeout=60)
        assert pending.returncode == 1, pending.stderr
        error = pending.stderr.strip().splitlines()[-1]
        assert "did not start within --pending-timeout-s=3: it was waiting for a node with 1 GPU free" in error \
            and "It was told to stop" in error, error
        assert "pending for" not in pending.stderr   # the first reminder comes after NOTICE_EVERY_S
        job_id = error.split("job ")[1].split()[0]
        # Ray's job server cannot stop a job whose supervisor was never placed: it stays PENDING (never RUNNING) until
        # Ray's own start timeout fails it; if it were ever placed, the queued stop would end it at once.
        assert _job_status(dashboard, job_id, env) == "PENDING"
        deadline = time.monotonic() + 60
        while "sleepy started" not in follower.stdout.readline():
            assert time.monotonic() < deadline and follower.poll() is None, follower.stderr.read()
        follower.send_signal(signal.SIGTERM)
        out, err = follower.communicate(timeout=30)
    finally:
        if follower.poll() is None:
            follower.kill()
    assert follower.returncode == 143, err
    stopped_id = [line.split()[-1] for line in err.splitlines() if line.startswith("stopping job")]
    assert stopped_id, err
    deadline = time.monotonic() + 30
    while (status := _job_status(dashboard, stopped_id[0], env)) != "STOPPED":
        assert time.monotonic() < deadline, status
        time.sleep(0.5)
