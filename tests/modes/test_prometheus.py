"""The monitoring of docs/observability.md in a real Prometheus (Debian's ``prometheus`` and ``promtool``).

``launch/monitoring/prometheus.yml`` passes ``promtool check config``. Prometheus then runs on it
(copied beside a ``runs/`` folder of the test's own, its intervals shortened) while two short
runs of the cluster quickstart train side by side: the synchronous one, and a fully
asynchronous one whose agents offer a tool. Every node of both is ``up``; every expression of
every Grafana panel returns a number for each run the panel is for (the panels only some runs
fill say so in their "No value" text); a run stopped with Ctrl-C leaves discovery and its series
end (not left listed as down), while the other run stays up. The staleness panel's expressions
are also checked on set histograms with ``promtool test rules``: whole versions, read exactly.
"""

from __future__ import annotations

import json
import math
import shutil
import signal
import socket
import subprocess
import sys
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from waiting import wait_until_sync

from rlasync.compose.telemetry import RunMetrics
from rlasync.metrics import Staleness, StepRecord

ROOT = Path(__file__).parents[2]
CONFIG = ROOT / "launch" / "monitoring" / "prometheus.yml"
DASHBOARD = ROOT / "launch" / "monitoring" / "grafana_dashboard.json"
CLUSTER = ROOT / "configs" / "quickstart_cluster.yaml"

pytestmark = pytest.mark.skipif(
    not (shutil.which("prometheus") and shutil.which("promtool")),
    reason="needs Prometheus's prometheus and promtool on PATH (apt-get install prometheus; "
    "make setup installs it when run as root)",
)

# The panels only some runs fill, and what a run needs to fill each: the dashboard says so in
# their "No value" text (checked below, so the two cannot drift apart).
ONLY_IN = {
    "Sample queue (fully async only)": "fully_async",
    "Tool calls/s and failures/s by tool (runs with tools)": "tools",
}
# The runs, by name: what each is (the ONLY_IN keys it satisfies) and its overrides of the
# docs/observability.md's `rlasync train configs/quickstart_cluster.yaml runtime.metrics_port=0`.
RUNS = {
    "sync": (set(), []),
    "async": (
        {"fully_async", "tools"},
        ["train.mode=fully_async", "agent.default_loop=tool", "agent.tools=[calculator]"],
    ),
}
NODES_PER_RUN = 5  # node-0 (head), node-0.0 (trainer rank 0), node-1, node-1.0 (rank 1), node-2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _panels() -> list[dict[str, Any]]:
    return [p for p in json.loads(DASHBOARD.read_text())["panels"] if p["type"] != "row"]


class Prometheus:
    """Queries to the Prometheus at ``http://127.0.0.1:<port>`` (its HTTP API)."""

    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"

    def get(self, path: str, **params: str) -> Any:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(f"{self.url}{path}{query}", timeout=10) as reply:
            body = json.loads(reply.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> dict[tuple[tuple[str, str], ...], float]:
        """An instant query's result: each series' labels and its value now."""
        data = self.get("/api/v1/query", query=expr)
        assert data["resultType"] == "vector", (expr, data)
        return {tuple(sorted(s["metric"].items())): float(s["value"][1]) for s in data["result"]}

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as reply:
                return reply.status == 200
        except OSError:
            return False


def _empty_expressions(prometheus: Prometheus, run: str, has: set[str]) -> list[str]:
    """The panel expressions that return no number for ``run`` (dashboard ``$run`` = it)."""
    empty = []
    for panel in _panels():
        if panel["title"] in ONLY_IN and ONLY_IN[panel["title"]] not in has:
            continue
        for target in panel["targets"]:
            expr = target["expr"].replace("$run", run)
            values = prometheus.query(expr).values()
            if not any(math.isfinite(v) for v in values):
                empty.append(f"{panel['title']} {target['refId']}: {expr} -> {list(values)}")
    return empty


def _start_run(runs: Path, name: str, overrides: list[str], model_dir: Path) -> subprocess.Popen[str]:
    """``rlasync train`` of the cluster quickstart, short steps, output in ``runs/<name>.log``."""
    command = [
        sys.executable,
        "-m",
        "rlasync",
        "train",
        str(CLUSTER),
        "runtime.metrics_port=0",
        *overrides,
        "train.steps=1000",  # stopped by Ctrl-C once every panel has data
        "train.prompts_per_step=4",
        "train.group_size=4",
        "train.validate_every=1000",  # the held-out accuracy of step 0 only
        "train.val_size=8",
        "train.checkpoint_every=0",
        f"train.run_dir={runs / name}",
        f"train.model_dir={model_dir}",
    ]
    with (runs / f"{name}.log").open("w") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, text=True)


