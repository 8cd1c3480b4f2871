"""Shared prefixes: forking a sequence, and granting forks of it to another client by a signed token.

A fork is a new sequence whose first tokens are another's; it shares that sequence's pages on every
shard and replica (reference counts in the block pools, kvstore/sharded_allocator.py), so forking a
million-token prefix costs no prefill and no KV. Pure state like SequenceTable (the coordinator holds
its lock around every call); no Ray.

Across clients nothing is visible without a grant: ``share`` returns a token
``share|seq_id|owner|num_tokens|expires_at|HMAC(secret, ...)`` signed with the service's shard secret
(kept in the journal, so tokens outlive a coordinator restart and no other service accepts them). The
token names the sequence, but the id alone gives nothing: every call on a sequence checks its owner.
A token grants forks of the sequence's first ``num_tokens`` tokens (its length when shared) until it
expires or the owner frees the sequence; forks made before stay intact either way (they hold references).
"""

from __future__ import annotations

import hashlib
import hmac
import time
from dataclasses import dataclass
from typing import Callable

from cpattn.cluster.authority import as_bytes, same_text
from cpattn.cluster.ids import canonical_id, new_sequence_id
from cpattn.cluster.sequence_table import Sequence, SequenceTable
from cpattn.errors import AccessDeniedError, InvalidRequestError

DEFAULT_SHARE_TTL_S = 3600.0
MAX_SHARE_TTL_S = 7 * 24 * 3600.0


@dataclass(frozen=True)
class ShareGrant:
    seq_id: str
    owner: str
    num_tokens: int
    expires_at: float


def _mac(secret: str, body: str) -> str:
    return hmac.new(as_bytes(secret), as_bytes(f"share|{body}"), hashlib.sha256).hexdigest()


def make_share_token(secret: str, grant: ShareGrant) -> str:
    body = f"{grant.seq_id}|{grant.owner}|{grant.num_tokens}|{grant.expires_at:.3f}"
    return f"share|{body}|{_mac(secret, body)}"


def read_share_token(secret: str, token, now: float) -> ShareGrant:
    """The grant a genuine, unexpired token carries; AccessDeniedError (saying which) otherwise."""
    parts = token.split("|") if isinstance(token, str) else []
    if len(parts) != 6 or parts[0] != "share":
        raise AccessDeniedError("fork_shared refused: that is not a share token (use the string share() returned)")
    body, mac = "|".join(parts[1:5]), parts[5]
    if not same_text(mac, _mac(secret, body)):
        raise AccessDeniedError("fork_shared refused: the share token was not issued by this service (altered, "
                                "forged, or from another service): ask the sequence's owner for share()")
    seq_id, owner, num_tokens, expires_at = parts[1], parts[2], int(parts[3]), float(parts[4])
    if now > expires_at:
        raise AccessDeniedError(f"fork_shared refused: the share token expired {now - expires_at:.0f}s ago: ask the "
                                "sequence's owner for a new share()")
    return ShareGrant(seq_id, owner, num_tokens, expires_at)


class PrefixSharing:
    def __init__(self, table: SequenceTable, secret: Callable[[], str], clock: Callable[[], float] = time.time,
                 pending: Callable[[str], dict[str, int]] = lambda client_id: {}):
        self.table = table
        self._pending = pending   # a client's open steps' lengths (OpenSteps.pending_lengths): held for its quota
        self._secret = secret   # the service's shard secret (restored with the journal after a restart)
        self._clock = clock

    def _source(self, client_id: str, seq_id) -> Sequence:
        self.table.raise_if_unavailable([seq_id], client_id)
        return self.table.get(seq_id, client_id)

    @staticmethod
    def _prefix_len(source: Sequence, num_tokens) -> int:
        if num_tokens is None:
            return source.length
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or not 0 <= num_tokens <= source.length:
            raise InvalidRequestError(f"num_tokens {num_tokens!r} must be an int in 0..{source.length} (the length "
                                      f"of sequence {source.seq_id}), or None for all of it")
        return num_tokens

    def fork(self, client_id: str, seq_id, num_tokens=None) -> str:
        """A new sequence of the client holding the first ``num_tokens`` (default: all) of its ``seq_id``."""
        source = self._source(client_id, seq_id)
        return self._fork(source, client_id, self._prefix_len(source, num_tokens))

    def share(self, client_id: str, seq_id, num_tokens=None, ttl_s=DEFAULT_SHARE_TTL_S) -> str:
        """A token with which any client of this service may fork the first ``num_tokens`` of ``seq_id``."""
        source = self._source(client_id, seq_id)
        n = self._prefix_len(source, num_tokens)
        if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not 0 < ttl_s <= MAX_SHARE_TTL_S:
            raise InvalidRequestError(f"ttl_s {ttl_s!r} must be a number of seconds in (0, {MAX_SHARE_TTL_S:g}]")
        grant = ShareGrant(source.seq_id, client_id, n, self._clock() + float(ttl_s))
        return make_share_token(self._secret(), grant)

    def fork_shared(self, client_id: str, token) -> str:
        """A new sequence of the client holding the prefix a share token grants."""
        grant = read_share_token(self._secret(), token, self._clock())
        source = self.table.sequences.get(canonical_id(grant.seq_id))
        if source is None or source.owner != grant.owner:
            raise InvalidRequestError("fork_shared: the shared sequence was freed by its owner, so its token no "
                                      "longer grants forks (forks made before keep their KV): ask for a new share")
        self.table.raise_if_unavailable([source.seq_id], grant.owner)
        return self._fork(source, client_id, grant.num_tokens)

    def _fork(self, source: Sequence, client_id: str, num_tokens: int) -> str:
        if source.in_step is not None:
            raise InvalidRequestError(f"sequence {source.seq_id} is in open step {source.in_step}: fork it after "
                                      "that step ends (its pages are still being written)")
        self.table.limits.check_quota(self.table.owned_by(client_id), num_tokens, self._pending(client_id))
        return self.table.fork(source, client_id, new_sequence_id(), num_tokens).seq_id
