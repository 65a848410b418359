"""Calls through an actor ref type-check against the actor's endpoint signatures (mypy)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

SNIPPET = """
from typing import AsyncIterator
import asyncio
import rlasync

class Counter(rlasync.Actor):
    @rlasync.endpoint
    async def add(self, n: int) -> int:
        return n

    @rlasync.endpoint
    async def count(self, n: int) -> AsyncIterator[int]:
        yield n

async def main(cluster: rlasync.LocalCluster) -> None:
    counter = await cluster.spawn(Counter, node=1)
    total: int = await counter.add(1)
    task = asyncio.create_task(counter.add(2))
    late: int = await counter.add.options(timeout=1.0)(3)
    async for i in counter.count(3):
        reveal_type(i)
    await counter.add("one")
    wrong: str = await counter.add(1)
"""


def test_mypy_checks_calls_against_endpoint_signatures(tmp_path: Path) -> None:
    path = tmp_path / "snippet.py"
    path.write_text(textwrap.dedent(SNIPPET))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--no-incremental",
            "--follow-imports=silent",
            "--ignore-missing-imports",
            str(path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    ).stdout
    errors = [line for line in out.splitlines() if ": error:" in line]
    assert any(":22:" in e and 'incompatible type "str"' in e for e in errors), out
    assert any(":23:" in e and "Incompatible types in assignment" in e for e in errors), out
    assert len(errors) == 2, out  # the correct calls (lines 17-20) pass
    assert 'Revealed type is "builtins.int"' in out or 'Revealed type is "int"' in out, out
