"""Sequence ids as plain ``str``: a str subclass (numpy.str_, or one with its own __hash__/__eq__) is read as the
plain string it holds, so one sequence can never appear twice in a request under two 'different' keys."""

from __future__ import annotations

import secrets

from cpattn.errors import InvalidRequestError


def new_sequence_id() -> str:
    """A fresh sequence id; unguessable, because with its owner's credential the id is the capability."""
    return "seq-" + secrets.token_urlsafe(16)


def canonical_id(seq_id):
    """The exact ``str`` of a str (subclass) id; anything else unchanged (rejected later as unknown)."""
    return str.__str__(seq_id) if isinstance(seq_id, str) else seq_id


def canonical_request(request: dict) -> dict:
    """``{seq_id: n}`` with plain-str keys; InvalidRequestError when two keys name one sequence."""
    out: dict = {}
    for seq_id, n in request.items():
        key = canonical_id(seq_id)
        if isinstance(key, str) and key in out:
            raise InvalidRequestError(f"sequence {key} appears twice in the step request: give each sequence "
                                      "once, with all its new tokens")
        out[key] = n
    return out
