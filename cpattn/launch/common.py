"""Joining the Ray cluster a service runs on, for the CLI's short-lived client processes."""

from __future__ import annotations

import os


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
    address = address or os.environ.get("RAY_ADDRESS") or "auto"
    join_cluster(address, namespace, logging_level=logging.WARNING, log_to_driver=False)
    return True


def detach(connected: bool) -> None:
    if connected:
        import ray

        ray.shutdown()
