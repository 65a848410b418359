"""Test tiers: unit (tests/unit, marked here: `pytest -m unit` runs them alone), runtime (real
sockets and processes), multinode (root), gpu (CUDA)."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from rlasync.config import RuntimeConfig
from rlasync.config.cluster import NODE_MODULES
from rlasync.runtime.spawner import COMMANDS_ENV, Spawner, use_spawner

# The node processes tests start (local clusters, trainer ranks) are forked, as `rlasync node`
# forks its own (runtime.spawner), from a spawner launched once per test process with torch, the
# engines, the agent loops, transformers' model code, the trainer's rank and the CLI imported:
# each starts in a fraction of a second instead of importing them again (~1.4 s of CPU, and
# ~2.2 s more for transformers' model code where it loads a model). So do the `python -m rlasync`
# commands tests run (RLASYNC_FORK_COMMANDS: the process started stands in for the forked
# command; the suite runs ~60, ~5 s of CPU each). RLASYNC_TEST_FORK=0 starts each from nothing.
PRELOAD = (*NODE_MODULES, "rlasync.trainer.rank", "rlasync.cli", "rlasync.modes", "rlasync.launcher")


@pytest.fixture(scope="session", autouse=True)
def _node_spawner() -> Iterator[None]:
    if os.environ.get("RLASYNC_TEST_FORK", "1") == "0":
        yield
        return
    commands = str(Path(tempfile.mkdtemp(prefix="rlasync-commands-")) / "socket")  # short: a socket path
    # Under the allocator a run takes by default (runtime.allocator), as its commands would be.
    spawner = Spawner.launch(PRELOAD, commands=commands, allocator=RuntimeConfig().allocator)
    use_spawner(spawner)
    os.environ[COMMANDS_ENV] = commands
    yield
    os.environ.pop(COMMANDS_ENV, None)
    use_spawner(None)
    if spawner is not None:
        spawner.close()
    shutil.rmtree(Path(commands).parent, ignore_errors=True)


def pytest_report_header(config: pytest.Config) -> str:
    """Which of torch's CPU code paths this run takes (``make test-numerics`` runs each)."""
    import torch

    pinned = " ".join(
        f"{name}={os.environ[name]}"
        for name in (
            "ATEN_CPU_CAPABILITY",
            "MKL_ENABLE_INSTRUCTIONS",
            "ONEDNN_MAX_CPU_ISA",
            "OMP_NUM_THREADS",
        )
        if name in os.environ
    )
    return (
        f"torch {torch.__version__}: CPU capability {torch.backends.cpu.get_cpu_capability()}, "
        f"{torch.get_num_threads()} intra-op thread(s){'; ' + pinned if pinned else ''}"
    )


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    skip_root = pytest.mark.skip(reason="needs root for network namespaces")
    cuda = None
    unit = Path(__file__).parent / "unit"
    for item in items:
        if item.path.is_relative_to(unit) and "slow" not in item.keywords:
            item.add_marker(pytest.mark.unit)  # the fast tier: `pytest -m unit`
        if "gpu" in item.keywords:
            cuda = _has_cuda() if cuda is None else cuda
            if not cuda:
                item.add_marker(skip_gpu)
        if "multinode" in item.keywords and os.geteuid() != 0:
            item.add_marker(skip_root)
        _time_to_warm_start(item, config)
    _long_ones_first(items)


WARM_STARTS_S = {"calc_model": 900, "reverse_model": 300}
"""Time a test that uses a warm-started model may take, setup included: the first to ask for one
trains it (calc: ~55 s with AVX2, ~170 s on an AVX-512 Xeon, where it learns later; more on
busy cores), which the suite's 120 s default would cut."""


def _time_to_warm_start(item: pytest.Item, config: pytest.Config) -> None:
    need = max((WARM_STARTS_S[f] for f in getattr(item, "fixturenames", ()) if f in WARM_STARTS_S), default=0)
    marker = item.get_closest_marker("timeout")
    current = (
        float(marker.args[0]) if marker is not None and marker.args else float(config.getini("timeout") or 0)
    )
    if need > current:
        item.add_marker(pytest.mark.timeout(need), append=False)  # the closest: read before the test's own


