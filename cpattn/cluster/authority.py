"""Who may call which remote method of the coordinator and of the shards (issue 20).

Ray lets any process connected to the cluster call any method of an actor, private ones included. So the
actors Ray runs are *surfaces*: classes built here that hold the real object and expose only the methods
in a table, each checking its caller's proof before delegating:

- the **shard secret**: the coordinator's own calls to its shards (KV copies, plans, fencing, pings);
- a **client credential** (``connect()`` gets one): its own sequences, steps and data-plane groups only;
- a group **ticket** (issued by the coordinator to a client for a group named after it);
- the **operator credential**: made when the service starts (``cpattn.start`` keeps it in
  ``Service.operator_credential``, ``cpattn serve`` prints it once), kept by the actors only as a SHA-256:
  stopping the service, admin stats, and reading what spans tenants (KV checksums, group names).

The tables below are the whole remote API of cpattn's own (README "Security" prints them); tests call every
entry as a stranger and expect a refusal. Ray adds RAY_ACTOR_METHODS to every actor, unguarded: one of them
runs any function on the actor. So these checks hold against clients that use cpattn's API (and against buggy
ones), not against a process holding the Ray token, which is an operator (README "Threat model").
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import inspect
import secrets
from dataclasses import dataclass
from typing import Callable

import ray

from cpattn.errors import AccessDeniedError


@dataclass(frozen=True)
class Rule:
    who: str
    """Who may call (one of the constants below)."""
    proof: str | None
    """The parameter carrying the proof (None: open)."""
    group: str | None = None
    """The actor's concurrency group the method runs in (None: the default one): calls that must never wait
    behind slow ones (a lease's heartbeat, the operator's stop) get threads of their own."""


CONTROL_GROUP = "control"
"""The coordinator's threads for heartbeats and stop (each brief: a lock and a few dict operations)."""
CONTROL_THREADS = 4


OPEN = "anyone connected: how a client gets its credential"
CLIENT = "a client, by its credential (its own sequences, steps and groups only)"
CLIENT_OR_OPERATOR = "a client (by its credential) or the operator"
OPERATOR = "the operator (operator credential)"
SECRET = "the coordinator (shard secret)"
SECRET_OR_OPERATOR = "the coordinator or the operator"
TICKET = "a client with a coordinator-issued ticket for its own group"
PLAN = "the coordinator (a plan carrying the shard secret)"
TEST_HOOK = "the coordinator or the operator, and only when the service was started with test_hooks=True"

COORDINATOR_METHODS: dict[str, Rule] = {
    "register_client": Rule(OPEN, None),
    # A lease's heartbeat never waits behind other calls (end_step may wait rpc_timeout_s on shards): a renewal
    # queued behind them would let the lease lapse, and the client's sequences with it.
    "renew": Rule(CLIENT, "credential", CONTROL_GROUP),
    "unregister_client": Rule(CLIENT, "credential"),
    "group_ticket": Rule(CLIENT, "credential"),
    "add_sequence": Rule(CLIENT, "credential"),
    "free": Rule(CLIENT, "credential"),
    "fork": Rule(CLIENT, "credential"),
    "share": Rule(CLIENT, "credential"),
    "fork_shared": Rule(CLIENT, "credential"),
    "list_sequences": Rule(CLIENT, "credential"),
    "sequence_length": Rule(CLIENT, "credential"),
    "begin_step": Rule(CLIENT, "credential"),
    "end_step": Rule(CLIENT, "credential"),
    "extend_run": Rule(CLIENT, "credential"),
    "fill_synthetic": Rule(CLIENT, "credential"),
    "get_shards": Rule(CLIENT_OR_OPERATOR, "credential"),
    "describe": Rule(CLIENT_OR_OPERATOR, "credential"),
    "stats": Rule(CLIENT_OR_OPERATOR, "credential"),   # admin=True: the operator only
    "start": Rule(OPERATOR, "operator_credential"),
    "shutdown": Rule(OPERATOR, "operator_credential", CONTROL_GROUP),
}

SHARD_METHODS: dict[str, Rule] = {
    "info": Rule(SECRET_OR_OPERATOR, "secret"),
    "ping": Rule(SECRET_OR_OPERATOR, "secret"),
    "mark_ready": Rule(SECRET, "secret"),
    "read_blocks": Rule(SECRET, "secret"),
    "write_blocks": Rule(SECRET, "secret"),
    "read_block_scales": Rule(SECRET, "secret"),
    "fence": Rule(SECRET, "secret"),
    "drop_client": Rule(SECRET, "secret"),
    "kv_checksum": Rule(SECRET_OR_OPERATOR, "secret"),
    "get_kv_scales": Rule(SECRET_OR_OPERATOR, "secret"),
    "group_names": Rule(SECRET_OR_OPERATOR, "secret"),
    "simulate_hang": Rule(TEST_HOOK, "secret"),
    "export_kv": Rule(TICKET, "ticket"),
    "join_group": Rule(TICKET, "ticket"),
    "leave_group": Rule(TICKET, "ticket"),
    "run_step": Rule(PLAN, "plan"),
    "extend_run": Rule(PLAN, "plan"),
    "fill_synthetic": Rule(PLAN, "plan"),
}


RAY_ACTOR_METHODS = frozenset({"__ray_call__", "__ray_ready__", "__ray_terminate__"})
"""What Ray itself adds to every actor class (``__ray_call__(fn)`` runs ``fn(actor)``): not ours to guard."""


