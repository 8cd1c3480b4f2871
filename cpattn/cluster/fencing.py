"""Coordinator fencing on the shard side: a restarted coordinator's pages are never written by an older step.

Every plan a coordinator hands out carries its *incarnation* (1 at start, +1 on every restart, kept in the
journal). A restarted coordinator has lost the steps that were open (their pages are free again in its
allocator), so before it hands out any page it calls ``ShardWorker.fence(incarnation)`` on every shard:

- the shard raises its floor to that incarnation; a step of an older one is refused before it writes
  (checked at the start of the step and before every layer's KV write), and the shard drops that step's
  data-plane group so the client's collective fails at once instead of timing out;
- ``fence`` returns only once no step of an older incarnation is between its check and the end of its
  layer's write, so after every shard answered, no old step can touch a page again.

Pure Python (no Ray, no torch) so the rule is unit-testable.
"""

from __future__ import annotations

import threading


class StepFence:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.floor = 0                          # steps of incarnations below this may not write
        self._writing: dict[int, int] = {}      # thread id -> incarnation of the step writing a layer now
        self.num_fenced = 0                     # layers/steps refused so far (for tests and logs)

    def admits(self, incarnation: int) -> bool:
        with self._cond:
            if incarnation < self.floor:
                self.num_fenced += 1
                return False
            return True

    def enter(self, incarnation: int) -> bool:
        """Before a layer's KV write: False (write nothing) when the step's incarnation is fenced."""
        with self._cond:
            if incarnation < self.floor:
                self.num_fenced += 1
                return False
            self._writing[threading.get_ident()] = incarnation
            return True

    def leave(self) -> None:
        """After the layer's write (and on any exit of the step): this thread writes no more."""
        with self._cond:
            if self._writing.pop(threading.get_ident(), None) is not None:
                self._cond.notify_all()

    def raise_floor(self, incarnation: int, timeout_s: float) -> dict:
        """Fence every incarnation below ``incarnation``; wait until none of their steps is mid-write.

        Returns ``{"floor", "waited_for"}``; raises TimeoutError if an old step still writes after timeout_s.
        """
        with self._cond:
            self.floor = max(self.floor, incarnation)
            old = sum(1 for i in self._writing.values() if i < self.floor)
            if not self._cond.wait_for(lambda: all(i >= self.floor for i in self._writing.values()), timeout_s):
                raise TimeoutError(f"a step of an older coordinator incarnation was still writing after {timeout_s}s")
            return {"floor": self.floor, "waited_for": old}
