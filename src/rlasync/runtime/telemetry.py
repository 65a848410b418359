"""The actor runtime's Prometheus families (``rlasync_node_*``, ``rlasync_calls_*``): what a
node's ``NodeStats`` counts, its calls in flight and their round trips, and how long ago each
peer was last heard from. Read at scrape time on the event loop (``metrics.Exporter``)."""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client.metrics_core import Metric

from ..metrics.exporter import Timings, counter, counters, gauge, gauges, histogram
from .types import NodeStats

# NodeStats counters by the family they are reported in, and the label value each gets.
_DROPPED = {
    "malformed": "malformed_frames",
    "oversized": "oversized_bodies",
    "outbox_full": "dropped_messages",
    "unknown_reply": "unknown_replies",
    "unroutable_reply": "unroutable_replies",
}
_REFUSED = {
    "busy": "calls_refused",
    "forbidden": "calls_forbidden",
    "fenced": "calls_fenced",
    "expired_unsent": "calls_expired_unsent",
    "stream_credit": "credit_refused",
    "connections": "connections_refused",
}


def node_families(
    stats: NodeStats,
    *,
    in_flight: Mapping[str, int],
    round_trips: Timings,
    heard_s: Mapping[str, float],
) -> list[Metric]:
    """``stats`` (``Node.stats()``); ``in_flight``: unary calls sent and unanswered, by peer
    node; ``round_trips``: seconds from sending a call to its answer; ``heard_s``: seconds since
    each peer's last heartbeat (the head) or since the head last answered one (other nodes)."""
    return [
        counter("rlasync_calls_sent_total", "Actor calls (unary and streaming) sent.", stats.calls_sent),
        counter(
            "rlasync_calls_served_total", "Actor calls served by this node's actors.", stats.calls_served
        ),
        gauges(
            "rlasync_calls_in_flight", "Calls sent and not yet answered, by peer node.", "peer", in_flight
        ),
        histogram("rlasync_call_seconds", "Round trip of unary actor calls, send to answer.", round_trips),
        counters(
            "rlasync_frames_dropped_total",
            "Messages dropped, by reason (malformed, oversized, outbox_full, unknown_reply, unroutable_reply).",
            "reason",
            {reason: getattr(stats, field) for reason, field in _DROPPED.items()},
        ),
        counters(
            "rlasync_refusals_total",
            "What a peer asked for past a bound or beyond its rights, refused (runtime.*).",
            "reason",
            {reason: getattr(stats, field) for reason, field in _REFUSED.items()},
        ),
        counter(
            "rlasync_handshakes_failed_total",
            "TCP peers refused by authentication (CURVE), or speaking garbage.",
            stats.handshakes_failed + stats.zap_denied,
        ),
        counter(
            "rlasync_lost_wakeups_total",
            "Socket wake-ups rescued by runtime.io_recheck_s (should stay 0).",
            stats.lost_wakeups,
        ),
        gauge("rlasync_connections", "TCP connections open now.", stats.connections),
        gauge("rlasync_actors", "Actors hosted by this node.", stats.actors),
        gauges(
            "rlasync_heartbeat_age_seconds",
            "Seconds since a peer was last heard from: each node's last heartbeat (on the head), "
            "the head's last answer (elsewhere).",
            "peer",
            heard_s,
        ),
    ]


__all__ = ["node_families"]
