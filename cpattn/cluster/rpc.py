"""Blocking Ray calls with a timeout, and Ray's errors turned into cpattn's."""

from __future__ import annotations

import time

import ray

from cpattn.errors import CpattnError, ServiceError


def remote_cause(exc: BaseException, kind: type[CpattnError] = CpattnError) -> CpattnError | None:
    """The cpattn error (of ``kind``) a remote task or actor method raised, when ``exc`` is Ray's wrapper of one."""
    cause = getattr(exc, "cause", None) if isinstance(exc, ray.exceptions.RayTaskError) else None
    return cause if isinstance(cause, kind) else None


def raise_remote_cause(exc: BaseException, kind: type[CpattnError] = CpattnError) -> None:
    """Raise ``remote_cause(exc, kind)`` as itself, without Ray's remote frames; return when there is none."""
    cause = remote_cause(exc, kind)
    if cause is not None:
        raise cause from None


def call(ref, timeout_s: float, what: str):
    """ray.get with a timeout; our own errors come back as themselves, Ray's as ServiceError."""
    try:
        return ray.get(ref, timeout=timeout_s)
    except ray.exceptions.RayTaskError as exc:
        raise_remote_cause(exc)
        raise ServiceError(f"{what} failed: {exc}") from exc
    except ray.exceptions.GetTimeoutError:
        raise ServiceError(f"{what} did not answer within {timeout_s}s (rpc_timeout_s): is the service overloaded "
                           "or hung? check `cpattn status`") from None
    except ray.exceptions.ActorUnavailableError as exc:
        raise ServiceError(f"{what}: the service is restarting an actor ({exc}); retry shortly") from exc
    except ray.exceptions.RayActorError as exc:
        raise ServiceError(f"{what}: the coordinator is gone ({type(exc).__name__}); restart the service") from exc


def call_across_restart(make_ref, timeout_s: float, what: str, restart_s: float):
    """``call(make_ref(), ...)``, asked again while the actor is being restarted (up to ``restart_s``).

    For idempotent calls to a detached coordinator (end_step: a restarted coordinator knows from its journal
    whether the step committed). Other errors, and a coordinator still gone after restart_s, raise as call().
    """
    deadline = time.monotonic() + restart_s
    while True:
        try:
            return call(make_ref(), timeout_s, what)
        except ServiceError as exc:
            if not isinstance(exc.__cause__, ray.exceptions.RayActorError) or time.monotonic() > deadline:
                raise
        time.sleep(0.2)
