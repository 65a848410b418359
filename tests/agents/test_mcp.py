"""Tools of a real MCP server over stdio (``agent.mcp_servers``): listed, called, failing and
timing out as tool errors the model reads, stopped with their owner; and a calc run whose every
tool call goes to the server, from a YAML file through ``rlasync train``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from calc_run import CONFIG, train

from rlasync.config.agent import MCPServerConfig
from rlasync.tools import ToolCall, ToolContext, run_tool_call
from rlasync.tools.mcp import MCPServers, MCPUnavailable

ROOT = Path(__file__).parents[2]
SERVER = Path(__file__).parent / "mcp_calculator.py"


def _running(marker: str) -> list[int]:
    """Processes whose command line holds ``marker``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


async def test_a_servers_tools_are_called_and_every_failure_is_a_message_for_the_model(
    tmp_path: Path,
) -> None:
    log = tmp_path / "calls.log"
    marker = f"--marker={tmp_path}"  # the server ignores it: it finds the process
    config = MCPServerConfig(
        command=sys.executable, args=[str(SERVER), marker], env={"MCP_CALLS_LOG": str(log)}, timeout_s=1.0
    )
    async with MCPServers({"calc": config}) as servers:
        assert set(servers.tools) == {"calculator"} and servers.tools["calculator"].server == "calc"
        schema = servers.tools["calculator"].schema()["function"]
        assert schema["name"] == "calculator" and schema["parameters"]["required"] == ["expression"]
        assert _running(marker)

        async def call(expression: str) -> object:
            return await run_tool_call(
                servers.tools,
                ToolCall(name="calculator", arguments={"expression": expression}),
                ToolContext("t"),
                max_response_chars=200,
            )

        ok, failed, slow = [await call(e) for e in ("37*58", "1//0", "sleep")]
        assert (ok.ok, ok.text) == (True, "2146")  # type: ignore[attr-defined]
        assert not failed.ok and "ZeroDivisionError" in failed.text  # type: ignore[attr-defined]
        assert (slow.ok, slow.error_kind) == (False, "timeout")  # type: ignore[attr-defined]
        missing = await run_tool_call(
            servers.tools, ToolCall(name="calculator", arguments={}), ToolContext("t")
        )
        assert not missing.ok and "expression" in missing.text  # checked against the listed schema
    assert log.read_text().split() == ["37*58", "1//0", "sleep"]
    assert not _running(marker)  # stopped with its owner


async def test_a_server_that_does_not_start_is_named() -> None:
    broken = MCPServerConfig(command="/nonexistent/mcp-server", start_timeout_s=10)
    with pytest.raises(
        MCPUnavailable, match=r"MCP server 'ghost' \(/nonexistent/mcp-server\) did not start: "
    ):
        async with MCPServers({"ghost": broken}):
            pass
    silent = MCPServerConfig(
        command=sys.executable, args=["-c", "import time; time.sleep(30)"], start_timeout_s=1
    )
    with pytest.raises(
        MCPUnavailable, match=r"did not list its tools within 1 s \(agent.mcp_servers.mute.start_timeout_s\)"
    ):
        async with MCPServers({"mute": silent}):
            pass


MCP_SERVER = """\
  mcp_servers:
    calc:
      command: {python}
      args: [{server}]
      env: {{MCP_CALLS_LOG: {log}}}
"""


def _config(path: Path, **fields: object) -> Path:
    path.write_text(CONFIG.format(agent=MCP_SERVER.format(**fields), **fields))
    return path


@pytest.mark.timeout(400)  # the calculator warm-start (calc_model) is built by the first test that asks
def test_a_calc_run_calls_the_mcp_servers_calculator(tmp_path: Path, calc_model: Path) -> None:
    log, run_dir = tmp_path / "calls.log", tmp_path / "run"
    config = _config(
        tmp_path / "mcp.yaml",
        model=calc_model,
        run_dir=run_dir,
        python=sys.executable,
        server=SERVER,
        log=log,
    )
    done = train(config)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][1:]
    assert all(r["rollout/tool_calls_mean"] > 0 for r in records), records
    trained = round(sum(r["rollout/tool_calls_mean"] * 16 for r in records))  # 2 steps x 16 trajectories
    calls = log.read_text().split()
    assert len(calls) >= trained > 0  # theirs, and the held-out validations'
    assert all(c.replace("*", "").replace("+", "").replace("-", "").isdigit() for c in calls), calls[:5]
    assert "validation accuracy (greedy, held-out): 0.0" not in done.stdout  # the model's format holds


def test_an_mcp_server_that_does_not_start_stops_the_run_before_it_starts(
    tmp_path: Path, nano_model_dir: Path
) -> None:
    config = _config(
        tmp_path / "mcp.yaml",
        model=nano_model_dir,
        run_dir=tmp_path / "run",
        python="/nonexistent/python",
        server=SERVER,
        log="x",
    )
    done = train(config)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "rlasync train: agent.mcp_servers: MCP server 'calc' (/nonexistent/python" in done.stderr
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
