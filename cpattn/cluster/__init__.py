"""Ray side of cpattn: the coordinator actor, the shard actors, and the client's side of both.

Which process runs each file (a file in two columns is shared code, imported by both):

    client process (cpattn.start / connect,    coordinator actor                shard actors (one per shard)
    the `cpattn` commands)
    ---------------------------------------    -----------------------------    -----------------------------
    service.py      start, find, stop          coordinator.py  remote methods   shard.py        the actor
    reach.py        reaching a cluster         client_registry.py               fencing.py      old steps fenced
    placement_wait.py  a start, out loud       sequence_table.py                layer_runner.py per-layer work
    gateway.py      steps, data plane, rejoin  open_steps.py                    decode_graphs.py  CUDA graphs
    netstore.py     the group's rendezvous     step_planner.py  plans           kv_scales.py    fp8 growth
    lease.py        heartbeat (LeaseKeeper)    step_outcome.py  end_step reply  data_plane.py   the wire
    page_delta.py   pages held (PageCache)     shard_recovery.py, recovery.py   netbind.py      bind address
    layer_runner.py, decode_graphs.py,         shard_set.py, placement.py       messages.py     info() reply
      kv_scales.py  shards on the client's     journal.py, usage.py, metrics.py
                    GPU (CUDA IPC)             lease.py        lease rules
    data_plane.py, netbind.py                  page_delta.py   deltas sent
    rpc.py, ids.py  Ray calls, sequence ids    rpc.py, ids.py
    messages.py     info() reply               authority.py    (also checked by the shards)

A map rather than client/, coordinator/, shard/ subpackages for now: the decode work in flight this session
(issue 18) moves gateway.py, shard.py, step planning and the wire between these processes; the layout
follows once that settles, and a file that moves column then changes one line here, not its import path.
attention/ and kvstore/ below this package never import Ray; nothing here imports launch/.
"""
