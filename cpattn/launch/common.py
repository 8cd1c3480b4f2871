"""Shared by the CLI's commands: the argument-parser policy and joining the Ray cluster a service runs on."""

from __future__ import annotations

import argparse
import difflib
import os
import re

# ServiceConfig fields with no --flag of their own: set by --name, --namespace, --address, or fixed by serve (detached).
SERVICE_FLAG_EXCLUDED = {"name", "namespace", "ray_address", "detached"}


class Parser(argparse.ArgumentParser):
    """cpattn's argument policy, for every command: no prefix matching (``--num-shard 4`` is an error, not
    ``--num-shards``), and a usage error is one line on stderr with exit status 1 (argparse prints its usage
    block and exits 2), naming the closest option when one was mistyped."""

    def __init__(self, *args, **kwargs):
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        hint = self._suggestion(message)
        self.exit(1, f"{self.prog}: error: {message}{hint} (`{self.prog} --help` lists the options)\n")

    def parse_args(self, args=None, namespace=None):
        """As argparse's, but an unknown option is reported by the subcommand it was given to."""
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            owner = self._subcommand_parser(parsed) or self
            owner.error("unrecognized arguments: " + " ".join(extras))
        return parsed

    def _subcommand_parser(self, parsed: argparse.Namespace) -> argparse.ArgumentParser | None:
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                return action.choices.get(getattr(parsed, action.dest, None) or "")
        return None

    def _suggestion(self, message: str) -> str:
        match = re.match(r"unrecognized arguments: (-\S+)", message)
        if not match:
            return ""
        known = [s for action in self._actions for s in action.option_strings]
        close = difflib.get_close_matches(match.group(1).split("=", 1)[0], known, n=1, cutoff=0.75)
        return f": did you mean {close[0]}?" if close else ""


def attach(address: str | None, namespace: str) -> bool:
    """Connect to the service's cluster; returns True when this call connected (and should disconnect).

    Default address: RAY_ADDRESS, else 'auto' (the cluster started on this machine by `ray start` or by an
    embedded `cpattn serve`). The address is checked first (reachable within seconds, a Ray GCS) and Ray's
    token authentication is used when the cluster asks for it (cpattn/cluster/reach.py): the token comes
    from RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token.
    """
    import logging

    import ray

    from cpattn.cluster.reach import join_cluster

    if ray.is_initialized():
        return False
    join_cluster(default_address(address) or "auto", namespace, logging_level=logging.WARNING, log_to_driver=False)
    return True


def in_range(kind: type, low: float, high: float):
    """An argparse type: a finite ``kind`` in [low, high] (demo's nan, inf, -1 and 1e300 ran, hung or crashed)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {kind.__name__} value: {text!r}") from None
        if not (low <= value <= high):   # (False for nan)
            raise argparse.ArgumentTypeError(f"{text} is not in {low:g}..{high:g}")
        return value

    return parse


def default_address(address: str | None) -> str | None:
    """Every command's cluster: --address, else RAY_ADDRESS, else None (the command's own default)."""
    return address or os.environ.get("RAY_ADDRESS") or None


def detach(connected: bool) -> None:
    if connected:
        import ray

        ray.shutdown()
