"""Reaching a Ray cluster before ``ray.init``: fail in seconds with one line, and match its token auth.

``ray.init(address=...)`` on an address where nothing answers retries for ~14 minutes (20 attempts of
~40 s); on a cluster with token authentication it fails unless ``RAY_AUTH_MODE=token`` is set in the
client, which Ray does by itself only for ``address="auto"``. ``prepare_cluster`` runs first:

1. resolve ``auto`` (RAY_ADDRESS, else the cluster `ray start` recorded on this machine, else a local GCS),
2. a TCP connect to the GCS host:port (a few seconds at most),
3. one GCS call without a token, bounded to a few seconds: it answers, or it asks for a token, or it is
   not a Ray GCS. When the cluster asks for a token and ``RAY_AUTH_MODE`` is unset, token mode is turned
   on for this process (as ``ray.init`` does for a local cluster) with the token Ray finds in
   ``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH`` or ``~/.ray/auth_token``.

A Ray Client address (``ray://host:10001``) gets the same, with a Ray Client ping for the GCS call: Ray Client
sends the token only in token mode, and a server that wants one otherwise looks unreachable after 30 s.

A client in token mode cannot use a cluster without authentication (the cluster's workers cannot call
back into it), so token mode is turned on only when the cluster asks for it. Every failure is a
``ServiceError`` whose message says what to check.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys

from cpattn.errors import ServiceError

AUTH_MODE_ENV = "RAY_AUTH_MODE"
TCP_TIMEOUT_S = 3.0
# Bounds the probe's GCS connect (Ray's own default is ~40 s per attempt); a healthy GCS answers in ms.
GCS_PROBE_TIMEOUT_S = 2
TOKEN_SOURCES = "RAY_AUTH_TOKEN, the file named by RAY_AUTH_TOKEN_PATH, or ~/.ray/auth_token"
# Ray 2.60's Ray Client server starts a process per connection; on a busy machine about 1 start in 5 fails
# (its shim exits, or psutil meets it as a zombie), and the client hears it 30 s later as this message, the
# server's traceback after it (measured 2026-12-07 on a 2-core box).
SERVER_INIT_FAILED = "Initialization failure from server"
RAY_CLIENT_ATTEMPTS = 3


def use_token_auth() -> None:
    """Token mode for this process and its children (what ``ray.init()`` does for a new local cluster,
    without its banner). Ray caches the mode at import, so the cached config is refreshed too."""
    os.environ[AUTH_MODE_ENV] = "token"
    _refresh_ray_config()


def use_local_token_auth() -> bool:
    """Token mode for a local Ray instance this process starts, unless RAY_AUTH_MODE says otherwise: what
    ``ray.init()`` does by itself, minus its warning banner on every start. True when no token exists yet
    (``ray.init`` then writes one, which the user should hear about once: ``announce_new_token``)."""
    if os.environ.get(AUTH_MODE_ENV) is not None:
        return False
    new = not token_available()
    use_token_auth()
    return new


def announce_new_token() -> None:
    """One line of cpattn's own where Ray would print its banner: only when a token was just created."""
    path = os.path.expanduser("~/.ray/auth_token")
    if os.path.exists(path):
        print(f"cpattn: Ray token authentication is on: a new token was written to {path} (clusters on this "
              f"machine use it; {AUTH_MODE_ENV}=disabled turns authentication off)", file=sys.stderr, flush=True)


def token_available() -> bool:
    from ray._raylet import AuthenticationTokenLoader

    loader = AuthenticationTokenLoader.instance()
    loader.reset_cache()
    return bool(loader.has_token(ignore_auth_mode=True))


def split_host_port(address: str) -> tuple[str, int]:
    """``host:port`` (also ``scheme://host:port/...``, ``[v6]:port``) -> (host, port); ServiceError if not."""
    rest = address.split("://", 1)[1] if "://" in address else address
    rest = rest.split("/", 1)[0]
    host, sep, port = rest.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit():
        raise ServiceError(f"Ray address {address!r} is not host:port: write e.g. 10.0.0.5:6379 "
                           "(the GCS port of `ray start --head`), or auto")
    return host, int(port)


