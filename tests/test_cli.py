"""The `cpattn` command: help, config precedence and errors, status in-process, and a full round trip
(serve --address, a client in another process, status, submit, stop) on a Ray head of the test's own."""

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

ROOT = Path(__file__).resolve().parents[1]


def _env(**extra) -> dict:
    """This checkout importable; no RAY_ADDRESS inherited, so Ray starts where the test says."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return dict(env, PYTHONPATH=str(ROOT), **extra)
CLI = [sys.executable, "-m", "cpattn.launch.cli"]
SMALL = ["--num-shards", "2", "--num-layers", "1", "--num-q-heads", "2", "--num-kv-heads", "1", "--head-size", "8",
         "--block-size", "4", "--dtype", "float64", "--num-cpus-per-shard", "0.25", "--num-blocks-per-shard", "32"]


def _run(args, timeout=90, **kw):
    # An explicit address never turns Ray's token mode on by itself: clients set it (README, Security).
    env = _env(RAY_AUTH_MODE="token")
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env, **kw)


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


def test_bench_help_passes_through():
    result = _run([*CLI, "bench", "--help"], timeout=60)
    assert result.returncode == 0, result.stderr
    assert "usage:" in result.stdout and "service_bench" in result.stdout


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
    assert main(["status", "--name", svc.config.name, "--namespace", svc.config.namespace]) == 0
    out = capsys.readouterr().out
    assert f"service {svc.config.name!r}" in out and "2 shards on 1 node(s)" in out
    assert "backend TORCH (torch " in out and "LSE base E" in out and "sequences 1" in out
    assert main(["status", "--name", svc.config.name, "--namespace", svc.config.namespace, "--json"]) == 0
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
    """`ray start --head --block` with every fixed port chosen free (another Ray may run on this machine),
    its own temp dir, in its own process group; torn down by signal and group kill, never `ray stop`,
    which would stop every Ray on the machine."""
    import shutil
    import urllib.error
    import urllib.request

    temp_dir = f"/tmp/cpt{os.getpid()}"   # short: Ray's socket paths must stay under ~107 chars
    gcs_port, dash_port, agent_port = _free_port(), _free_port(), _free_port()
    cmd = [str(Path(sys.executable).parent / "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1",
           f"--port={gcs_port}", f"--dashboard-port={dash_port}", f"--dashboard-agent-listen-port={agent_port}",
           "--include-dashboard=true", "--num-cpus=4", f"--temp-dir={temp_dir}", "--disable-usage-stats"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            env=_env())
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
                time.sleep(1)
        yield {"gcs": f"127.0.0.1:{gcs_port}", "dashboard": dashboard}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        try:   # Ray's daemons run in the head's process group
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_serve_status_submit_stop_on_a_cluster(ray_head, tmp_path):
    gcs, dashboard = ray_head["gcs"], ray_head["dashboard"]
    name = "cli-roundtrip"
    served = _run([*CLI, "serve", "--address", gcs, "--name", name, *SMALL])
    assert served.returncode == 0, served.stderr
    assert f"cpattn service {name!r} (namespace 'cpattn') is up: 2 shards on 1 node(s), backend TORCH" in served.stdout

    # serve has exited; the detached service answers a client in yet another process, exactly.
    client = _run([sys.executable, "-c", CLIENT_SCRIPT, name, gcs])
    assert client.returncode == 0, client.stderr
    assert float(client.stdout.split("MAXERR")[1]) < 1e-12

    status = _run([*CLI, "status", "--address", gcs, "--name", name, "--json"])
    assert status.returncode == 0, status.stderr
    status = json.loads(status.stdout)
    assert status["stats"]["num_sequences"] == 1 and [s["tokens"] for s in status["stats"]["shards"]] == [3, 3]
    assert status["stats"]["backend"] == "TORCH" and status["describe"]["config"]["detached"] is True

    job_dir = tmp_path / "job"
    job_dir.mkdir()
    (job_dir / "hello.py").write_text("import sys\nprint('hello from', sys.argv[1])\nsys.exit(int(sys.argv[2]))\n")
    ok = _run([*CLI, "submit", "--address", dashboard, "--working-dir", str(job_dir), "--",
               "python", "hello.py", "cpattn-job", "0"], timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "hello from cpattn-job" in ok.stdout and "SUCCEEDED" in ok.stderr
    failed = _run([*CLI, "submit", "--address", dashboard, "--working-dir", str(job_dir), "--",
                   "python", "hello.py", "failing", "3"], timeout=120)
    assert failed.returncode == 1 and "FAILED" in failed.stderr

    stopped = _run([*CLI, "stop", "--address", gcs, "--name", name])
    assert stopped.returncode == 0, stopped.stderr
    gone = _run([*CLI, "status", "--address", gcs, "--name", name])
    assert gone.returncode == 1 and f"no cpattn service named {name!r}" in gone.stderr


def test_serve_embedded_blocks_until_interrupted():
    env = _env()
    proc = subprocess.Popen([*CLI, "serve", "--name", "cli-embedded", *SMALL], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env, start_new_session=True)
    try:
        lines = []
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "serving until Ctrl-C" in line:
                break
        assert any("serving until Ctrl-C" in l for l in lines), "".join(lines) + proc.stderr.read()
        address = lines[-1].split("embedded Ray at ")[1].split(":")[0:2]
        status = _run([*CLI, "status", "--address", ":".join(address), "--name", "cli-embedded"])
        assert status.returncode == 0 and "2 shards on 1 node(s)" in status.stdout, status.stderr
        assert proc.poll() is None   # still serving
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        assert "stopping the service" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
