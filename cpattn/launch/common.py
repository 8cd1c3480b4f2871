"""Joining the Ray cluster a service runs on, for the CLI's short-lived client processes."""

from __future__ import annotations

import os


def attach(address: str | None, namespace: str) -> bool:
    """Connect to the service's cluster; returns True when this call connected (and should disconnect).

    Default address: RAY_ADDRESS, else 'auto' (the cluster started on this machine by `ray start` or by an
    embedded `cpattn serve`). Ray's token authentication applies: the token comes from RAY_AUTH_TOKEN,
    RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token; Ray turns token mode on by itself only for 'auto', so with an
    explicit address the client sets RAY_AUTH_MODE=token.
    """
    import logging

    import ray

    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS") or "auto"
    try:
        ray.init(address=address, namespace=namespace, logging_level=logging.WARNING, log_to_driver=False)
    except ConnectionError as exc:
        raise connection_error(address, exc) from None
    return True


def connection_error(address: str, exc: Exception):
    """A ServiceError for a failed ray.init(address=...), with the token-authentication hint when it applies."""
    from cpattn.errors import ServiceError

    hint = ""
    if address != "auto" and os.environ.get("RAY_AUTH_MODE", "").lower() != "token":
        hint = (" If the cluster uses token authentication (Ray's default), set RAY_AUTH_MODE=token and provide "
                "the cluster's token in RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token.")
    return ServiceError(f"cannot connect to the Ray cluster at {address!r} ({exc}): check the address "
                        f"(start a cluster with `ray start --head` or `cpattn serve`).{hint}")


def detach(connected: bool) -> None:
    if connected:
        import ray

        ray.shutdown()
