"""What a script that embeds the runtime meets: the same argument checks wherever an actor
lives, and a script without a ``__main__`` guard told so."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from sample_actors import Counter, Point, Streamer

from rlasync import ActorError, LocalCluster, RuntimeConfig

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("node", [0, 1], ids=["this_node", "another_node"])
async def test_a_wrong_argument_is_the_same_error_wherever_the_actor_lives(node: int) -> None:
    async with LocalCluster(nodes=2, config=RuntimeConfig(call_timeout_s=20)) as cluster:
        counter = await cluster.spawn(Counter, 1, node=node)
        streamer = await cluster.spawn(Streamer, node=node)
        with pytest.raises(ActorError, match=r"TypeError: argument 'n' of .*add: Expected `int`, got `str`"):
            await counter.add("5")  # type: ignore[arg-type]
        with pytest.raises(ActorError, match=r"argument 'p' of .*norm1: Expected `object`, got `int`"):
            await counter.norm1(5)  # type: ignore[arg-type]
        with pytest.raises(ActorError, match=r"argument 'n' of .*count: Expected `int`, got `(list|array)`"):
            async for _ in streamer.count([3]):  # type: ignore[arg-type]
                pass
        assert await counter.norm1({"x": 3, "y": -4}) == 7  # type: ignore[arg-type]  # converted here too, as it would arrive
        assert await counter.mirror(Point(1, 2)) == Point(2, 1)
        with pytest.raises(
            (TypeError, ActorError), match="PosixPath"
        ):  # not encodable (remote) or not an int (here)
            await counter.add(Path("/tmp"))  # type: ignore[arg-type]


def test_a_script_without_a_main_guard_is_told_to_add_one(tmp_path: Path) -> None:
    script = tmp_path / "unguarded.py"
    script.write_text(
        textwrap.dedent("""
        import rlasync

        class Greeter(rlasync.Actor):
            @rlasync.endpoint
            async def hello(self) -> str:
                return "hi"

        async def main() -> None:
            async with rlasync.LocalCluster(nodes=2) as cluster:
                greeter = await cluster.spawn(Greeter, node=1)
                print(await greeter.hello())

        rlasync.run(main())   # no `if __name__ == "__main__":`
    """)
    )
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode != 0
    assert 'if __name__ == "__main__":' in done.stderr and "starts rlasync when imported" in done.stderr, (
        done.stderr[-3000:]
    )
    assert "define actor classes at module level" not in done.stderr, done.stderr[-3000:]