@pytest.mark.timeout(300)
def test_a_real_prometheus_scrapes_every_node_and_every_panel_has_data_for_its_runs(
    tmp_path: Path, reverse_model: Path
) -> None:
    subprocess.run(["promtool", "check", "config", str(CONFIG)], check=True, capture_output=True)
    panels = _panels()
    declared = {p["title"] for p in panels if "noValue" in p["fieldConfig"]["defaults"]}
    assert declared == set(ONLY_IN), declared

    # The real file, beside runs/ as in the repository (its relative discovery path finds the
    # test's runs); only its intervals shortened, so a run of seconds is scraped often.
    text = CONFIG.read_text()
    for old, new in (
        ("scrape_interval: 5s", "scrape_interval: 1s"),
        ("refresh_interval: 10s", "refresh_interval: 1s"),
    ):
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    config = tmp_path / "launch" / "monitoring" / "prometheus.yml"
    config.parent.mkdir(parents=True)
    config.write_text(text)
    runs = tmp_path / "runs"
    runs.mkdir()

    port = _free_port()
    with (tmp_path / "prometheus.log").open("w") as log:
        server = subprocess.Popen(
            [
                "prometheus",
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    prometheus = Prometheus(port)
    procs: dict[str, subprocess.Popen[str]] = {}
    try:
        wait_until_sync(prometheus.ready, timeout_s=30, interval_s=0.2, what="Prometheus is ready")
        for name, (_, overrides) in RUNS.items():
            procs[name] = _start_run(runs, name, overrides, reverse_model)

        def all_up() -> bool:
            """Every node each run lists in discovery is up, and no other."""
            for name, proc in procs.items():
                assert proc.poll() is None, (runs / f"{name}.log").read_text()[-3000:]
            up = prometheus.query("up")
            for name in RUNS:
                listed = runs / "prometheus_targets" / f"{name}.json"
                if not listed.exists():
                    return False
                targets = {t for group in json.loads(listed.read_text()) for t in group["targets"]}
                seen = {dict(labels)["instance"]: v for labels, v in up.items() if ("run", name) in labels}
                if len(targets) != NODES_PER_RUN or seen != dict.fromkeys(targets, 1.0):
                    return False
            return True

        wait_until_sync(all_up, timeout_s=120, interval_s=0.5, what="every node of each run is up")

        empty: dict[str, list[str]] = {}

        def every_panel_has_data() -> bool:
            for name, proc in procs.items():
                assert proc.poll() is None, (runs / f"{name}.log").read_text()[-3000:]
            empty.update({name: _empty_expressions(prometheus, name, has) for name, (has, _) in RUNS.items()})
            return not any(empty.values())

        try:
            wait_until_sync(every_panel_has_data, timeout_s=90, interval_s=1.0, what="every panel has data")
        except AssertionError:
            raise AssertionError(json.dumps(empty, indent=1)) from None

        # Staleness as whole versions: 0 for the synchronous run; the asynchronous run's
        # quantiles are among the versions behind its samples were.
        staleness = next(p for p in panels if p["title"].startswith("Staleness"))
        for name in RUNS:
            values = {
                t["legendFormat"]: prometheus.query(t["expr"].replace("$run", name))
                for t in staleness["targets"]
            }
            p50, p99 = (next(iter(values[q].values())) for q in ("p50", "p99"))
            if name == "sync":
                assert p50 == p99 == 0 and set(values["mean"].values()) == {0}, values
            else:
                seen = _staleness_seen(runs / name / "metrics.jsonl")
                assert {p50, p99} <= seen, (values, seen)

        # Ctrl-C ends the synchronous run: it leaves discovery, and its series end (no `up` of
        # 0 for the next run's Fleet panel to count); the other run is still scraped.
        procs["sync"].send_signal(signal.SIGINT)
        assert procs["sync"].wait(timeout=60) == 130, (runs / "sync.log").read_text()[-3000:]
        assert not (runs / "prometheus_targets" / "sync.json").exists()
        assert (runs / "prometheus_targets" / "async.json").exists()
        wait_until_sync(
            lambda: not prometheus.query('up{run="sync"}'),
            timeout_s=30,
            interval_s=0.5,
            what="the ended run's targets leave Prometheus",
        )
        assert list(prometheus.query('up{run="async"}').values()) == [1.0] * NODES_PER_RUN
        procs["async"].send_signal(signal.SIGINT)
        assert procs["async"].wait(timeout=60) == 130, (runs / "async.log").read_text()[-3000:]
        assert list((runs / "prometheus_targets").iterdir()) == []
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def _staleness_seen(metrics: Path) -> set[float]:
    """Every number of versions behind that some trained sample of the run was."""
    seen = set()
    for line in metrics.read_text().splitlines():
        for behind, n in enumerate(json.loads(line).get("async/staleness_sample_hist", [])):
            if n:
                seen.add(float(behind))
    return seen


# Samples of a step by versions behind, and what the staleness panel must read over them:
# p50, p99, mean. All 1 behind read 1 (histogram_quantile alone: 0.5 and 0.99).
STALENESS_CASES = [
    ([0, 16], 1, 1, 1.0),
    ([16], 0, 0, 0.0),
    ([12, 4], 0, 1, 0.25),
    ([0, 0, 16], 2, 2, 2.0),
    ([0, 8, 0, 8], 1, 3, 2.0),
]


def test_the_staleness_panel_reads_whole_versions_exactly(tmp_path: Path) -> None:
    """promtool's PromQL unit tests: the head's staleness histogram (``RunMetrics``' own buckets)
    after each minute's step, read by the staleness panel's expressions."""
    (staleness,) = [p for p in _panels() if p["title"].startswith("Staleness")]
    exprs = {t["legendFormat"]: t["expr"].replace("$run", "r") for t in staleness["targets"]}
    assert set(exprs) == {"p50", "p99", "mean"}, exprs
    tests = []
    for hist, p50, p99, mean in STALENESS_CASES:
        metrics = RunMetrics()
        metrics.observe(StepRecord(step=1, staleness=_staleness(hist)))
        (family,) = [f for f in metrics.families() if f.name == "rlasync_sample_staleness"]
        series = []
        for sample in family.samples:  # one more step of these samples each minute
            labels = ",".join(f'{k}="{v}"' for k, v in {**sample.labels, "run": "r"}.items())
            series.append({"series": f"{sample.name}{{{labels}}}", "values": f"0+{sample.value:g}x10"})
        expected = {"p50": ("{}", p50), "p99": ("{}", p99), "mean": ('{run="r"}', mean)}
        checks = [
            {"expr": exprs[q], "eval_time": "5m", "exp_samples": [{"labels": labels, "value": value}]}
            for q, (labels, value) in expected.items()
        ]
        tests.append({"interval": "1m", "input_series": series, "promql_expr_test": checks})
    path = tmp_path / "staleness_test.yml"
    path.write_text(json.dumps({"rule_files": [], "evaluation_interval": "1m", "tests": tests}, indent=1))
    check = subprocess.run(["promtool", "test", "rules", str(path)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr


def _staleness(sample_hist: list[int]) -> Staleness:
    """A step's staleness with these samples (one token each)."""
    return Staleness(
        token_hist=sample_hist,
        sample_hist=sample_hist,
        token_mean=sum(i * n for i, n in enumerate(sample_hist)) / sum(sample_hist),
        max=len(sample_hist) - 1,
        partial_samples=0,
        partial_span_max=0,
    )
