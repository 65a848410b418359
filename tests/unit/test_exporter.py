"""``metrics.Exporter``: a node's ``/metrics`` over real HTTP, parsed with prometheus-client's
parser. Sources run on the event loop; a loop that does not answer gets the scrape served from
its last answer (counted), a source that raises is counted and the rest still shown; the port in
use is a clear error; ``Timings`` renders a valid histogram."""

from __future__ import annotations

import asyncio
import socket
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from rlasync.config import RuntimeConfig
from rlasync.metrics import exporter as exporter_module
from rlasync.metrics.exporter import Exporter, counter, histogram
from rlasync.metrics.timings import Timings
from rlasync.runtime import JoinError, Node

pytestmark = pytest.mark.unit


def _scrape(port: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def _sample(families: dict[str, Any], family: str, name: str | None = None) -> Any:
    (sample,) = [s for s in families[family].samples if s.name == (name or family)]
    return sample


async def test_sources_run_on_the_loop_and_every_sample_carries_the_node_labels() -> None:
    loop = asyncio.get_running_loop()
    seen: list[bool] = []
    calls = {"n": 0}

    def source() -> list[Any]:
        seen.append(asyncio.get_running_loop() is loop)  # run by the loop, not the server's thread
        calls["n"] += 1
        return [counter("rlasync_things_total", "Things.", calls["n"], kind="a")]

    exporter = Exporter(loop, labels={"node": "node-7", "role": "node"})
    remove = exporter.add(source)
    port = exporter.start(0)
    try:
        families = await asyncio.to_thread(_scrape, port)
        sample = _sample(families, "rlasync_things", "rlasync_things_total")
        assert sample.value == 1 and sample.labels == {"node": "node-7", "role": "node", "kind": "a"}
        assert seen == [True]
        remove()  # a stopped part is no longer reported
        families = await asyncio.to_thread(_scrape, port)
        assert "rlasync_things" not in families and seen == [True]
    finally:
        exporter.close()


async def test_a_blocked_loop_gets_its_last_answer_served_and_a_failing_source_is_counted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(exporter_module, "COLLECT_TIMEOUT_S", 0.3)
    exporter = Exporter(asyncio.get_running_loop(), labels={})
    exporter.add(lambda: [counter("rlasync_fine_total", "A source that works.", 5)])

    def broken() -> list[Any]:
        raise RuntimeError("a bug in one source")

    exporter.add(broken)
    port = exporter.start(0)
    try:
        families = await asyncio.to_thread(_scrape, port)
        assert _sample(families, "rlasync_fine", "rlasync_fine_total").value == 5
        assert (
            _sample(families, "rlasync_metrics_source_errors", "rlasync_metrics_source_errors_total").value
            == 1
        )
        scrape = asyncio.get_running_loop().run_in_executor(None, _scrape, port)  # its thread starts now
        time.sleep(0.8)  # the loop is blocked past the scrape's wait: no hang, the last state
        families = await scrape
        assert _sample(families, "rlasync_fine", "rlasync_fine_total").value == 5
        assert (
            _sample(families, "rlasync_metrics_stale_scrapes", "rlasync_metrics_stale_scrapes_total").value
            == 1
        )
    finally:
        exporter.close()


async def test_a_node_whose_metrics_port_is_taken_names_the_setting(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        node = Node(0, f"ipc://{tmp_path}/node-0.sock", config=RuntimeConfig(metrics_port=port))
        with pytest.raises(JoinError, match=r"runtime\.metrics_port"):
            await node.start()
        await node.stop()


def test_timings_render_a_cumulative_histogram() -> None:
    timings = Timings([0.01, 0.1, 1.0])
    for value in (0.005, 0.01, 0.05, 2.0):
        timings.observe(value)
    family = histogram("rlasync_x_seconds", "X.", timings)
    buckets = [(s.labels["le"], s.value) for s in family.samples if s.name.endswith("_bucket")]
    assert buckets == [("0.01", 2.0), ("0.1", 3.0), ("1.0", 3.0), ("+Inf", 4.0)]  # le: at most
    assert [s.value for s in family.samples if s.name.endswith("_count")] == [4.0]
    assert [s.value for s in family.samples if s.name.endswith("_sum")] == [pytest.approx(2.065)]
