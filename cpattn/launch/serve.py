"""``cpattn serve``: start a detached, named service from a YAML file and/or flags (flags win)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time

from cpattn.config import ServiceConfig, load_config
from cpattn.launch.common import SERVICE_FLAG_EXCLUDED, default_address


def config_from_args(args: argparse.Namespace) -> ServiceConfig:
    """The service config: YAML file values, overridden by every flag given. Raises ConfigError."""
    overrides = {f: getattr(args, f, None) for f in ServiceConfig.model_fields if f not in SERVICE_FLAG_EXCLUDED}
    # --address, else RAY_ADDRESS (as every command), else the file's ray_address, else an embedded Ray.
    overrides.update(name=args.name, namespace=args.namespace, ray_address=default_address(args.address),
                     detached=True)
    if args.config:
        return load_config(args.config, **overrides)
    return ServiceConfig(**{k: v for k, v in overrides.items() if v is not None})


def serve(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    import ray

    from cpattn.cluster.authority import new_operator_credential
    from cpattn.cluster.reach import AUTH_MODE_ENV, use_token_auth
    from cpattn.cluster.service import check_backend, launch_coordinator, ray_for
    from cpattn.launch import operator

    check_backend(cfg)   # a backend that cannot serve the settings fails before Ray starts, with every reason
    embedded = cfg.ray_address is None and not ray.is_initialized()
    with ray_for(cfg) as started_ray:
        operator_credential = new_operator_credential()
        coordinator = launch_coordinator(cfg, operator_credential)
        try:
            described = ray.get(coordinator.describe.remote(operator_credential), timeout=cfg.rpc_timeout_s)
        except BaseException as exc:
            # Its credential was never shown: nobody could stop what is left, so it all goes now.
            from cpattn.cluster.service import stop_coordinator
            from cpattn.errors import ServiceError

            stop_coordinator(coordinator, cfg.rpc_timeout_s, cfg, operator_credential)
            if isinstance(exc, ray.exceptions.GetTimeoutError):
                raise ServiceError(f"service {cfg.name!r} started but did not answer within rpc_timeout_s="
                                   f"{cfg.rpc_timeout_s:g}s, and was stopped: raise rpc_timeout_s (default 60)") from None
            raise
    shards = described["shards"]
    nodes = sorted({s["node_id"] for s in shards})
    first = shards[0]
    print(f"cpattn service {cfg.name!r} (namespace {cfg.namespace!r}) is up: {len(shards)} shards on "
          f"{len(nodes)} node(s), backend {first['backend']} ({first['kernel_version']}), prefill {first.get('prefill_backend')}, "
          f"device {first['device']}, "
          f"{first['num_blocks']} blocks of {cfg.block_size} tokens per shard", flush=True)
    path = operator.credential_path(ray.get_runtime_context().gcs_address, cfg.namespace, cfg.name)
    operator.save(path, operator_credential)
    print(f"operator credential (shown once; `cpattn stop` and `cpattn status` on this machine read it from {path}, "
          f"elsewhere pass --operator-credential or set {operator.ENV}): {operator_credential}", flush=True)
    if not embedded:
        flags = target_flags(cfg, None if cfg.ray_address == "auto" else cfg.ray_address)
        print(f"attach with cpattn.connect(name={cfg.name!r}, namespace={cfg.namespace!r}); "
              f"inspect with `cpattn status{flags}`; stop with `cpattn stop{flags}`", flush=True)
        # The coordinator is detached: it outlives this process on the cluster.
        if started_ray:
            ray.shutdown()
        return 0
    # An embedded Ray instance dies with the process that started it, so stay up until told to stop.
    address = ray.get_runtime_context().gcs_address
    flags = target_flags(cfg, address)
    print(f"attach with cpattn.connect(name={cfg.name!r}, namespace={cfg.namespace!r}, address={address!r})",
          flush=True)
    return EmbeddedServer(coordinator, cfg, operator_credential, path).run(
        f"embedded Ray at {address}: serving until Ctrl-C (other shells: `cpattn status{flags}`, "
        f"`cpattn stop{flags}`; use --address to run on a cluster that outlives this process)")


def target_flags(cfg: ServiceConfig, address: str | None) -> str:
    """The flags another shell's `cpattn status` / `stop` needs to find this service (defaults left out)."""
    import shlex

    flags = [] if address is None else ["--address", address]
    if cfg.name != "cpattn":
        flags += ["--name", cfg.name]
    if cfg.namespace != "cpattn":
        flags += ["--namespace", cfg.namespace]
    return "".join(" " + shlex.quote(f) for f in flags)


