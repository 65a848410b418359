"""Tools from a file in verl's tool-config shape (``agent.tool_config``): built with their
options and schema, every mistake a ``ToolConfigError`` naming the entry, and a calc run
through ``rlasync train`` whose calculator is the file's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from calc_run import CONFIG, train

from rlasync.tools import ToolCall, ToolConfigError, build_agent_tools, load_tool_config, run_tool_call
from rlasync.tools.base import ToolContext

# A tool class outside the package, found by its import path (the test puts its folder on sys.path).
LOGGED_CALCULATOR = """\
from rlasync.tools import CalculatorTool


class LoggedCalculator(CalculatorTool):
    def __init__(self, log: str) -> None:
        self.log = log

    async def call(self, arguments, context):
        with open(self.log, "a") as f:
            f.write(arguments["expression"] + "\\n")
        return await super().call(arguments, context)
"""

VERL_FILE = """\
tools:
  - class_name: logged_calculator.LoggedCalculator
    config:
      type: native
      log: {log}
    tool_schema:
      type: function
      function:
        name: calculator
        description: {description}
        parameters:
          type: object
          properties:
            expression: {{type: string}}
          required: [expression]
"""


@pytest.fixture
def tool_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "logged_calculator.py").write_text(LOGGED_CALCULATOR)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


async def test_a_verl_tool_file_builds_its_tools_with_their_options_and_schema(tool_module: Path) -> None:
    log = tool_module / "calls.log"
    path = tool_module / "tools.yaml"
    path.write_text(
        VERL_FILE.format(log=log, description="Evaluate an arithmetic expression.")
        + "  - class_name: python\n    config: {type: native, wall_time_s: 3, isolation: weaker}\n"
        + "    tool_schema:\n      function:\n        name: run_python\n"
        + "        parameters: {type: object, properties: {code: {type: string}}, required: [code]}\n"
    )
    tools = load_tool_config(path)
    assert sorted(tools) == ["calculator", "run_python"]
    calculator, python = tools["calculator"], tools["run_python"]
    assert calculator.schema()["function"]["description"] == "Evaluate an arithmetic expression."
    assert python.name == "run_python" and python.wall_time_s == 3  # type: ignore[attr-defined]
    result = await run_tool_call(tools, ToolCall("calculator", {"expression": "6*7"}), ToolContext())
    assert result.ok and result.text == "42" and log.read_text() == "6*7\n"
    # The schema the model was shown is the one its arguments are checked against.
    wrong = await run_tool_call(tools, ToolCall("run_python", {"source": "print(1)"}), ToolContext())
    assert not wrong.ok and wrong.error_kind == "bad_arguments"
    # Beside agent.tools; one name once.
    assert sorted(build_agent_tools(["calculator"], "")) == ["calculator"]
    with pytest.raises(ToolConfigError, match=r"a tool named 'calculator' is in agent.tools too: drop one"):
        build_agent_tools(["calculator"], str(path))


@pytest.mark.parametrize(
    ("text", "error"),
    [
        (
            "tools:\n  - class_name: nowhere.Tool\n",
            r"tools\[0\] \(nowhere.Tool\): class_name: cannot import 'nowhere.Tool'",
        ),
        (
            "tools:\n  - class_name: json.JSONDecoder\n",
            r"class_name names <class 'json.decoder.JSONDecoder'>, not a subclass",
        ),
        (
            "tools:\n  - class_name: calculator\n    config: {precision: 3}\n",
            r"tools\[0\] \(calculator\): config: CalculatorTool\(\) takes no arguments",
        ),
        (
            "tools:\n  - class_name: calculator\n    tool_schema: {type: function}\n",
            r"missing required field `function`",
        ),
        (
            "tools:\n  - {class_name: calculator}\n  - {class_name: calculator}\n",
            r"two tools are named 'calculator'",
        ),
        ("tools:\n  - name: calculator\n", r"expected tools: \[\{class_name, config, tool_schema\}"),
        ("tools: [\n", r"not YAML"),
    ],
)
def test_every_mistake_in_the_file_names_the_entry(tmp_path: Path, text: str, error: str) -> None:
    path = tmp_path / "tools.yaml"
    path.write_text(text)
    with pytest.raises(ToolConfigError, match=r"agent.tool_config \(.*tools.yaml\): .*" + error):
        load_tool_config(path)
    with pytest.raises(ToolConfigError, match=r"cannot read it"):
        load_tool_config(tmp_path / "missing.yaml")


@pytest.mark.timeout(400)  # the calculator warm-start (calc_model) is built by the first test that asks
def test_a_calc_run_calls_the_calculator_its_verl_tool_file_names(
    tool_module: Path, calc_model: Path
) -> None:
    log, run_dir = tool_module / "calls.log", tool_module / "run"
    tool_config = tool_module / "tools.yaml"
    # The calc task's schema exactly (no description): the tiny model was trained on that prompt.
    tool_config.write_text(VERL_FILE.format(log=log, description='""'))
    config = tool_module / "run.yaml"
    config.write_text(
        CONFIG.format(model=calc_model, run_dir=run_dir, agent=f"  tool_config: {tool_config}\n")
    )
    done = train(config, pythonpath=(str(tool_module),))
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][1:]
    assert all(r["rollout/tool_calls_mean"] > 0 for r in records), records
    assert all(r["rollout/tool_errors_mean"] < r["rollout/tool_calls_mean"] for r in records), records
    trained = round(sum(r["rollout/tool_calls_mean"] * 16 for r in records))  # 2 steps x 16 trajectories
    assert len(log.read_text().split()) >= trained > 0  # theirs, and the held-out validations'


def test_a_run_whose_tool_file_is_wrong_stops_before_it_starts(
    tool_module: Path, nano_model_dir: Path
) -> None:
    tool_config = tool_module / "tools.yaml"
    tool_config.write_text("tools:\n  - class_name: logged_calculator.Missing\n")
    config = tool_module / "run.yaml"
    config.write_text(
        CONFIG.format(
            model=nano_model_dir, run_dir=tool_module / "run", agent=f"  tool_config: {tool_config}\n"
        )
    )
    done = train(config, pythonpath=(str(tool_module),))
    assert done.returncode == 2, done.stderr[-3000:]
    assert (
        f"rlasync train: agent.tool_config ({tool_config}): tools[0] (logged_calculator.Missing): class_name: "
        "cannot import 'logged_calculator.Missing'" in done.stderr
    ), done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
