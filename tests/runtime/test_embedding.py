"""What a script that embeds the runtime meets: the same argument checks wherever an actor
lives, and a script without a ``__main__`` guard told so."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from sample_actors import Counter, Point, Streamer

from rlasync import ActorError, LocalCluster, RuntimeConfig

ROOT = Path(__file__).resolve().parents[2]


def _run_script(script: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``python script`` in its folder, as a user runs one, with ``env`` only."""
    return subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=script.parent, env=env
    )


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
    done = _run_script(script, {"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"})
    assert done.returncode != 0
    assert 'if __name__ == "__main__":' in done.stderr and "starts rlasync when imported" in done.stderr, (
        done.stderr[-3000:]
    )
    assert "define actor classes at module level" not in done.stderr, done.stderr[-3000:]


SPAWNING_SCRIPT = """
    import json
    import sys

    import rlasync
    from sample_actors import Counter as ModuleCounter  # a class from an importable module

    class ScriptCounter(rlasync.Actor):  # a class from the running script
        def __init__(self, start: int) -> None:
            self.value = start

        @rlasync.endpoint
        async def add(self, n: int) -> int:
            self.value += n
            return self.value

    class Spawner(rlasync.Actor):
        @rlasync.endpoint
        async def spawn_on(self, node: int, origin: str) -> int:
            cls = ScriptCounter if origin == "script" else ModuleCounter
            counter = await self.node.spawn(cls, 1, node=node)
            return await counter.add(1)

    async def main() -> None:
        async with rlasync.LocalCluster(nodes=3) as cluster:
            for source in range(3):
                spawner = await cluster.spawn(Spawner, node=source)
                for target in range(3):
                    for origin in ("module", "script"):
                        if target != source:
                            try:
                                got = await spawner.spawn_on(target, origin)
                            except Exception as exc:
                                got = f"{type(exc).__name__}: {exc}"
                            print(json.dumps([source, target, origin, got]), flush=True)

    if __name__ == "__main__":
        rlasync.run(main())
"""


def test_an_actor_on_any_node_spawns_on_any_other_classes_from_a_module_or_the_script(tmp_path: Path) -> None:
    """A member may spawn on any node, the head included: the head's own bookkeeping (registering
    the new actor) does not run as the node that asked, and on the head the script is __main__."""
    script = tmp_path / "spawning.py"
    script.write_text(textwrap.dedent(SPAWNING_SCRIPT))
    done = _run_script(
        script, {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "runtime"), *sys.path])}
    )
    results = [json.loads(line) for line in done.stdout.splitlines()]
    pairs = [(s, t, origin) for s in range(3) for t in range(3) for origin in ("module", "script") if s != t]
    assert [tuple(r[:3]) for r in results] == pairs, done.stderr[-3000:]
    assert all(r[3] == 2 for r in results), [r for r in results if r[3] != 2]
    assert done.returncode == 0 and "refused a caller" not in done.stderr, done.stderr[-3000:]