def check_tcp(address: str, what: str = "Ray cluster", timeout_s: float = TCP_TIMEOUT_S) -> None:
    """Raise ServiceError within ``timeout_s`` unless something accepts TCP connections at ``address``."""
    host, port = split_host_port(address)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except OSError as exc:
        why = "timed out" if isinstance(exc, TimeoutError) else (exc.strerror or str(exc))
        where = address if address.endswith(f"{host}:{port}") else f"{address} ({host}:{port})"
        raise ServiceError(f"cannot reach the {what} at {where}: {why}. Check the address and "
                           "port, that the cluster is running (`ray status` on its head) and that no firewall "
                           "blocks the port") from exc


def resolve_address(address: str | None) -> str:
    """``auto``/None -> the cluster's GCS host:port as ray.init would find it; others unchanged."""
    if address not in (None, "auto"):
        return address
    import logging

    from ray._private import services

    # With several clusters on the machine Ray logs a warning naming every GCS; cpattn says it in one line.
    services_logger = logging.getLogger(services.__name__)
    level = services_logger.level
    services_logger.setLevel(logging.ERROR)
    try:
        found = services.get_ray_address_from_environment("auto", None)
        running = services.find_gcs_addresses()
        latest = services.find_bootstrap_address(None)
    except ConnectionError as exc:
        raise ServiceError("no running Ray cluster found on this machine (address 'auto'): start one with "
                           "`ray start --head` (or `cpattn serve`), or give its address (--address host:6379, "
                           "address=..., or RAY_ADDRESS)") from exc
    finally:
        services_logger.setLevel(level)
    if len(running) > 1 and not os.environ.get("RAY_ADDRESS"):
        if latest is None:   # Ray would pick one of them at random
            raise ServiceError(f"several Ray clusters run on this machine ({', '.join(sorted(running))}) and none "
                               "was started by `ray start`: give the one to use with --address (or RAY_ADDRESS)")
        print(f"cpattn: several Ray clusters run on this machine; 'auto' is {found}, the one `ray start` started "
              "last (--address or RAY_ADDRESS picks another)", file=sys.stderr, flush=True)
    return found


def prepare_cluster(address: str | None) -> str:
    """Check ``address`` (None/'auto' resolved) is a reachable Ray cluster and set this process's auth mode
    to what it expects; returns the address to give ``ray.init``. Raises ServiceError within ~10 s."""
    resolved = resolve_address(address)
    shown = resolved if address in (None, "auto", resolved) else f"{address} ({resolved})"
    if resolved.startswith("ray://"):
        check_tcp(resolved, "Ray Client server")
        _match_auth(shown, lambda mode: _probe_client_server(resolved, mode), client_server=True)
        return resolved
    if "://" in resolved:
        raise ServiceError(f"Ray address {resolved!r} is a URL: give the cluster's GCS address host:port "
                           "(`ray start --head` prints it; default port 6379), or ray://host:10001")
    check_tcp(resolved)
    _match_auth(shown, lambda mode: _probe_gcs(resolved, mode), client_server=False)
    return resolved


def _match_auth(shown: str, probe, client_server: bool) -> None:
    """One call without a token (``probe("disabled")``: the exception, or None when it answered); when the
    cluster asks for one, token mode on (unless RAY_AUTH_MODE says otherwise) and the call again with it."""
    user_mode = os.environ.get(AUTH_MODE_ENV)
    wants_token = user_mode is not None and user_mode.lower() == "token"
    error = probe("disabled")
    if error is None:   # the cluster takes clients without a token
        # A Ray Client server without auth ignores a token; a GCS without auth cannot serve a token-mode driver.
        if wants_token and not client_server:
            raise ServiceError(f"the Ray cluster at {shown} runs without token authentication but RAY_AUTH_MODE is "
                               "'token' here, and a client in token mode cannot use such a cluster (its workers "
                               "cannot call back into it): unset RAY_AUTH_MODE")
        return
    if not _is_auth_error(error):
        if client_server:
            raise ServiceError(f"{shown} accepts connections but does not answer as a Ray Client server "
                               f"({_one_line(error)}): give the head's Ray Client port (`ray start --head "
                               "--ray-client-server-port`, default 10001), or its GCS address host:6379 "
                               "without ray://") from error
        raise ServiceError(f"{shown} accepts connections but does not answer as a Ray cluster's GCS "
                           f"({_one_line(error)}): give the GCS port of the head (`ray start --head --port`, "
                           "default 6379), not e.g. the dashboard's 8265") from error
    # The cluster wants a token.
    if user_mode is not None and not wants_token:
        raise ServiceError(f"the Ray cluster at {shown} uses token authentication but RAY_AUTH_MODE is "
                           f"{user_mode!r} here: unset RAY_AUTH_MODE (or set it to token) and provide the "
                           f"cluster's token in {TOKEN_SOURCES}") from error
    if not token_available():
        raise ServiceError(f"the Ray cluster at {shown} uses token authentication and no token was found in "
                           f"{TOKEN_SOURCES}: put the cluster's token there (`ray get-auth-token` on its head "
                           "prints it)") from error
    if not wants_token:
        use_token_auth()
    error = probe("token")
    if error is None:
        return
    if not wants_token:   # leave the process as it was
        os.environ.pop(AUTH_MODE_ENV, None)
        _refresh_ray_config()
    if _is_auth_error(error):
        raise ServiceError(f"the Ray cluster at {shown} rejected the token found in {TOKEN_SOURCES}: use the "
                           "cluster's token (`ray get-auth-token` on its head prints it), e.g. in RAY_AUTH_TOKEN"
                           ) from error
    raise ServiceError(f"the Ray cluster at {shown} did not answer with the token: {_one_line(error)}") from error


