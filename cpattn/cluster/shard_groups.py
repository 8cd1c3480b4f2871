"""A shard's data-plane groups: a client joins one with a ticket from the coordinator, leaves it, or is dropped
with every group of it when it ends; a step of a fenced coordinator incarnation drops its group.

A mixin of cluster.shard.ShardWorker (its lock, secret, groups and tickets); ShardWorker.run_step serves the
layers of a step from a group joined here.
"""

from __future__ import annotations

import logging
import threading
import time

from cpattn.cluster import authority
from cpattn.cluster.data_plane import DataPlane, connect_group
from cpattn.cluster.decode_graphs import DecodeGraphs
from cpattn.cluster.fencing import StepFence
from cpattn.cluster.netbind import bind_address
from cpattn.cluster.shard_graphs import ShardStepGraphs
from cpattn.cluster.step_planner import ShardStepPlan
from cpattn.config import ServiceConfig
from cpattn.errors import AccessDeniedError, CapacityError, ServiceError

logger = logging.getLogger("cpattn.shard")

# Data-plane joins a shard runs at once: per client (a client joins one group at a time; two lets a rejoin
# overlap a join still timing out), and in all (half of shard_set.SHARD_THREAD_HEADROOM), so joins that never
# finish their handshake can never take the threads open steps need.
MAX_JOINS_PER_CLIENT = 2
MAX_JOINS_IN_FLIGHT = 8
# Groups one client holds on a shard, joined or joining: a client uses one at a time (a rebuild leaves the old one
# without waiting, so a few may overlap); without a bound each genuine ticket could pin another communicator
# (sockets, threads, NCCL memory) until the client ends.
MAX_GROUPS_PER_CLIENT = 8


def _node_ip() -> str:
    """This node's IP as Ray knows it (loopback when used as a plain class, without a Ray worker)."""
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:
        return "127.0.0.1"


