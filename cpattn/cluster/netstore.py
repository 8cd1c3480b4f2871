"""The data plane's rendezvous store, listening on one address only (the node IP the shards use).

torch's TCPStore master listens on every interface by default; here the listening socket is bound to
``host`` first and handed over (``master_listen_fd``), so the store is not reachable on other interfaces.
"""

from __future__ import annotations

import datetime
import socket

import torch.distributed as dist

from cpattn.errors import DataPlaneError


def make_bound_store(host: str, world_size: int, timeout_s: float) -> dist.TCPStore:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((host, 0))
        sock.listen(world_size * 4)
        port = sock.getsockname()[1]
    except OSError as exc:
        sock.close()
        raise DataPlaneError(f"cannot listen for the data plane's rendezvous on {host} ({exc.strerror or exc}): "
                             "the address must be this node's (Ray's node IP, or data_plane_interface's)") from exc
    fd = sock.detach()   # the store owns the descriptor from here on (and closes it with itself)
    return dist.TCPStore(host, port, world_size, True, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False, master_listen_fd=fd)
