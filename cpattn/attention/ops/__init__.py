"""The attention ops floor: the math every backend and cluster/ share, owned by no backend.

- ``lse``: LSE bases and the one conversion to natural log.
- ``partials``, ``merge``: merging partial states (torch; the Triton kernel in ``attention/merge_triton.py``
  for CUDA), sinks, rows merged across shards.
- ``reference``: dense / ragged / paged attention in torch, the oracle.
- ``head_size``: the head-size rule.

Nothing here imports upward (backend.py, backends/, selector, cluster/): only torch, cpattn.errors,
cpattn.kvstore, and the Triton merge kernel, which itself imports only from here.
"""