class ShardGroups:
    """ShardWorker's remote methods on its data-plane groups, and dropping a group a fenced step used."""

    config: ServiceConfig
    bundle_index: int
    _secret: str | None
    _lock: threading.Lock
    _fence: StepFence
    _groups: dict[str, DataPlane]
    _graphs: dict[str, DecodeGraphs | None]
    _step_graphs: dict[str, ShardStepGraphs]
    _admitted: dict[str, float]
    _ended: dict[str, float]
    _joining: dict[str, int]

    def _refuse_fenced(self, plane: DataPlane, plan: ShardStepPlan, timings: dict | None = None) -> dict:
        """A step of a fenced incarnation: write nothing, and drop its group so the client's collective fails
        now (the client then learns from the coordinator that the step must be run again)."""
        with self._lock:
            names = [n for n, p in self._groups.items() if p is plane]
            for name in names:
                del self._groups[name]
        self._drop_graphs(names)
        plane.close()
        logger.warning("shard %d: step %d of coordinator incarnation %d refused (fenced at %d)", self.bundle_index,
                       plan.step_id, plan.incarnation, self._fence.floor)
        return dict(timings or {}, outcome="fenced",
                    error=f"step {plan.step_id} was fenced by a restarted coordinator")

    def _live_ticket(self, group_name: str, ticket: str | None) -> authority.Ticket | None:
        """Under the lock: a genuine ticket (the surface checked its HMAC) that has not expired and whose
        client has not ended since it was issued; raises AccessDeniedError otherwise."""
        if self._secret is None:
            return None
        t = authority.read_ticket(self._secret, group_name, ticket)
        if t is None:   # only a caller bypassing the surface gets here (a plain worker, in-process)
            raise AccessDeniedError(f"shard {self.bundle_index}: group {group_name!r} refused: no valid ticket (get "
                                    "one from the coordinator with the client's credential)")
        now, ttl = time.time(), self.config.client_lease_s
        # Forget what can no longer matter: tickets older than ttl are refused as expired anyway.
        self._admitted = {k: exp for k, exp in self._admitted.items() if exp >= now}
        self._ended = {c: at for c, at in self._ended.items() if at >= now - 2 * ttl}
        if now > t.issued_at + ttl:
            raise AccessDeniedError(f"shard {self.bundle_index}: group {group_name!r} refused: its ticket expired "
                                    f"(tickets last client_lease_s={ttl:g}s): get a new one")
        if t.issued_at <= self._ended.get(t.client_id, float("-inf")):
            raise AccessDeniedError(f"shard {self.bundle_index}: group {group_name!r} refused: the ticket's client "
                                    "ended after it was issued: connect again")
        return t

    def join_group(self, group_name: str, host: str, port: int, rank: int, world_size: int, backend: str,
                   ticket: str | None = None) -> bool:
        """Join a client's data-plane group: one join per ticket, at most MAX_JOINS_PER_CLIENT (and
        MAX_JOINS_IN_FLIGHT overall) at once, and a handshake that does not finish within join_timeout_s
        gives its thread back (it goes on, bounded by collective_timeout_s, in a thread of its own)."""
        with self._lock:
            t = self._live_ticket(group_name, ticket)
            client = t.client_id if t is not None else group_name
            if ticket in self._admitted or group_name in self._groups:
                raise AccessDeniedError(f"shard {self.bundle_index}: group {group_name!r} refused: its ticket was "
                                        "already used (a ticket admits one join): rejoin under a new group name")
            if self._joining.get(client, 0) >= MAX_JOINS_PER_CLIENT or sum(self._joining.values()) >= MAX_JOINS_IN_FLIGHT:
                raise CapacityError(f"shard {self.bundle_index}: {self._joining.get(client, 0)} joins of this client "
                                    f"and {sum(self._joining.values())} in all are still in their handshake (at most "
                                    f"{MAX_JOINS_PER_CLIENT} per client, {MAX_JOINS_IN_FLIGHT} in all): finish or "
                                    "abandon those first, then retry", shard=self.bundle_index)
            held = sum(1 for n in self._groups if n.startswith(f"{client}-")) + self._joining.get(client, 0)
            if held >= MAX_GROUPS_PER_CLIENT:
                raise CapacityError(f"shard {self.bundle_index}: this client holds {held} data-plane groups here (at "
                                    f"most {MAX_GROUPS_PER_CLIENT}): leave_group the ones it no longer uses, then "
                                    "retry", shard=self.bundle_index)
            if t is not None:
                self._admitted[ticket] = t.issued_at + self.config.client_lease_s
            self._joining[client] = self._joining.get(client, 0) + 1
        outcome: dict = {}
        done = threading.Event()
        cfg = self.config
        bind_ip, interface = bind_address(_node_ip(), cfg.data_plane_interface)

        def handshake() -> None:
            try:
                group = connect_group(host, port, group_name, rank, world_size, backend, cfg.collective_timeout_s,
                                      bind_ip=bind_ip, interface=interface,
                                      explicit_interface=bool(cfg.data_plane_interface))
                plane = DataPlane(group, rank, world_size, backend)
                with self._lock:
                    if outcome.get("abandoned"):
                        plane.close()   # the caller was told it failed: nobody will use this group
                    else:
                        self._groups[group_name] = plane
                        outcome["joined"] = True
            except BaseException as exc:
                outcome["error"] = exc
            finally:
                with self._lock:
                    self._joining[client] -= 1
                    if not self._joining[client]:
                        del self._joining[client]
                done.set()

        threading.Thread(target=handshake, daemon=True, name=f"cpattn-join-{group_name}").start()
        done.wait(self.config.join_timeout_s)
        with self._lock:
            if not outcome.get("joined") and "error" not in outcome:
                outcome["abandoned"] = True
                raise ServiceError(f"shard {self.bundle_index}: group {group_name!r}: the handshake did not finish "
                                   f"within join_timeout_s={self.config.join_timeout_s:g}s: is the client's store "
                                   "reachable from the shards? join again")
        if "error" in outcome:
            raise outcome["error"]
        return True

    def drop_client(self, secret: str, client_id: str, ended_at: float | None = None) -> int:
        """Close every data-plane group of a client that ended (close() or a lapsed lease); returns how many.
        Its tickets issued up to ``ended_at`` (the coordinator's clock) are void from now on."""
        with self._lock:
            self._ended[client_id] = time.time() if ended_at is None else ended_at
            names = [n for n in self._groups if n.startswith(f"{client_id}-")]
            planes = [self._groups.pop(n) for n in names]
        self._drop_graphs(names)
        for plane in planes:
            plane.close()
        return len(planes)

    def group_names(self, secret: str | None = None) -> list[str]:
        with self._lock:
            return list(self._groups)

    def leave_group(self, group_name: str, ticket: str | None = None) -> None:
        """Leaving needs a genuine ticket of the group (checked by the surface), spent or expired or not."""
        with self._lock:
            plane = self._groups.pop(group_name, None)
        self._drop_graphs([group_name])
        if plane is not None:
            plane.close()

    def _drop_graphs(self, names: list[str]) -> None:
        """Forget the groups' graphs; step graphs captured NCCL work, so they go before the communicator does
        (destroying a communicator that captured graphs still hold hangs in its abort)."""
        with self._lock:
            dropped = [self._step_graphs.pop(n, None) for n in names]
            for name in names:
                self._graphs.pop(name, None)
        for step_graphs in dropped:
            if step_graphs is not None:
                step_graphs.release()