def join_cluster(address: str, namespace: str, **init_kwargs) -> None:
    """``ray.init`` on an existing cluster after ``prepare_cluster``: an unreachable address fails in seconds
    with one ServiceError instead of Ray's ~14 minutes of retries. Over Ray Client a connection whose server-side
    process failed to start is tried again, RAY_CLIENT_ATTEMPTS times in all."""
    import logging

    import ray

    resolved = prepare_cluster(address)
    init_kwargs.setdefault("logging_level", logging.WARNING)
    for attempt in range(1, RAY_CLIENT_ATTEMPTS + 1):
        try:
            ray.init(address=resolved, namespace=namespace, **init_kwargs)
            return
        except (ConnectionError, RuntimeError, ray.exceptions.RayError) as exc:
            why = _one_line(exc)
            if resolved.startswith("ray://") and why.startswith(SERVER_INIT_FAILED) and attempt < RAY_CLIENT_ATTEMPTS:
                print(f"cpattn: the Ray Client server at {resolved} could not start this connection's server "
                      f"({_last_line(exc)}): connecting again ({attempt + 1} of {RAY_CLIENT_ATTEMPTS})",
                      file=sys.stderr, flush=True)
                ray.shutdown()
                continue
            if why.startswith(SERVER_INIT_FAILED):
                why = f"{why} {_last_line(exc)}"
            raise ServiceError(f"cannot connect to the Ray cluster at {address} ({why}): check that it is "
                               "running (`ray status` on its head) and reachable from here") from exc


def _last_line(exc: Exception) -> str:
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__


def _probe_gcs(address: str, mode: str) -> Exception | None:
    """One GCS connection in auth ``mode`` with a short timeout; the exception, or None when it answered."""
    from ray._raylet import GcsClient

    timeout = str(GCS_PROBE_TIMEOUT_S)
    with _ray_env(**{AUTH_MODE_ENV: mode, "RAY_py_gcs_connect_timeout_s": timeout,
                     "RAY_gcs_rpc_server_connect_timeout_s": timeout}), _quiet_stderr():
        try:
            GcsClient(address=address)
        except Exception as exc:   # AuthenticationError, RpcError (timed out), ...
            return exc
    return None


def _probe_client_server(address: str, mode: str) -> Exception | None:
    """One Ray Client ping (``ray://host:port``) in auth ``mode``, bounded to a few seconds. Ray Client sends the
    token only in token mode, and without it retries an UNAUTHENTICATED answer until its 30 s timeout, which it
    then reports as an unreachable port."""
    import grpc
    from ray._private.grpc_utils import init_grpc_channel
    from ray.core.generated import ray_client_pb2, ray_client_pb2_grpc
    from ray.util.client.common import GRPC_OPTIONS

    target = address.split("://", 1)[1].split("/", 1)[0]
    with _ray_env(**{AUTH_MODE_ENV: mode}):
        channel = init_grpc_channel(target, options=GRPC_OPTIONS, asynchronous=False)
        try:
            ray_client_pb2_grpc.RayletDriverStub(channel).ClusterInfo(
                ray_client_pb2.ClusterInfoRequest(type=ray_client_pb2.ClusterInfoType.PING),
                timeout=GCS_PROBE_TIMEOUT_S)
        except grpc.RpcError as exc:
            return exc
        finally:
            channel.close()
    return None


