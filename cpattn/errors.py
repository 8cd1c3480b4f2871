"""One exception hierarchy for cpattn.

Every error says what to change. They pickle across Ray actors: each keeps its constructor
arguments in ``args`` so Ray can rebuild it on the caller's side.
"""

from __future__ import annotations


class CpattnError(Exception):
    """Base of every error cpattn raises on purpose."""


class ConfigError(CpattnError, ValueError):
    """A configuration value is invalid; the message names the field, the value and the fix."""


class InvalidRequestError(CpattnError, ValueError):
    """A request was rejected before anything was written (shape, dtype, sequence id, layer ...)."""


class AccessDeniedError(InvalidRequestError):
    """The caller lacks the proof this remote method needs (a client credential, the operator credential, a
    group ticket, or the service's own secret); nothing changed. README "Security" lists who may call what."""


class IncompleteStepError(InvalidRequestError):
    """A step's ``with`` block ended normally with layers never attended: it was rolled back (none of its
    tokens were committed); ``missing`` lists those layers."""

    def __init__(self, message: str, missing: list[int] | None = None):
        super().__init__(message, missing)
        self.message = message
        self.missing: list[int] = list(missing or [])

    def __str__(self) -> str:
        return self.message


class BackendUnavailableError(CpattnError):
    """No attention backend can serve the configuration; ``reasons`` maps backend name -> reasons."""

    def __init__(self, message: str, reasons: dict[str, list[str]] | None = None):
        super().__init__(message, reasons)
        self.message = message
        self.reasons: dict[str, list[str]] = dict(reasons or {})

    def __str__(self) -> str:
        lines = [self.message]
        for name, why in self.reasons.items():
            for reason in why:
                lines.append(f"  {name}: {reason}")
        return "\n".join(lines)


class CapacityError(CpattnError):
    """A shard has too few free KV blocks for the request; nothing was allocated."""

    def __init__(self, message: str, shard: int | None = None, needed: int = 0, free: int = 0):
        super().__init__(message, shard, needed, free)
        self.message = message
        self.shard = shard
        self.needed = needed
        self.free = free

    def __str__(self) -> str:
        return self.message


class ShardLostError(CpattnError):
    """A shard actor died or stopped answering; ``sequences`` lists the sequences whose KV it held."""

    def __init__(self, message: str, shard: int | None = None, sequences: list[str] | None = None):
        super().__init__(message, shard, sequences)
        self.message = message
        self.shard = shard
        self.sequences: list[str] = list(sequences or [])

    def __str__(self) -> str:
        return self.message


class ServiceError(CpattnError):
    """The service could not be started, reached, or shut down; the message says what to check."""


class StepFencedError(ServiceError):
    """A step begun before the coordinator restarted was fenced: the shards stopped writing its KV and it was
    rolled back (none of its tokens were committed); run the step again."""


class DataPlaneError(ServiceError):
    """A data-plane group could not connect within collective_timeout_s; the message names the addresses tried."""
