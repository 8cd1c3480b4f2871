"""Client leases: a client proves it is alive by its calls and by a heartbeat; the coordinator ends a client
whose lease lapsed (client_lease_s without either):

- its open step is rolled back (its pages return; its sequences can be freed again),
- its data-plane groups are dropped on every shard (connections and file descriptors closed),
- its sequences are freed, or kept when it connected with ``on_lapse="keep"``.

``close()`` ends a client the same way except that its sequences always stay (the service outlives its
clients; their ids keep working), which is what a client that exits on purpose asked for.

The client side is ``LeaseKeeper``: a daemon thread renewing every ``client_lease_s / 3``.
"""

from __future__ import annotations

import logging
import threading

import ray

from cpattn.cluster.rpc import remote_cause
from cpattn.errors import AccessDeniedError

logger = logging.getLogger("cpattn")

ON_LAPSE = ("free", "keep")


class LeaseKeeper(threading.Thread):
    """Renews one client's lease until stopped (close/shutdown) or the coordinator says it has ended."""

    def __init__(self, coordinator, credential: str, lease_s: float):
        super().__init__(daemon=True, name="cpattn-lease")
        self._coordinator = coordinator
        self._credential = credential
        self._period = lease_s / 3
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(self._period):
            try:
                alive = ray.get(self._coordinator.renew.remote(self._credential), timeout=self._period * 2)
            except ray.exceptions.RayTaskError as exc:
                # The coordinator no longer knows the credential: this client has ended.
                alive = remote_cause(exc, AccessDeniedError) is None
                if alive:
                    logger.debug("lease renewal failed: %s", exc)
                    continue
            except Exception as exc:   # a coordinator restarting or busy: retry next period
                logger.debug("lease renewal failed: %s", exc)
                continue
            if not alive:
                logger.warning("the service ended this client (its lease lapsed); connect again")
                return

    def stop(self) -> None:
        self._stop_event.set()
