"""Prometheus metrics of one service through ``ray.util.metrics``.

Ray exports these on every node's metrics agent (scraped by Prometheus; the Ray dashboard's Grafana
panels pick them up). Every metric carries a ``service`` tag so several services on one cluster stay
apart. Metrics only work inside a Ray worker or driver: outside Ray (unit tests of the plain
coordinator class) ``ServiceMetrics`` records nothing and never raises.

Names (Ray prefixes them with ``ray_`` when exported):
  cpattn_step_latency_s      Histogram  seconds from begin_step to a committed end_step
  cpattn_tokens              Counter    new tokens in committed steps
  cpattn_steps               Counter    steps, tagged outcome=commit|rollback
  cpattn_blocks_used         Gauge      KV blocks in use, tagged shard=<rank>
  cpattn_errors              Counter    errors raised to clients, tagged error_type=<class name>
"""

from __future__ import annotations

import logging

logger = logging.getLogger("cpattn.metrics")

# Seconds; a decode step on CPU is ~ms, a long GPU prefill chunk can take seconds.
STEP_LATENCY_BOUNDARIES_S = [0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0]


class ServiceMetrics:
    """The service's four metrics; create once per coordinator, call from any thread."""

    def __init__(self, service_name: str):
        self.service_name = service_name
        self._tags = {"service": service_name}
        try:
            from ray.util import metrics

            self.step_latency = metrics.Histogram(
                "cpattn_step_latency_s", "Seconds from begin_step to a committed end_step.",
                boundaries=STEP_LATENCY_BOUNDARIES_S, tag_keys=("service",))
            self.tokens = metrics.Counter("cpattn_tokens", "New tokens in committed steps.", tag_keys=("service",))
            self.steps = metrics.Counter("cpattn_steps", "Steps by outcome.", tag_keys=("service", "outcome"))
            self.blocks_used = metrics.Gauge("cpattn_blocks_used", "KV blocks in use per shard.",
                                             tag_keys=("service", "shard"))
            self.errors = metrics.Counter("cpattn_errors", "Errors raised to clients, by exception class.",
                                          tag_keys=("service", "error_type"))
            self.enabled = True
        except Exception as exc:   # no Ray worker context (plain-class tests): metrics are a no-op
            logger.debug("metrics disabled: %s", exc)
            self.enabled = False

    def record_step(self, latency_s: float, num_tokens: int) -> None:
        """A committed step: its latency and how many new tokens it added."""
        if not self.enabled:
            return
        self.step_latency.observe(float(latency_s), tags=self._tags)
        if num_tokens > 0:   # Ray counters refuse non-positive increments
            self.tokens.inc(int(num_tokens), tags=self._tags)
        self.steps.inc(1, tags={**self._tags, "outcome": "commit"})

    def record_rollback(self) -> None:
        if self.enabled:
            self.steps.inc(1, tags={**self._tags, "outcome": "rollback"})

    def set_blocks_used(self, per_shard: list[int]) -> None:
        """Pages in use on each shard (index = rank)."""
        if self.enabled:
            for rank, num_blocks in enumerate(per_shard):
                self.blocks_used.set(int(num_blocks), tags={**self._tags, "shard": str(rank)})

    def record_error(self, exc_type_name: str) -> None:
        """One error raised to a client; tag it with the exception's class name (e.g. CapacityError)."""
        if self.enabled:
            self.errors.inc(1, tags={**self._tags, "error_type": exc_type_name})
