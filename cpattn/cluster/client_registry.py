"""The coordinator's clients: public ids, credentials (kept only as SHA-256), leases, resume and lapse.

Pure state: no Ray and no lock (the coordinator holds its lock around every call). A client's public id
(``c-...``) names its groups and appears in stats and logs; its credential is the secret every call proves.
A client that ended keeping sequences keeps its credential too, so ``connect(credential=...)`` resumes it.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import Callable

from cpattn.cluster.authority import UNKNOWN_CLIENT, digest
from cpattn.cluster.lease import ON_LAPSE
from cpattn.errors import InvalidRequestError

@dataclass
class Lease:
    on_lapse: str
    """'free': the client's sequences are freed when its lease lapses; 'keep': they stay."""
    renewed: float
    """Clock time of the client's last call or heartbeat."""


class ClientRegistry:
    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._leases: dict[str, Lease] = {}          # connected clients by public id
        self._by_credential: dict[str, str] = {}     # sha256(credential) -> public id (connected or resumable)

    def __contains__(self, client_id) -> bool:
        return isinstance(client_id, str) and client_id in self._leases

    def __len__(self) -> int:
        return len(self._leases)

    def ids(self) -> list[str]:
        return list(self._leases)

    def client_of(self, credential) -> str | None:
        """The public id a credential belongs to (connected or resumable), else None."""
        return self._by_credential.get(digest(credential)) if isinstance(credential, str) else None

    def is_connected(self, credential) -> bool:
        return self.client_of(credential) in self

    # Question and command pairs: can a client connect / connect it ------------------------------------------
    @staticmethod
    def check_on_lapse(on_lapse) -> None:
        if on_lapse not in ON_LAPSE:
            raise InvalidRequestError(f"on_lapse {on_lapse!r}: use 'free' (a client that dies frees its sequences) "
                                      "or 'keep'")

    def register(self, on_lapse: str) -> tuple[str, str]:
        """A new client: (public id, credential)."""
        self.check_on_lapse(on_lapse)
        client_id = "c-" + secrets.token_hex(6)            # public: group names, stats, logs
        credential = secrets.token_urlsafe(32)              # secret: every call of this client proves it
        self._leases[client_id] = Lease(on_lapse, self._clock())
        self._by_credential[digest(credential)] = client_id
        return client_id, credential

    def resume(self, credential: str, on_lapse: str) -> str:
        """The client of a credential that ended keeping its sequences, connected again."""
        self.check_on_lapse(on_lapse)
        client_id = self.client_of(credential)
        if client_id is None:
            raise InvalidRequestError("unknown credential: its client ended and no sequence of it was kept "
                                      "(connect without a credential for a new client)")
        if client_id in self._leases:
            raise InvalidRequestError("the client of this credential is still connected: close() it first "
                                      "(a credential serves one client at a time)")
        self._leases[client_id] = Lease(on_lapse, self._clock())
        return client_id

    # Leases -------------------------------------------------------------------------------------------------
    def check(self, credential) -> str:
        """The public id of the connected client holding ``credential``; renews its lease (every call does)."""
        client_id = self.client_of(credential)
        if client_id not in self:
            raise InvalidRequestError(UNKNOWN_CLIENT)
        self._leases[client_id].renewed = self._clock()
        return client_id

    def renew(self, credential) -> bool:
        """A heartbeat; False when the client has ended."""
        client_id = self.client_of(credential)
        if client_id not in self:
            return False
        self._leases[client_id].renewed = self._clock()
        return True

    def touch(self, client_id: str) -> None:
        if client_id in self:
            self._leases[client_id].renewed = self._clock()

    def lapsed(self, lease_s: float) -> list[str]:
        """Connected clients with no call or heartbeat for more than ``lease_s``."""
        now = self._clock()
        return [c for c, lease in self._leases.items() if now - lease.renewed > lease_s]

    def end(self, client_id) -> Lease | None:
        """Disconnect a client; its lease (None when it was not connected). Its credential stays (resume)."""
        return self._leases.pop(client_id, None) if isinstance(client_id, str) else None

    def forget(self, client_id: str) -> None:
        """Its credential no longer resumes it (nothing of it was kept)."""
        self._by_credential = {h: c for h, c in self._by_credential.items() if c != client_id}

    # Journal ------------------------------------------------------------------------------------------------
    def to_meta(self) -> dict:
        return {"clients": {c: lease.on_lapse for c, lease in self._leases.items()},
                "credentials": dict(self._by_credential)}

    def restore(self, meta: dict) -> None:
        """After a coordinator restart: every client gets a fresh lease (it could not renew meanwhile)."""
        clients = meta["clients"] if isinstance(meta["clients"], dict) else dict.fromkeys(meta["clients"], "free")
        now = self._clock()
        self._leases = {c: Lease(on_lapse, now) for c, on_lapse in clients.items()}
        self._by_credential = {h: c for h, c in meta.get("credentials", {}).items() if c in self._leases}
