"""Ray side of cpattn: the coordinator actor, the shard actors, and the client's side of both.

Which process runs each file (a file in two columns is shared code, imported by both):

    client process (cpattn.start / connect,    coordinator actor                shard actors (one per shard)
    the `cpattn` commands)
    ---------------------------------------    -----------------------------    -----------------------------
    service.py      start, find, stop          coordinator.py  remote methods   shard.py        the actor
    reach.py        reaching a cluster         coordinator_sequences.py         fencing.py      old steps fenced
    placement_wait.py  a start, out loud         (its sequence methods)         layer_runner.py per-layer work
    gateway.py      steps, data plane, rejoin  client_registry.py  clients      decode_graphs.py  CUDA graphs
    client_run.py   decode runs (RunControl)   sequence_table.py   sequences    data_plane.py   the wire
    client_graphs.py  the layer as a graph     open_steps.py   open steps       netbind.py      bind address
    client_device.py  device, wire, IPC        step_ledger.py  a step's life    messages.py     typed replies
    netstore.py     the group's rendezvous     generations.py  epoch, restarts
    lease.py        heartbeat (LeaseKeeper)    decode_run.py   decode runs
    page_delta.py   pages held (PageCache)     prefix_sharing.py  share tokens
    layer_runner.py, decode_graphs.py          step_planner.py  plans
                    shards on the client's     step_outcome.py  end_step reply
                    GPU (CUDA IPC)             shard_recovery.py, recovery.py
    data_plane.py, netbind.py                  shard_set.py, placement.py
    rpc.py, ids.py  Ray calls, sequence ids    journal.py, usage.py, metrics.py
    messages.py     typed replies              lease.py        lease rules
                                               page_delta.py   deltas sent
                                               rpc.py, ids.py, messages.py
                                               authority.py    (also checked by the shards)

A map rather than client/, coordinator/, shard/ subpackages for now: the decode work in flight this session
(issue 18) moves gateway.py, shard.py, step planning and the wire between these processes; the layout
follows once that settles, and a file that moves column then changes one line here, not its import path.
attention/ and kvstore/ below this package never import Ray; nothing here imports launch/.
"""
