"""Ray side of cpattn: the coordinator actor, the shard actors, and the client's side of both.

Which process runs each file (a file in two columns is shared code, imported by both):

    client process (cpattn.start / connect,    coordinator actor                shard actors (one per shard)
    the `cpattn` commands)
    ---------------------------------------    -----------------------------    -----------------------------
    service.py      start, find, stop          coordinator.py  remote methods   shard.py        the actor, a step
    reach.py        reaching a cluster         coordinator_sequences.py         shard_kv.py     whole KV pages
    placement_wait.py  a start, out loud         (its sequence methods)         shard_groups.py data-plane groups
    gateway.py      steps, the wire            client_registry.py  clients      shard_graphs.py  a step as a graph
    client_group.py   join, leave, rejoin      sequence_table.py   sequences    fencing.py      old steps fenced
    client_run.py   decode runs, one step      open_steps.py   open steps       layer_runner.py per-layer work
    step_run.py     a step's life (StepRun)
    step_host.py    what StepRun calls
    user_graphs.py  attend in the user's graph
    wire_messages.py  q|k|v packed once                                         wire_messages.py  its header
    decode_run_plans.py  a run's steps built   decode_run_plans.py              decode_run_plans.py  a run's
      as reached (RunSteps)                      a run planned at once            steps built as reached
    client_graphs.py  the layer as a graph     step_ledger.py  a step's life    decode_graphs.py  CUDA graphs
    client_device.py  device, wire, IPC        generations.py  epoch, restarts  data_plane.py   the wire
    netstore.py     the group's rendezvous     decode_run.py   decode runs      netbind.py      bind address
    lease.py        heartbeat (LeaseKeeper)    decode_run_plans.py  their plans messages.py     typed replies
    page_delta.py   pages held (PageCache)     prefix_sharing.py  share tokens  authority.py    who may call
    layer_runner.py, decode_graphs.py,         step_planner.py  plans
      graph_capture.py
                    shards on the client's     step_outcome.py  end_step reply
                    GPU (CUDA IPC)             shard_recovery.py, recovery.py
    data_plane.py, netbind.py                  shard_set.py, placement.py
    rpc.py, ids.py  Ray calls, sequence ids    journal.py, usage.py, metrics.py
    messages.py     typed replies              lease.py        lease rules
                                               page_delta.py   deltas sent
                                               rpc.py, ids.py, messages.py
                                               authority.py    (also the shards')

A map rather than client/, coordinator/, shard/ subpackages: a file that moves column changes one line here,
not its import path (the decode work of issue 18 moved several). Mixins that split a large actor or client
class by concern keep that class's name: ShardWorker = ShardKVPages + ShardGroups + the step loop; Gateway =
GroupMembership + RunControl + a step's wire; Coordinator = SequenceMethods + the rest.
attention/ and kvstore/ below this package never import Ray; nothing here imports launch/. Messages that carry
CPU tensors pickle them as numpy arrays (cpattn/array_pickle.py).
"""
