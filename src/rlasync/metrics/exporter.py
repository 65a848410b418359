"""Prometheus on one node process: ``/metrics`` over HTTP (``runtime.metrics_port``).

Nothing here sits on a hot path. A part that wants to be seen (the runtime, an engine, a
router, the agent loops, a run) keeps its own plain counters, as it already does, and adds a
*source* to its node's ``Exporter``: a function that turns those counters into metric families
when Prometheus scrapes. The scrape is served by a thread, but the sources run on the node's
event loop (the counters' owner), so they read a consistent state and need no locks; a loop
that does not answer within ``COLLECT_TIMEOUT_S`` gets the scrape served from the last answer
it gave, counted in ``rlasync_metrics_stale_scrapes_total``. Timing histograms that are
observed per call use ``Timings`` (a list increment, not prometheus-client's locked
``Histogram``).

    exporter = Exporter(loop, labels={"node": "node-0", "role": "head"})
    exporter.add(lambda: [counter("rlasync_things_total", "Things done.", 3)])
    port = exporter.start(0)  # 0: any free port; http://127.0.0.1:<port>/metrics

Names follow Prometheus's conventions: ``rlasync_`` prefix, base units (seconds, bytes),
``_total`` for counters; every family carries the node's labels (``node``, ``role``), and
label values that come from outside (tool names, peers) are bounded by their source.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric

from .timings import SECONDS_BUCKETS, Timings

log = logging.getLogger(__name__)

Source = Callable[[], Iterable[Metric]]

COLLECT_TIMEOUT_S = 2.0
"""How long a scrape waits for the node's event loop to run the sources."""


def counter(name: str, doc: str, value: float, **labels: str) -> Metric:
    """A counter family of one sample (``name`` ends in ``_total``)."""
    family = CounterMetricFamily(name.removesuffix("_total"), doc, labels=list(labels))
    family.add_metric(list(labels.values()), value)
    return family


def gauge(name: str, doc: str, value: float, **labels: str) -> Metric:
    family = GaugeMetricFamily(name, doc, labels=list(labels))
    family.add_metric(list(labels.values()), value)
    return family


def counters(name: str, doc: str, label: str, values: Mapping[str, float]) -> Metric:
    """A counter family with one sample per value of ``label``."""
    family = CounterMetricFamily(name.removesuffix("_total"), doc, labels=[label])
    for key, value in values.items():
        family.add_metric([key], value)
    return family


def gauges(name: str, doc: str, label: str, values: Mapping[str, float]) -> Metric:
    family = GaugeMetricFamily(name, doc, labels=[label])
    for key, value in values.items():
        family.add_metric([key], value)
    return family


def histogram(name: str, doc: str, timings: Timings | Mapping[str, Timings], label: str = "") -> Metric:
    """A histogram family of one ``Timings``, or of several keyed by the value of ``label``."""
    family = HistogramMetricFamily(name, doc, labels=[label] if label else None)
    items = timings.items() if isinstance(timings, Mapping) else [("", timings)]
    for key, t in items:
        family.add_metric([key] if label else [], t.buckets(), t.sum)
    return family


class Exporter:
    """``/metrics`` of one node process: its sources, run on ``loop`` at each scrape, every
    family stamped with ``labels`` (the node's: ``node``, ``role``)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, *, labels: Mapping[str, str]) -> None:
        self.loop = loop
        self.labels = dict(labels)
        self._sources: list[Source] = []
        self._last: list[Metric] = []
        self._stale = 0
        self._failed = 0
        self._collect_s = 0.0
        self._server: WSGIServer | None = None
        self.port = 0
        self.address = ""  # host:port, once started

    def add(self, source: Source) -> Callable[[], None]:
        """Run ``source`` at every scrape, from now; returns the function that removes it (an
        actor that stops calls it, so a stopped part is no longer reported)."""
        self._sources.append(source)

        def remove() -> None:
            if source in self._sources:
                self._sources.remove(source)

        return remove

    def start(self, port: int, host: str = "127.0.0.1") -> int:
        """Serve ``/metrics`` on ``host:port`` (0: a free port); returns the port."""
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self)
        kind = _Server6 if ":" in host else _Server
        server = make_server(host, port, make_wsgi_app(registry), kind, handler_class=_Handler)
        self._server = server
        self.port = server.server_port
        self.address = f"{'[' + host + ']' if ':' in host else host}:{self.port}"
        threading.Thread(target=server.serve_forever, name="rlasync-metrics", daemon=True).start()
        return self.port

    def close(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()

    # -- called by prometheus-client in the server's thread ---------------------------------
    def collect(self) -> Iterable[Metric]:
        done = threading.Event()
        box: list[list[Metric]] = []

        def run() -> None:
            started = time.perf_counter()
            try:
                box.append(self.snapshot())
            finally:
                self._collect_s += time.perf_counter() - started
                done.set()

        try:
            self.loop.call_soon_threadsafe(run)
            answered = done.wait(COLLECT_TIMEOUT_S)
        except RuntimeError:  # the loop is closed: the node is gone, its last state stands
            answered = False
        if answered and box:
            self._last = box[0]
        else:
            self._stale += 1
        stale = counter(
            "rlasync_metrics_stale_scrapes_total",
            f"Scrapes served from an earlier state: the event loop did not answer within {COLLECT_TIMEOUT_S}s.",
            self._stale,
        )
        failed = counter(
            "rlasync_metrics_source_errors_total", "Metric sources that raised (logged).", self._failed
        )
        spent = counter(
            "rlasync_metrics_collect_seconds_total",
            "Seconds the event loop spent running the metric sources for scrapes.",
            self._collect_s,
        )
        for family in [*self._last, stale, failed, spent]:
            yield self._stamped(family)

    def snapshot(self) -> list[Metric]:
        """Every source's families now (on the event loop)."""
        families: list[Metric] = []
        for source in list(self._sources):
            try:
                families.extend(source())
            except Exception:  # one broken source must not blank the node's page
                self._failed += 1
                log.exception("a metrics source failed")
        return families

    def _stamped(self, family: Metric) -> Metric:
        """``family`` with the node's labels added to every sample."""
        if not self.labels:
            return family
        out = Metric(family.name, family.documentation, family.type, family.unit)
        out.samples = [s._replace(labels={**self.labels, **s.labels}) for s in family.samples]
        return out


class _Handler(WSGIRequestHandler):
    """No log line per scrape, and a client that stalls is dropped (it holds a thread)."""

    timeout = 10

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's name)
        pass


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Server6(_Server):
    address_family = socket.AF_INET6


__all__ = [
    "COLLECT_TIMEOUT_S",
    "SECONDS_BUCKETS",
    "Exporter",
    "Source",
    "Timings",
    "counter",
    "counters",
    "gauge",
    "gauges",
    "histogram",
]
