"""cpattn: Ray-distributed context-parallel attention over a sharded paged KV cache.

Public API: ServiceConfig, start, connect (see README). Imports nothing heavy: Ray and the
service load on first use of start/connect.
"""

from cpattn.config import ServiceConfig, load_config
from cpattn.errors import (AccessDeniedError, BackendUnavailableError, CapacityError, CpattnError,
                           IncompleteStepError, InvalidRequestError, ShardLostError, StepFencedError)

__version__ = "0.1.0"


def start(config: ServiceConfig | None = None, **fields):
    """Start a service (embedded local Ray unless config.ray_address) and return its client."""
    from cpattn.client import start as _start
    from cpattn.cluster.service import check_backend

    if config is not None and (fields or not isinstance(config, ServiceConfig)):
        from cpattn.errors import ConfigError

        raise ConfigError(f"cpattn.start takes a cpattn.ServiceConfig or its fields as keywords, got "
                          f"{type(config).__name__}{' and fields ' + ', '.join(fields) if fields else ''}: pass "
                          "start(ServiceConfig(...)), start(num_shards=2, ...) or start(cpattn.load_config(path))")
    config = config if config is not None else ServiceConfig(**fields)
    check_backend(config)   # a backend that cannot serve the settings fails here, before Ray or any actor starts
    return _start(config)


def connect(name: str = "cpattn", namespace: str = "cpattn", address: str | None = None, timeout_s: float = 60.0,
            on_lapse: str = "free", credential: str | None = None, operator_credential: str | None = None):
    """Attach to a running service by the name of its coordinator actor (on_lapse: see client.connect)."""
    from cpattn.client import connect as _connect

    return _connect(name=name, namespace=namespace, address=address, timeout_s=timeout_s, on_lapse=on_lapse,
                    credential=credential, operator_credential=operator_credential)


__all__ = ["ServiceConfig", "load_config", "start", "connect", "CpattnError", "AccessDeniedError", "BackendUnavailableError",
           "IncompleteStepError",
           "CapacityError", "InvalidRequestError", "ShardLostError", "StepFencedError", "__version__"]