def _is_auth_error(exc: Exception) -> bool:
    from ray.exceptions import AuthenticationError

    code = getattr(exc, "code", None)
    if callable(code) and getattr(code(), "name", None) == "UNAUTHENTICATED":   # a gRPC answer (Ray Client)
        return True
    return isinstance(exc, AuthenticationError) or "InvalidAuthToken" in str(exc)


def _one_line(exc: Exception) -> str:
    if callable(getattr(exc, "details", None)) and callable(getattr(exc, "code", None)):   # a gRPC error
        return f"{exc.code().name}: {exc.details()}" if exc.details() else exc.code().name
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _refresh_ray_config() -> None:
    from ray._raylet import Config

    Config.initialize("")


@contextlib.contextmanager
def _ray_env(**values: str):
    """Ray config values from the environment for the duration of the block (Ray reads them at init)."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    _refresh_ray_config()
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        _refresh_ray_config()


@contextlib.contextmanager
def _quiet_stderr():
    """Ray's C++ client logs one warning line per failed attempt to fd 2; the probe's outcome is reported
    as one ServiceError instead."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):
        yield
        return
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def prepare_job_server(address: str | None) -> str:
    """The Ray job server's URL for ``address`` (a dashboard URL http://host:8265, a GCS address, or
    None/'auto'), checked to answer within seconds, with token mode on when it asks for a token."""
    if address and address.startswith("ray://"):
        return prepare_cluster(address)   # Ray's SDK asks the Ray Client server for the job server
    if address and "://" in address:
        url = address.rstrip("/")
    else:
        url = _job_server_from_gcs(prepare_cluster(address))
    check_tcp(url, "Ray job server (dashboard)")
    status = _http_status(url, {})
    if status in (401, 403):
        user_mode = os.environ.get(AUTH_MODE_ENV)
        if user_mode is None and not token_available():
            raise ServiceError(f"the Ray job server at {url} uses token authentication and no token was found in "
                               f"{TOKEN_SOURCES}: put the cluster's token there (`ray get-auth-token` on its head "
                               "prints it)")
        if user_mode is not None and user_mode.lower() != "token":
            raise ServiceError(f"the Ray job server at {url} uses token authentication but RAY_AUTH_MODE is "
                               f"{user_mode!r} here: unset RAY_AUTH_MODE (or set it to token)")
        use_token_auth()
        from ray._raylet import AuthenticationTokenLoader

        status = _http_status(url, AuthenticationTokenLoader.instance().get_token_for_http_header())
        if status in (401, 403):
            raise ServiceError(f"the Ray job server at {url} rejected the token in {TOKEN_SOURCES}: use the "
                               "cluster's token (`ray get-auth-token` on its head prints it)")
    if status != 200:
        raise ServiceError(f"{url} answers HTTP {status} to /api/version, not as a Ray job server: give the "
                           "dashboard address, e.g. http://<head>:8265")
    return url


def _job_server_from_gcs(gcs_address: str) -> str:
    """The dashboard (job server) address the cluster registered in its GCS."""
    from ray._private import ray_constants
    from ray._raylet import GcsClient

    try:
        value = GcsClient(address=gcs_address).internal_kv_get(
            ray_constants.DASHBOARD_ADDRESS.encode(), ray_constants.KV_NAMESPACE_DASHBOARD, timeout=10)
    except Exception as exc:
        raise ServiceError(f"cannot read the job server's address from the Ray cluster at {gcs_address}: "
                           f"{_one_line(exc)}; pass --address http://<head>:8265") from exc
    if not value:
        raise ServiceError(f"the Ray cluster at {gcs_address} has no job server (no dashboard runs): an embedded "
                           "`cpattn serve` has none; use `ray start --head` (with ray[default] installed) and "
                           "`cpattn serve --address auto`, or pass --address http://<head>:8265")
    return "http://" + value.decode()


def _http_status(url: str, headers: dict) -> int:
    import http.client
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url + "/api/version", headers=dict(headers))
    try:
        with urllib.request.urlopen(request, timeout=TCP_TIMEOUT_S + 2) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except http.client.HTTPException as exc:   # something else listens there (e.g. the GCS port)
        raise ServiceError(f"{url} does not answer HTTP ({type(exc).__name__}): give the job server's address, "
                           "the dashboard port (http://<head>:8265), not the GCS port") from exc
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "reason", None) or exc
        raise ServiceError(f"cannot reach the Ray job server at {url}: {reason}. Check the address (the "
                           "dashboard port, default 8265) and that the cluster is running") from exc