class EmbeddedServer:
    """Keeps an embedded service up until Ctrl-C, SIGTERM, or the service being stopped elsewhere.

    Ctrl-C reaches the whole foreground process group, but Ray's daemons block SIGINT, so serve stops the
    service through them. SIGTERM to the group (``timeout``, systemd) also reaches the raylet, GCS and Ray's
    Python daemons, which drain or exit and stop answering; waiting on them cost 85 s. So every step of the
    way out is bounded: when the daemons do not answer within seconds, serve kills the instance's daemons and
    the service's worker processes itself (the raylet's children, recorded while serving) and exits 0.
    A service stopped from another shell (`cpattn stop`) ends serve too, with status 0.
    """

    POLL_S = 1.0
    STOP_TIMEOUT_S = 5.0
    SHUTDOWN_TIMEOUT_S = 10.0

    def __init__(self, coordinator, cfg: ServiceConfig, operator_credential: str, credential_path=None):
        import ray

        self.credential_path = credential_path   # dies with this embedded instance: removed on every way out
        self.coordinator = coordinator
        self.operator_credential = operator_credential
        self.cfg = cfg
        self.node = ray._private.worker._global_node
        self.workers: dict[int, object] = {}   # pid -> psutil.Process of the raylet's children

    def run(self, announcement: str) -> int:
        """Print ``announcement`` once signals are handled, then serve; the exit status."""
        import ray

        # Both handled explicitly: a serve started from a script in the background inherits SIGINT ignored
        # (POSIX shells do that for background jobs), and `kill -INT` must still stop it.
        previous = {sig: signal.signal(sig, _raise_interrupt) for sig in (signal.SIGTERM, signal.SIGINT)}
        # The watch runs in a thread so the main thread only waits on an Event, where a signal lands at once:
        # a signal arriving inside ray.get_actor while the group's GCS goes down used to wait out Ray's
        # 60 s GCS reconnect ("Failed to connect to GCS within 60 seconds") before serve could react.
        ended, why = threading.Event(), {}
        watcher = threading.Thread(target=self._watch, args=(ended, why), name="cpattn-serve-watch", daemon=True)
        try:
            return self._serve(announcement, watcher, ended, why)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _serve(self, announcement: str, watcher: threading.Thread, ended: threading.Event, why: dict) -> int:
        import ray

        try:
            try:
                print(announcement, flush=True)
                watcher.start()
                while not ended.wait(self.POLL_S):
                    pass
                if why.get("daemons_gone"):
                    print("the embedded Ray instance stopped: exiting", file=sys.stderr, flush=True)
                    self._forget_credential()
                    self._exit_without_ray(1)
                print(f"service {self.cfg.name!r} was stopped (`cpattn stop`): shutting down the embedded "
                      "Ray instance", file=sys.stderr, flush=True)
                ray.shutdown()
                return 0
            except KeyboardInterrupt:
                ended.set()   # the watcher stops at its next poll
                print("stopping the service", file=sys.stderr, flush=True)
            self._forget_credential()   # (before _exit_without_ray, which ends the process at once)
            # SIGTERM to the whole group (timeout, systemd) also reaches the raylet and GCS, which then drain
            # and stop answering: stop through them only while they do, each step bounded, else take the
            # instance down directly. Either way nothing of the embedded instance is left.
            try:
                time.sleep(0.3)   # a group-wide SIGTERM ends Ray's Python daemons within this
                if (self._daemons_alive(every=True) and self._bounded(self._stop_service, self.STOP_TIMEOUT_S)
                        and self._bounded(ray.shutdown, self.SHUTDOWN_TIMEOUT_S, watch_daemons=False)):
                    return 0
            except KeyboardInterrupt:   # a second Ctrl-C / SIGTERM: stop waiting
                pass
            self._exit_without_ray(0)
        finally:
            self._forget_credential()

    def _forget_credential(self) -> None:
        """The credential file of an instance that ends with this process (`cpattn stop` removes it too)."""
        from cpattn.launch import operator

        if self.credential_path is not None:
            operator.forget(self.credential_path)

    def _watch(self, ended: threading.Event, why: dict) -> None:
        """Until ``ended``: remember the instance's workers; end when its daemons or the service are gone."""
        import ray

        while not ended.wait(self.POLL_S):
            self._record_workers()
            if not self._daemons_alive():
                why["daemons_gone"] = True
                break
            try:
                ray.get_actor(self.cfg.name, namespace=self.cfg.namespace)
            except ValueError:
                break
        ended.set()

    def _bounded(self, fn, timeout_s: float, watch_daemons: bool = True) -> bool:
        """Run ``fn`` in a thread; True if it returned within ``timeout_s`` (and, watching them, before the
        daemons were seen gone)."""
        worker = threading.Thread(target=fn, name=f"cpattn-serve-{fn.__name__}", daemon=True)
        worker.start()
        deadline = time.monotonic() + timeout_s
        while worker.is_alive() and time.monotonic() < deadline and (not watch_daemons or self._daemons_alive()):
            worker.join(0.1)
        return not worker.is_alive()

    def _stop_service(self) -> None:
        from cpattn.cluster.service import stop_coordinator

        try:
            stop_coordinator(self.coordinator, min(self.cfg.rpc_timeout_s, self.STOP_TIMEOUT_S), self.cfg,
                             self.operator_credential)
        except Exception as exc:   # reported; the main thread still takes the instance down
            print(f"stopping the service failed: {exc}", file=sys.stderr, flush=True)

    def _daemons_alive(self, every: bool = False) -> bool:
        """The GCS and raylet are running (``every``: all of the instance's daemons, which a signal to the
        group reaches)."""
        from ray._private import ray_constants

        kinds = (self.node.all_processes if every else
                 (ray_constants.PROCESS_TYPE_GCS_SERVER, ray_constants.PROCESS_TYPE_RAYLET))
        for kind in kinds:
            for info in self.node.all_processes.get(kind, []):
                if info.process.poll() is not None:
                    return False
        return True

    def _record_workers(self) -> None:
        """The raylet's children (the coordinator, shards, idle workers): once the raylet is killed they are
        orphans that linger until they notice, so serve remembers them to kill them on the way out."""
        import psutil
        from ray._private import ray_constants

        for info in self.node.all_processes.get(ray_constants.PROCESS_TYPE_RAYLET, []):
            try:
                for child in psutil.Process(info.process.pid).children(recursive=True):
                    self.workers.setdefault(child.pid, child)
            except psutil.Error:
                pass

    def _exit_without_ray(self, code: int) -> None:
        """The daemons are gone: kill what is left of the instance and exit now (ray.shutdown() and the
        atexit hooks would wait on the dead GCS)."""
        import psutil

        try:
            self.node.kill_all_processes(check_alive=False, allow_graceful=False)
        except Exception:
            pass
        workers = list(self.workers.values())   # the watcher may still be adding to the dict
        for proc in workers:
            try:
                proc.kill()   # psutil checks the process is still the one recorded (pid reuse)
            except psutil.Error:
                pass
        psutil.wait_procs(workers, timeout=5)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt
