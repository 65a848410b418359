"""The README's and the documentation pages' examples run as written: each document's Python
blocks top to bottom in one file, its shell blocks marked ``<!-- runnable: SECONDS -->`` within
that budget, and the embedding example. The docs cannot drift from the code again."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from rlasync.runtime.forked_commands import FORKED_SCRIPT

ROOT = Path(__file__).resolve().parents[1]
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
RUNNABLE_SHELL_BLOCK = re.compile(r"^<!-- runnable: (\d+) -->\n```(?:bash|sh)\n(.*?)^```", re.S | re.M)
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _name(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _with(pattern: re.Pattern[str]) -> list[Path]:
    return [path for path in DOCUMENTS if pattern.search(path.read_text())]


def _run(script: Path, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run(
        [sys.executable, "-c", FORKED_SCRIPT, str(script), *args],  # as `python SCRIPT`
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_the_readme_and_the_pages_hold_examples() -> None:
    """The examples did not go missing (a fence renamed, a block moved out of reach)."""
    assert PYTHON_BLOCK.search((ROOT / "README.md").read_text()), "the README's Python example went missing"
    assert len(_with(PYTHON_BLOCK)) >= 8, [_name(p) for p in _with(PYTHON_BLOCK)]
    assert _with(RUNNABLE_SHELL_BLOCK), "no shell block is marked <!-- runnable: SECONDS -->"


@pytest.mark.parametrize("document", _with(PYTHON_BLOCK), ids=_name)
def test_every_python_block_runs_as_written(document: Path, tmp_path: Path) -> None:
    blocks = PYTHON_BLOCK.findall(document.read_text())
    script = tmp_path / f"{document.stem}_blocks.py"
    script.write_text("\n\n".join(blocks))
    done = _run(script, timeout=600)
    assert done.returncode == 0, f"stdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-6000:]}"
    assert "Traceback" not in done.stderr, done.stderr[-6000:]


@pytest.mark.parametrize(
    ("document", "index"),
    [
        (path, i)
        for path in _with(RUNNABLE_SHELL_BLOCK)
        for i in range(len(RUNNABLE_SHELL_BLOCK.findall(path.read_text())))
    ],
    ids=lambda value: _name(value) if isinstance(value, Path) else str(value),
)
def test_every_runnable_shell_block_runs_within_its_budget(document: Path, index: int) -> None:
    budget, block = RUNNABLE_SHELL_BLOCK.findall(document.read_text())[index]
    bin_dir = str(Path(sys.executable).parent)  # `rlasync` and `python` are this environment's
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(ROOT / "src"),
    }
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=int(budget),
    )
    assert done.returncode == 0, f"{block}\nstdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-6000:]}"


def test_the_embedding_example_runs_and_leaves_nothing_behind() -> None:
    with tempfile.TemporaryDirectory(prefix="embed-tmp-") as tmp:
        env_tmp = {"TMPDIR": tmp}
        done = subprocess.run(
            [
                sys.executable,
                "-c",
                FORKED_SCRIPT,  # as `python examples/embed.py`
                str(ROOT / "examples" / "embed.py"),
                "--steps",
                "2",
                "--prompts",
                "2",
                "--group",
                "4",
            ],
            cwd=ROOT,
            env={**os.environ, **env_tmp, "PYTHONPATH": str(ROOT / "src")},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, f"stdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-6000:]}"
        assert (
            "step 2: reward" in done.stdout
            and "done: cluster, engines, trainer and weight sync closed" in done.stdout
        ), done.stdout
        assert "was lost" not in done.stderr, done.stderr  # a clean shutdown loses nothing
        assert not list(Path(tmp).iterdir()), (
            f"left in the temporary directory: {sorted(p.name for p in Path(tmp).iterdir())}"
        )
