"""The router's Prometheus metrics (one registry per router; served at ``/metrics``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from phalanx.serve.replica_app import LATENCY_BUCKETS_S


@dataclass
class RouterMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.latency = Histogram("phalanx_router_request_latency_seconds", "latency", ["route"],
                                 buckets=LATENCY_BUCKETS_S, registry=r)
        self.ttft = Histogram("phalanx_router_time_to_first_token_seconds", "TTFT", ["route"],
                              buckets=LATENCY_BUCKETS_S, registry=r)
        self.retries = Counter("phalanx_router_retries", "retries", ["replica"], registry=r)
        self.hedges = Counter("phalanx_router_hedges", "hedged requests", registry=r)
        self.resumptions = Counter("phalanx_router_stream_resumptions", "streams resumed on another replica",
                                   registry=r)
        self.ejections = Counter("phalanx_router_ejections", "replicas ejected", ["replica", "why"], registry=r)
        self.moves = Counter("phalanx_router_moves", "requests moved off an ejected replica before any output",
                             ["replica"], registry=r)
        self.rejected = Counter("phalanx_router_rejected", "429s from admission control", registry=r)
        self.outstanding = Gauge("phalanx_router_outstanding", "requests in flight", ["replica"], registry=r)
        self.healthy = Gauge("phalanx_router_replica_healthy", "1 when in rotation", ["replica"], registry=r)
        self.version_waits = Counter("phalanx_router_version_waits", "requests delayed by a rollout (held back "
                                     "until a replica at their session's version admitted them)", registry=r)
        self.outage_waits = Counter("phalanx_router_outage_waits", "requests that waited for a replica to come back "
                                    "into rotation (none was in it) instead of a 503", registry=r)
        self.version_refusals = Counter("phalanx_router_version_refusals", "requests answered 503 because no "
                                        "replica at their session's version admitted them in time", registry=r)
        self.version_rank = Gauge("phalanx_router_replica_version_rank", "rank of the version a replica serves",
                                  ["replica"], registry=r)
