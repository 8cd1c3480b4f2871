"""``cpattn``: one command, one subcommand per task; heavy modules load only inside the subcommand run.

    cpattn serve [-c service.yaml] [--num-shards 8 ...] [--address ray://head:10001]
    cpattn status | stop [--name cpattn] [--namespace cpattn] [--address auto]
    cpattn list [--address auto]                    (every service on the cluster)
    cpattn submit [--address http://head:8265] -- python examples/long_context_job.py
    cpattn bench ... | cpattn demo ...      (arguments pass through to the benchmark / demo)
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from cpattn.launch.common import SERVICE_FLAG_EXCLUDED, Parser, in_range

_PASSTHROUGH = {"bench": "cpattn.launch.bench", "demo": "cpattn.launch.demo"}
_COMMANDS = {"serve": ("cpattn.launch.serve", "serve"), "status": ("cpattn.launch.status", "status"),
             "stop": ("cpattn.launch.status", "stop"), "list": ("cpattn.launch.status", "list_services"),
             "submit": ("cpattn.launch.submit", "submit")}
_CLUSTER_HELP = ("Ray cluster of the service: 'auto', 'head:6379' or 'ray://head:10001' "
                 "(default: RAY_ADDRESS, else auto: the cluster on this machine)")


def _add_target_flags(p: argparse.ArgumentParser, address_help: str) -> None:
    p.add_argument("--name", default=None, help="name of the service's coordinator actor (default: cpattn)")
    p.add_argument("--namespace", default=None, help="Ray namespace of the service (default: cpattn)")
    p.add_argument("--address", default=None, help=address_help)


def _add_operator_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--operator-credential", default=None, metavar="CREDENTIAL",
                   help="the credential `cpattn serve` printed (default: CPATTN_OPERATOR_CREDENTIAL, else the file "
                        "serve wrote on this machine, ~/.cpattn/operators/...)")


def _add_service_flags(p: argparse.ArgumentParser) -> None:
    """One --flag per ServiceConfig field; values are strings that pydantic validates (and names on error)."""
    from cpattn.config import ServiceConfig

    group = p.add_argument_group("service fields (override the YAML file)")
    for field, info in ServiceConfig.model_fields.items():
        if field in SERVICE_FLAG_EXCLUDED:
            continue
        default = info.default
        group.add_argument("--" + field.replace("_", "-"), dest=field, default=None, metavar="V",
                           help=f"{' '.join((info.description or '').split())} (default: {default})".replace("%", "%%"))


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="cpattn", description="Ray-distributed context-parallel attention service.",
        epilog="Run `cpattn <command> --help` for each command's options.")
    sub = parser.add_subparsers(dest="command", metavar="command", required=True)

    serve = sub.add_parser(
        "serve", help="start a detached, named service on a Ray cluster",
        description="Start a detached, named cpattn service from a YAML file and/or flags (flags win). "
                    "With --address (or ray_address in the file) it joins that cluster and returns once the "
                    "service is up. Without it, it starts an embedded local Ray instance that lives only as "
                    "long as this process: serve then blocks until Ctrl-C (or SIGTERM) and stops the service.")
    serve.add_argument("-c", "--config", help="service YAML (fields of ServiceConfig; see examples/)")
    _add_target_flags(serve, "Ray cluster to join: 'auto', 'ray://head:10001' or 'head:6379' "
                             "(default: RAY_ADDRESS, else the file's ray_address, else an embedded local Ray)")
    _add_service_flags(serve)

    status = sub.add_parser("status", help="shards, nodes, devices, KV blocks, sequences, backend",
                            description="Describe a running service: shards and where they run, KV blocks "
                                        "used/free per shard, sequences, the attention backend chosen and its "
                                        "kernel version.")
    _add_target_flags(status, _CLUSTER_HELP)
    status.add_argument("--json", action="store_true", help="print the raw description and stats as JSON")
    _add_operator_flag(status)

    stop = sub.add_parser("stop", help="stop a service (shards, placement group, coordinator)",
                          description="Stop a running service and release its KV memory and placement group.")
    _add_target_flags(stop, _CLUSTER_HELP)
    _add_operator_flag(stop)

    listing = sub.add_parser("list", help="every cpattn service on the cluster: shards, clients, sequences, KV, age",
                             description="List every cpattn service on the cluster (all namespaces): shards, "
                                         "clients, sequences, KV blocks and memory in use, and age.")
    listing.add_argument("--address", default=None, help=_CLUSTER_HELP)
    listing.add_argument("--json", action="store_true", help="print the services as JSON")

    submit = sub.add_parser(
        "submit", help="run a script as a Ray job, with this directory as its working_dir",
        description="Submit ENTRYPOINT as a Ray job (Job Submission SDK) with the working directory uploaded "
                    "as runtime_env, stream its logs, and exit with the job's status (0 succeeded, 1 failed, "
                    "2 stopped). Ctrl-C or SIGTERM stops the job, and so does a job still pending after "
                    "--pending-timeout-s.",
        epilog="example: cpattn submit --address http://127.0.0.1:8265 -- python examples/long_context_job.py")
    submit.add_argument("--address", default=None,
                        help="Ray dashboard address, e.g. http://head:8265 (default: RAY_ADDRESS, else the local cluster)")
    submit.add_argument("--working-dir", default=".", help="directory uploaded as the job's working_dir (default: .)")
    submit.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                        help="environment variable for the job (repeatable)")
    submit.add_argument("--pip", action="append", default=[], metavar="REQ",
                        help="pip requirement installed in the job's runtime_env (repeatable)")
    submit.add_argument("--entrypoint-num-cpus", type=in_range(float, 0, 1e6), default=None,
                        help="CPUs reserved for the entrypoint")
    submit.add_argument("--entrypoint-num-gpus", type=in_range(float, 0, 1e6), default=None,
                        help="GPUs reserved for the entrypoint (Ray sets its CUDA_VISIBLE_DEVICES); 0.5 leaves the "
                             "other half of its GPU to a cpattn shard the job computes in-process")
    submit.add_argument("--pending-timeout-s", type=in_range(float, 1, 1e6), default=600.0,
                        help="give up on a job that has not started after this many seconds (no node has the "
                             "entrypoint's resources free, or its runtime_env is still being set up) and tell it "
                             "to stop (default: 600; a reminder every 30 s says what it waits for)")
    submit.add_argument("--submission-id", default=None, help="job id to use (default: generated)")
    submit.add_argument("--no-wait", action="store_true", help="print the job id and return without streaming")
    submit.add_argument("entrypoint", nargs=argparse.REMAINDER, help="command to run, after `--`")

    # These two hand every argument to their own parser; `cpattn bench --help` shows the benchmark's help.
    sub.add_parser("bench", add_help=False, help="run the service benchmark (benchmarks/service_bench.py; "
                                                 "--quick: under a minute)")
    sub.add_parser("demo", add_help=False, help="run the demo (cpattn.launch.demo)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    import importlib

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _PASSTHROUGH:
        command, run = argv[0], lambda: _run_passthrough(argv[0], argv[1:])
        args = None
    else:
        args = build_parser().parse_args(argv)
        command = args.command
        module, function = _COMMANDS[command]
        run = lambda: getattr(importlib.import_module(module), function)(args)   # noqa: E731
    from cpattn.errors import CpattnError

    try:
        return run()
    except CpattnError as exc:
        print(f"cpattn {command}: error: {exc}{_address_origin(args, str(exc))}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"cpattn {command}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        # Ray's own errors (a connection lost mid-command, an RPC failure ...) end the command the same way:
        # one line, not a traceback. Bugs of cpattn's own still show their traceback with CPATTN_DEBUG=1.
        if os.environ.get("CPATTN_DEBUG") or not _is_ray_error(exc):
            raise
        print(f"cpattn {command}: error: {_one_line(exc)} (CPATTN_DEBUG=1 shows the traceback)", file=sys.stderr)
        return 1


def _address_origin(args: argparse.Namespace | None, error: str) -> str:
    """Where the cluster address an error names came from, when it was not typed on this command line: fixing
    --address does nothing for a bad RAY_ADDRESS or ray_address in the YAML file."""
    if args is None or getattr(args, "address", None):
        return ""
    for variable in ("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS"):
        value = os.environ.get(variable)
        if value and value in error:
            return f" (that address came from {variable}: correct or unset it, or pass --address)"
    path = getattr(args, "config", None)
    try:
        import yaml

        with open(path, encoding="utf-8") as f:
            value = (yaml.safe_load(f) or {}).get("ray_address")
    except Exception:   # no file, or one that cannot be read again: nothing to add
        return ""
    if isinstance(value, str) and value and value in error:   # (a YAML alias could make it any size)
        return f" (that address came from ray_address in {path}: correct it there, or pass --address)"
    return ""


def _is_ray_error(exc: BaseException) -> bool:
    """An error from Ray, its Job SDK, or the network under them (not a bug of cpattn's own)."""
    module = type(exc).__module__ or ""
    return module.split(".")[0] in ("ray", "requests", "urllib3", "aiohttp", "grpc") or isinstance(
        exc, (ConnectionError, TimeoutError))


def _one_line(exc: BaseException) -> str:
    import re

    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).strip()
    first = text.splitlines()[0] if text else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def _run_passthrough(command: str, rest: list[str]) -> int:
    import importlib

    module = importlib.import_module(_PASSTHROUGH[command])
    result = module.main(rest)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
