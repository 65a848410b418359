"""An engine's Prometheus families (``rlasync_engine_*``), labelled with the engine's actor
name: read from its ``EngineStats`` and its pauses at scrape time (``metrics.Exporter``)."""

from __future__ import annotations

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from ..metrics.exporter import counter, gauge
from .router import RouterStats
from .types import EngineStats


def engine_families(engine: str, stats: EngineStats, *, pauses: int, paused_s: float) -> list[Metric]:
    """``stats`` of engine ``engine``; ``pauses`` and ``paused_s``: how often and how long it
    was paused (for weight syncs) since it started."""
    families = [
        gauge("rlasync_engine_requests_running", "Requests being decoded.", stats.running, engine=engine),
        gauge(
            "rlasync_engine_requests_waiting",
            "Requests queued for a place in the batch.",
            stats.waiting,
            engine=engine,
        ),
        counter(
            "rlasync_engine_generated_tokens_total",
            "Tokens generated.",
            stats.generated_tokens,
            engine=engine,
        ),
        gauge(
            "rlasync_engine_tokens_per_second",
            "Tokens generated per second over the last few seconds.",
            stats.tokens_per_s,
            engine=engine,
        ),
        counter(
            "rlasync_engine_requests_finished_total",
            "Requests finished (any reason).",
            stats.finished,
            engine=engine,
        ),
        gauge("rlasync_engine_weight_version", "Weight version served.", stats.weight_version, engine=engine),
        gauge(
            "rlasync_engine_oldest_running_version",
            "Oldest weight version among the tokens being decoded (-1: none running).",
            stats.oldest_running_version,
            engine=engine,
        ),
        gauge("rlasync_engine_paused", "1 while generation is paused.", float(stats.paused), engine=engine),
        counter("rlasync_engine_pauses_total", "Times generation was paused.", pauses, engine=engine),
        counter(
            "rlasync_engine_paused_seconds_total", "Seconds generation was paused.", paused_s, engine=engine
        ),
    ]
    if stats.batch_size:
        families.append(
            gauge(
                "rlasync_engine_batch_size",
                "Sequences in the last decode step.",
                stats.batch_size,
                engine=engine,
            )
        )
    if stats.kv_cache_bytes:
        families.append(
            gauge(
                "rlasync_engine_kv_cache_bytes",
                "Bytes of KV cache held.",
                stats.kv_cache_bytes,
                engine=engine,
            )
        )
    return families


def router_families(router: str, stats: RouterStats) -> list[Metric]:
    """``stats`` of a router named ``router`` (``head``, or the agent-loop worker it serves)."""
    outstanding = GaugeMetricFamily(
        "rlasync_router_outstanding",
        "Requests this router has on each engine now.",
        labels=["router", "engine"],
    )
    for load in stats.engines:
        outstanding.add_metric([router, load.name], load.outstanding)
    return [
        outstanding,
        gauge("rlasync_router_engines", "Engines in rotation.", len(stats.engines), router=router),
        gauge(
            "rlasync_router_queued", "Requests waiting for a free engine slot.", stats.queued, router=router
        ),
        counter(
            "rlasync_router_retries_total",
            "Requests moved to another engine after their engine was lost.",
            stats.retries,
            router=router,
        ),
        counter(
            "rlasync_router_engines_lost_total",
            "Engines lost (their node died).",
            stats.engines_lost,
            router=router,
        ),
    ]


__all__ = ["engine_families", "router_families"]