# Files whose tests take tens of seconds each (training runs, several processes, benchmark smokes).
LONG = (
    "multinode/",
    "test_benchmarks.py",
    "test_readme.py",
    "launch/",
    "modes/test_cluster.py",
    "modes/test_prometheus.py",
    "modes/test_crash_resume.py",
    "agents/test_e2e.py",
    "modes/test_trackers.py",
    "serving/test_openai_loop.py",
)


def _long_ones_first(items: list[pytest.Item]) -> None:
    """Order the run so that each of pytest-xdist's two halves (``--dist worksteal`` hands each
    worker one, then lets an idle one take tests from the end of the other's) starts with its
    share of the long tests: the run then ends on short ones, not with one worker idle while the
    other still has a minute-long test to go. Files keep their own order (module fixtures)."""
    tests = Path(__file__).parent
    long = [i for i in items if str(i.path.relative_to(tests)).startswith(LONG)]
    if not long:
        return
    long_ids = {id(i) for i in long}
    short = [i for i in items if id(i) not in long_ids]
    items[:] = [*long[0::2], *short[0::2], *long[1::2], *short[1::2]]


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> dict[str, object]:
    """Every async test runs on uvloop (what node processes use) and on the stock loop (embedders),
    unless it narrows this with ``@pytest.mark.asyncio(loop_factories=["uvloop"])``."""
    import uvloop

    loops = {"uvloop": uvloop.new_event_loop, "asyncio": asyncio.new_event_loop}
    # RLASYNC_TEST_LOOPS=uvloop: one loop only, where the loop is not the subject (test-numerics).
    wanted = os.environ.get("RLASYNC_TEST_LOOPS", "uvloop,asyncio").split(",")
    return {name: factory for name, factory in loops.items() if name in wanted}


@pytest.fixture(scope="session")
def nano_model_dir(tmp_path_factory: pytest.TempPathFactory) -> object:
    """A saved nano model (seed 3, not trained) with its tokenizer: what trainer ranks load."""
    from rlasync.models import TinyLMConfig, build_tiny_lm

    folder = tmp_path_factory.mktemp("nano-model")
    model, tok = build_tiny_lm(TinyLMConfig.preset("nano", seed=3))
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def _warm_start_once(
    tmp_path_factory: pytest.TempPathFactory, task: str, seed: int, **settings: object
) -> Path:
    """A warm-started model, trained once per test run however many workers ask (pytest-xdist):
    the first to take the lock trains into a folder every worker shares; the rest find it cached."""
    import fcntl

    import msgspec

    from rlasync.compose.warmstart import DEFAULT_SETTINGS, warm_start

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's folder, above each worker's own
    with open(root / f"warm-{task}-{seed}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        return warm_start(
            task,
            run_dir=root / "warm",
            seed=seed,
            settings=msgspec.structs.replace(DEFAULT_SETTINGS[task], **settings),
        )


@pytest.fixture(scope="session")
def reverse_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A warm-started reverse model with the quickstart's settings (greedy threshold 0.9), seed 4:
    held-out greedy accuracy about 0.84 and sampled about 0.15, so a short run visibly learns
    (its sampled reward rises); about 25 s, once per test run."""
    return _warm_start_once(tmp_path_factory, "reverse", 4, greedy_threshold=0.9)


@pytest.fixture(scope="session")
def calc_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The calculator task's warm-started model (seed 0), stopped at the first check whose greedy
    accuracy reaches 0.5, once per test run. The tests need a model that calls the tool and
    copies its result. When that happens depends on the CPU: the model learns the format first,
    then, through a sharp phase transition, to copy the question's digits, and the kernels'
    rounding moves the transition. Measured: step 200 (greedy 0.81, ~55 s on 2 idle cores) with
    AVX2, step 600 (greedy 0.61, ~170 s) on an AVX-512 Xeon (greedy 0 up to step 450). So it is
    checked every 100 steps up to 1,200, not at a fixed step; until the transition every check
    decodes 64 episodes to their token limit twice (~5 s each), hence not every 20. Training does
    not depend on the checks: the model at a given step is the same. The replayed steps that find
    the earliest such model, and the GRPO-group figures, are for RL (not needed here)."""
    return _warm_start_once(
        tmp_path_factory,
        "calc",
        0,
        threshold=1.0,
        greedy_threshold=0.5,
        refine_every=0,
        group_size=0,
        check_every=100,
        max_steps=1200,
    )