def new_operator_credential() -> str:
    """256 bits; whoever starts the service keeps it (the actors keep only ``digest`` of it). The prefix keeps it
    from starting with '-' (1 in 64 of bare url-safe tokens), which argparse takes for an option in
    ``cpattn status --operator-credential CREDENTIAL``."""
    return "op-" + secrets.token_urlsafe(32)


def as_bytes(text: str) -> bytes:
    """Any str a caller sends, as bytes: hashes and constant-time comparisons take them whatever the text holds
    (compare_digest refuses non-ASCII str with TypeError; a lone surrogate cannot be encoded strictly)."""
    return text.encode("utf-8", "surrogatepass")


def same_text(a: str, b: str) -> bool:
    """Constant-time equality of two strings (a MAC or secret a caller sent, and the real one)."""
    return hmac.compare_digest(as_bytes(a), as_bytes(b))


def digest(credential: str) -> str:
    """Credentials are kept (and journalled) only as hashes."""
    return hashlib.sha256(as_bytes(credential)).hexdigest()


def matches_digest(proof, expected_digest: str | None) -> bool:
    return (expected_digest is not None and isinstance(proof, str)
            and hmac.compare_digest(digest(proof), expected_digest))


def matches_secret(proof, secret: str | None) -> bool:
    return isinstance(proof, str) and secret is not None and same_text(proof, secret)


def refuse(who: str, method: str, fix: str) -> AccessDeniedError:
    return AccessDeniedError(f"{who}: {method} refused: {fix}")


UNKNOWN_CLIENT = ("unknown client credential (closed, or its lease lapsed after client_lease_s without a call or "
                  "heartbeat): connect again with cpattn.connect()")


def authorize_coordinator_call(rule: Rule, proof, method: str, who: str, operator_digest: str | None,
                               is_client: Callable[[object], bool]) -> None:
    """Raise AccessDeniedError unless ``proof`` satisfies ``rule`` (a COORDINATOR_METHODS entry).
    ``is_client(proof)``: does the proof belong to a connected client."""
    if rule.who == OPEN:
        return
    operator = matches_digest(proof, operator_digest)
    if rule.who == OPERATOR:
        if not operator:
            raise refuse(who, method, "it needs the operator credential (printed by `cpattn serve`, "
                                      "Service.operator_credential of cpattn.start)")
        return
    if rule.who == CLIENT_OR_OPERATOR and operator:
        return
    if not is_client(proof):
        # `cpattn status --operator-credential X` comes here with a wrong X: say that as well as the client's case.
        raise AccessDeniedError(f"{method}: {UNKNOWN_CLIENT}" + (
            "; nor is it this service's operator credential (a wrong --operator-credential or "
            "CPATTN_OPERATOR_CREDENTIAL?): pass the one `cpattn serve` printed" if rule.who == CLIENT_OR_OPERATOR
            else ""))


def remote_surface(impl_cls: type, table: dict[str, Rule], name: str, module: str) -> type:
    """A class exposing only ``table``'s methods of ``impl_cls``; each calls ``impl.authorize(rule, proof,
    arguments, method)`` (which raises AccessDeniedError) before delegating. Ray runs the surface."""

    def __init__(self, *args, **kwargs):
        self._impl = impl_cls(*args, **kwargs)

    namespace = {"__init__": __init__, "__doc__": f"The remote surface of {impl_cls.__name__} (cluster.authority)."}
    for method, rule in table.items():
        namespace[method] = _guarded(impl_cls, method, rule)
    surface = type(name, (), namespace)
    surface.__module__ = module
    surface.__qualname__ = name
    return surface


def _guarded(impl_cls: type, method: str, rule: Rule):
    impl_fn = getattr(impl_cls, method)
    signature = inspect.signature(impl_fn)

    @functools.wraps(impl_fn)
    def call(self, *args, **kwargs):
        impl = self._impl
        try:
            bound = signature.bind(impl, *args, **kwargs)
        except TypeError as exc:
            raise AccessDeniedError(f"{method}: {exc}") from None
        bound.apply_defaults()
        proof = bound.arguments.get(rule.proof) if rule.proof else None
        impl.authorize(rule, proof, bound.arguments, method)
        return impl_fn(impl, *args, **kwargs)

    return call if rule.group is None else ray.method(concurrency_group=rule.group)(call)


# Group tickets -------------------------------------------------------------------------------------
# ``client_id|issued_at|HMAC(secret, group|client_id|issued_at)``: a shard checks it without asking the
# coordinator. A ticket admits one join (the shard remembers the tickets it admitted), within
# ``ttl_s`` of its issue (client_lease_s: a ticket never outlives the lease it was issued under), and never
# after its client ended (the coordinator tells every shard when, in drop_client).

def make_ticket(secret: str, group_name: str, client_id: str, issued_at: float) -> str:
    stamp = f"{issued_at:.6f}"
    return f"{client_id}|{stamp}|{_ticket_mac(secret, group_name, client_id, stamp)}"


def _ticket_mac(secret: str, group_name: str, client_id: str, stamp: str) -> str:
    return hmac.new(as_bytes(secret), as_bytes(f"{group_name}|{client_id}|{stamp}"), hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class Ticket:
    client_id: str
    issued_at: float


def read_ticket(secret: str, group_name, ticket) -> Ticket | None:
    """The ticket's client and issue time when it is genuine for ``group_name``, else None."""
    if not isinstance(ticket, str) or not isinstance(group_name, str) or ticket.count("|") != 2:
        return None
    client_id, stamp, mac = ticket.split("|")
    if not group_name.startswith(f"{client_id}-"):
        return None
    if not same_text(mac, _ticket_mac(secret, group_name, client_id, stamp)):
        return None
    return Ticket(client_id, float(stamp))
