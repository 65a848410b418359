"""The README's Python blocks run as written, top to bottom in one file, and the embedding
example runs: the README cannot drift from the code again."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from rlasync.runtime.forked_commands import FORKED_SCRIPT

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


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


def test_every_python_block_of_the_readme_runs_as_written(tmp_path: Path) -> None:
    blocks = BLOCK.findall((ROOT / "README.md").read_text())
    assert len(blocks) >= 5, "the README's Python blocks went missing"
    script = tmp_path / "readme_blocks.py"
    script.write_text("\n\n".join(blocks))
    done = _run(script, timeout=600)
    assert done.returncode == 0, f"stdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-6000:]}"
    assert "Traceback" not in done.stderr, done.stderr[-6000:]


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
