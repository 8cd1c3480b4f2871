"""Two "hosts" on one machine: Linux network namespaces joined by a veth pair, a Ray node in each.

Used by tests/test_multihost_netns.py (needs root and `ip netns`). Everything it creates carries a random
suffix and is removed by name: its namespaces (which also end the veth pair), their /etc/netns/<ns>/hosts
files, the Ray temp dir; its processes are exactly those running inside its namespaces (`ip netns pids`),
killed by PID.

Each namespace gets an /etc/netns/<ns>/hosts (bind-mounted on /etc/hosts by `ip netns exec`) that maps the
hostname to 127.0.1.1, as Debian/Ubuntu do: what gloo would pick from the hostname is loopback, so the
data plane is exact across the two hosts only when it binds to the node IP.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).with_name("ray"))


def netns_unavailable() -> str | None:
    """Why this machine cannot run the scenario, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and a veth pair)"
    if shutil.which("ip") is None:
        return "needs iproute2's `ip` (ip netns)"
    probe = f"cpattnprobe{secrets.token_hex(3)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


class NetnsCluster:
    def __init__(self, subnet_octet: int | None = None):
        tag = secrets.token_hex(3)
        self.ns = [f"cpattn{tag}a", f"cpattn{tag}b"]
        self.veth = [f"cp{tag}a", f"cp{tag}b"]
        octet = subnet_octet if subnet_octet is not None else 1 + secrets.randbelow(250)
        self.ips = [f"10.231.{octet}.1", f"10.231.{octet}.2"]
        self.temp_dir = Path(f"/tmp/cpattn-netns-{tag}")
        self.token = secrets.token_hex(32)
        self.gcs_port = 6379
        self.address = f"{self.ips[0]}:{self.gcs_port}"

    def spec(self) -> dict:
        return {"ns": self.ns, "veth": self.veth, "ips": self.ips, "temp_dir": str(self.temp_dir), "token": self.token,
                "address": self.address}

    @classmethod
    def from_spec(cls, spec: dict) -> "NetnsCluster":
        """The same cluster seen from another process (the driver in host a)."""
        cluster = cls.__new__(cls)
        cluster.ns, cluster.veth, cluster.ips = spec["ns"], spec["veth"], spec["ips"]
        cluster.temp_dir, cluster.token, cluster.address = Path(spec["temp_dir"]), spec["token"], spec["address"]
        cluster.gcs_port = int(spec["address"].rsplit(":", 1)[1])
        return cluster

    # Network ------------------------------------------------------------------------------------
    def create(self) -> None:
        a, b = self.ns
        va, vb = self.veth
        for ns in self.ns:
            _ip("netns", "add", ns)
            hosts = Path("/etc/netns") / ns
            hosts.mkdir(parents=True, exist_ok=True)
            # The trap of many machines: the hostname resolves to loopback.
            (hosts / "hosts").write_text(f"127.0.0.1 localhost\n127.0.1.1 {socket.gethostname()}\n")
        _ip("link", "add", va, "type", "veth", "peer", "name", vb)
        for ns, veth, ip in ((a, va, self.ips[0]), (b, vb, self.ips[1])):
            _ip("link", "set", veth, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", veth)
            _ip("-n", ns, "link", "set", veth, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        self.temp_dir.mkdir(parents=True, exist_ok=True)

    def link(self, up: bool) -> None:
        """Cut (or restore) the link between the hosts: host a's end of the veth pair down (up)."""
        _ip("-n", self.ns[0], "link", "set", self.veth[0], "up" if up else "down")

    def hostname_resolves_to(self, host: int) -> str:
        out = self.run(host, [sys.executable, "-c", "import socket; print(socket.gethostbyname(socket.gethostname()))"])
        return out.stdout.strip()

    # Processes ----------------------------------------------------------------------------------
    def env(self, node: bool) -> dict:
        """A Ray node gets RAY_AUTH_MODE=token and the token (README, multi-node); a driver only the token."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        env.update(RAY_AUTH_TOKEN=self.token, PYTHONPATH=f"{ROOT}:{ROOT / 'tests'}")
        if node:
            env["RAY_AUTH_MODE"] = "token"
        return env

    def run(self, host: int, argv: list[str], timeout_s: float = 60, node: bool = False, check: bool = True):
        proc = subprocess.run(["ip", "netns", "exec", self.ns[host], *argv], capture_output=True, text=True,
                              timeout=timeout_s, env=self.env(node), cwd=ROOT)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{argv[:3]} in {self.ns[host]} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                               f"{proc.stderr[-3000:]}")
        return proc

    def popen(self, host: int, argv: list[str]) -> subprocess.Popen:
        """``run`` without waiting: the caller communicates (its processes die with the namespace in destroy)."""
        return subprocess.Popen(["ip", "netns", "exec", self.ns[host], *argv], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=self.env(False), cwd=ROOT)

    def start_head(self) -> None:
        self.run(0, [RAY, "start", "--head", f"--node-ip-address={self.ips[0]}", f"--port={self.gcs_port}",
                     f"--temp-dir={self.temp_dir}", "--num-cpus=2", "--include-dashboard=false",
                     "--disable-usage-stats", "--resources", '{"cpattn_coordinator": 1}',
                     "--labels", "cpattn/shards=yes"], timeout_s=120, node=True)

    def start_worker(self) -> None:
        self.run(1, [RAY, "start", f"--address={self.address}", f"--node-ip-address={self.ips[1]}",
                     "--num-cpus=2", "--disable-usage-stats", "--labels", "cpattn/shards=yes"],
                 timeout_s=120, node=True)

    def pids(self, host: int) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", self.ns[host]], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]

    def kill_host(self, host: int) -> int:
        """SIGKILL every process of one host (its namespace), by PID; returns how many."""
        pids = [p for p in self.pids(host) if p != os.getpid()]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return len(pids)

    def destroy(self) -> None:
        """Kill our processes (by PID, until none is left), delete our namespaces, files and temp dir."""
        for _ in range(20):
            if not sum(self.kill_host(h) for h in (0, 1) if Path("/var/run/netns", self.ns[h]).exists()):
                break
            time.sleep(0.3)
        for ns in self.ns:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")
