"""Ray side of cpattn: the coordinator actor, the shard actors, and the client's side of both.

Which process runs each file (a file in two columns is shared code, imported by both):

    client process (cpattn.start / connect,    coordinator actor                shard actors (one per shard)
    the `cpattn` commands)
    ---------------------------------------    -----------------------------    -----------------------------
    service.py      start, find, stop          coordinator.py  remote methods   shard.py        the actor
    reach.py        reaching a cluster         client_registry.py               fencing.py      old steps fenced
    placement_wait.py  a start, out loud       sequence_table.py                layer_runner.py per-layer work
    gateway.py      steps, data plane, rejoin  open_steps.py                    decode_graphs.py  CUDA graphs
    client_run.py   decode runs (RunControl)   decode_run.py   decode runs      data_plane.py   the wire
    client_graphs.py  the layer as a graph     prefix_sharing.py  share tokens  netbind.py      bind address
    client_device.py  device, wire, IPC        step_planner.py  plans           messages.py     info() reply
    netstore.py     the group's rendezvous     step_outcome.py  end_step reply
    lease.py        heartbeat (LeaseKeeper)    shard_recovery.py, recovery.py
    page_delta.py   pages held (PageCache)     shard_set.py, placement.py
    layer_runner.py, decode_graphs.py          journal.py, usage.py, metrics.py
                    shards on the client's     lease.py        lease rules
                    GPU (CUDA IPC)             page_delta.py   deltas sent
    data_plane.py, netbind.py                  rpc.py, ids.py
    rpc.py, ids.py  Ray calls, sequence ids    authority.py    (also checked by the shards)
    messages.py     info() reply

A map rather than client/, coordinator/, shard/ subpackages for now: the decode work in flight this session
(issue 18) moves gateway.py, shard.py, step planning and the wire between these processes; the layout
follows once that settles, and a file that moves column then changes one line here, not its import path.
attention/ and kvstore/ below this package never import Ray; nothing here imports launch/.
"""
