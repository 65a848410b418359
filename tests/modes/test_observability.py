"""Prometheus on every node of a real run: ``rlasync train`` on the quickstart's cluster placement
(3 node processes, 2 trainer-rank processes, fully async) with ``runtime.metrics_port=0``. While it
trains, every target of ``prometheus_targets.json`` is scraped and parsed with prometheus-client's
own parser; the Grafana dashboard's queries use only metrics some node exports."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).parents[2]
CLUSTER = ROOT / "configs" / "quickstart_cluster.yaml"
DASHBOARD = ROOT / "launch" / "monitoring" / "grafana_dashboard.json"
NODES = {"node-0", "node-0.0", "node-1", "node-1.0", "node-2"}  # head, rank 0, node 1, rank 1, node 2


def _scrape(target: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://{target}/metrics", timeout=10) as reply:
        assert reply.headers["Content-Type"].startswith("text/plain")
        text = reply.read().decode()
    return {family.name: family for family in text_string_to_metric_families(text)}


def _value(families: dict[str, Any], sample: str, **labels: str) -> float:
    """The sum of the samples named ``sample`` with these labels (a counter's ``_total``, a
    histogram's ``_count``...)."""
    name = re.sub(r"_(total|bucket|count|sum)$", "", sample)
    values = [
        s.value
        for s in families[name].samples
        if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    assert values, f"no {sample}{labels} in {[s for s in families[name].samples]}"
    return float(sum(values))


def _wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    metrics = run_dir / "metrics.jsonl"
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        if metrics.is_file():
            steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines() if line.strip()]
            if steps and steps[-1] >= step:
                return
        time.sleep(0.2)
    raise AssertionError(f"the run did not reach step {step} within {timeout}s")


def test_every_node_serves_metrics_mid_run_and_the_dashboard_asks_only_for_exported_ones(
    tmp_path: Path, reverse_model: Path
) -> None:
    command = [
        sys.executable,
        "-m",
        "rlasync",
        "train",
        str(CLUSTER),
        "train.mode=fully_async",
        "train.steps=12",
        "train.prompts_per_step=4",
        "train.group_size=4",
        "train.validate_every=2",
        "train.val_size=8",
        f"train.run_dir={tmp_path}",
        f"train.model_dir={reverse_model}",
        "runtime.metrics_port=0",
    ]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_step(tmp_path, 3, proc, timeout=180)
        targets = json.loads((tmp_path / "prometheus_targets.json").read_text())
        scraped = {group["targets"][0]: _scrape(group["targets"][0]) for group in targets}
        _, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert all(group["labels"] == {"run": tmp_path.name} for group in targets), targets
    by_node = {}
    for families in scraped.values():
        (node,) = {s.labels["node"] for s in families["rlasync_calls_sent"].samples}
        by_node[node] = families
    assert set(by_node) == NODES, sorted(by_node)

    for node, families in by_node.items():  # the runtime's, everywhere
        assert _value(families, "rlasync_calls_sent_total") > 0, node
        assert _value(families, "rlasync_frames_dropped_total", reason="malformed") == 0, node
        buckets = [s for s in families["rlasync_call_seconds"].samples if s.name.endswith("_bucket")]
        counts = [s.value for s in buckets]
        assert buckets[-1].labels["le"] == "+Inf" and counts == sorted(counts), node
        assert counts[-1] == _value(families, "rlasync_call_seconds_count") > 0, node
        peers = {s.labels["peer"] for s in families["rlasync_heartbeat_age_seconds"].samples}
        assert peers == (NODES - {"node-0"} if node == "node-0" else {"node-0"}), (node, peers)
        assert all(
            s.labels["role"] == ("head" if node == "node-0" else "child" if "." in node else "node")
            for f in families.values()
            for s in f.samples
        )

    head = by_node["node-0"]
    assert _value(head, "rlasync_train_steps_total") >= 3
    assert _value(head, "rlasync_trainer_tokens_total") > 0
    assert "rlasync_trainer_loss" in head and 0 < _value(head, "rlasync_trainer_learning_rate") <= 5e-4
    assert _value(head, "rlasync_queue_capacity") > 0 and _value(head, "rlasync_sample_staleness_count") > 0
    assert _value(head, "rlasync_weight_sync_seconds_count") >= 3
    assert {s.labels["engine"] for s in head["rlasync_router_outstanding"].samples} == {
        "engine-0",
        "engine-1",
    }

    for node, engine in (("node-1", "engine-0"), ("node-2", "engine-1")):  # each engine with its loops
        families = by_node[node]
        assert _value(families, "rlasync_engine_generated_tokens_total", engine=engine) > 0
        assert _value(families, "rlasync_engine_weight_version", engine=engine) >= 1
        # Engines take each version at their own step (interrupt=keep): never paused for it.
        assert _value(families, "rlasync_engine_pauses_total", engine=engine) == 0
        assert _value(families, "rlasync_engine_oldest_running_version", engine=engine) >= -1
        worker = f"agent-loops-{node.removeprefix('node-')}"
        trajectories = _value(families, "rlasync_agent_trajectories_total", worker=worker)
        assert (
            trajectories > 0 and _value(families, "rlasync_agent_turns_total", worker=worker) >= trajectories
        )
        assert _value(families, "rlasync_agent_turn_seconds_count", worker=worker) >= trajectories

    # Every metric a dashboard query names is one some live node exports.
    exported = {name for families in scraped.values() for name in families} | {
        s.name for families in scraped.values() for f in families.values() for s in f.samples
    }
    queries = [
        target["expr"]
        for panel in json.loads(DASHBOARD.read_text())["panels"]
        for target in panel.get("targets", [])
    ]
    used = {name for query in queries for name in re.findall(r"\brlasync_[a-z_]+", query)}
    assert len(used) >= 30, sorted(used)
    missing = sorted(
        name
        for name in used
        if name not in exported and re.sub(r"_(total|bucket|count|sum)$", "", name) not in exported
    )
    assert not missing, missing
