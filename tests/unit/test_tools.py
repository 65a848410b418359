"""Tools: schema export, the registry, and every error path of run_tool_call (none of them raise)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from rlasync.tools import (
    CALCULATOR,
    CalculatorTool,
    PythonTool,
    Tool,
    ToolCall,
    ToolContext,
    ToolError,
    base,
    build_tools,
    calculator,
    error_result,
    get_tool,
    register_tool,
    registered_tools,
    run_tool_call,
    schemas,
    truncate_text,
    validate_arguments,
)


class Echo(Tool):
    name = "echo"
    description = "Say it back."
    parameters = {
        "type": "object",
        "properties": {
            "text": {"type": "string"},
            "times": {"type": "integer"},
            "mode": {"type": "string", "enum": ["loud", "quiet"]},
            "ratio": {"type": ["number", "null"]},
        },
        "required": ["text"],
        "additionalProperties": False,
    }
    timeout_s = 1.0

    async def call(self, arguments: dict[str, Any], context: ToolContext) -> str:
        context.scratch["calls"] = context.scratch.get("calls", 0) + 1
        return arguments["text"] * arguments.get("times", 1)


class Misbehaving(Tool):
    """Does what ``arguments["do"]`` says: raise, hang, exit, return a non-string."""

    name = "bad"
    parameters = {"type": "object", "properties": {"do": {"type": "string"}}, "required": ["do"]}
    timeout_s = 0.2

    def __init__(self) -> None:
        self.cleaned_up = asyncio.Event()
        self.started = asyncio.Event()

    async def call(self, arguments: dict[str, Any], context: ToolContext) -> str:
        do = arguments["do"]
        if do == "raise":
            raise ValueError("boom")
        if do == "tool_error":
            raise ToolError("the input is wrong", kind="output_limit")
        if do == "exit":
            raise SystemExit(3)
        if do == "own_timeout":
            raise TimeoutError("socket timed out")
        if do == "number":
            return 42  # type: ignore[return-value]
        if do == "long":
            return "x" * 1000
        try:
            self.started.set()
            await asyncio.sleep(3600)
        finally:
            self.cleaned_up.set()
        return "never"


@pytest.fixture
def tools() -> dict[str, Tool]:
    return {"echo": Echo(), "bad": Misbehaving(), "calculator": CalculatorTool()}


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests that register tools do it in a copy of the registry."""
    monkeypatch.setattr(base, "_TOOLS", base._TOOLS.copy())


# -- schema and registry ---------------------------------------------------------------------
def test_schema_is_the_openai_function_format() -> None:
    assert Echo().schema() == {
        "type": "function",
        "function": {"name": "echo", "description": "Say it back.", "parameters": Echo.parameters},
    }
    assert CalculatorTool().schema() == CALCULATOR  # the calc task's prompts: byte-identical in a template
    assert [s["function"]["name"] for s in schemas({"echo": Echo(), "calculator": CalculatorTool()})] == [
        "calculator",
        "echo",
    ]


def test_python_schema_names_its_code_argument() -> None:
    function = PythonTool(isolation="weaker").schema()[
        "function"
    ]  # weaker: also where the sandbox is not whole
    assert (
        function["name"] == "python"
        and function["parameters"]["required"] == ["code"]
        and function["description"]
    )


def test_builtins_are_registered_and_built_by_name_with_options() -> None:
    assert {"calculator", "python"} <= set(registered_tools())
    assert get_tool("calculator") is CalculatorTool
    tools = build_tools({"calculator": None, "python": {"wall_time_s": 2.5, "isolation": "weaker"}})
    assert isinstance(tools["calculator"], CalculatorTool)
    assert isinstance(tools["python"], PythonTool) and tools["python"].wall_time_s == 2.5
    assert list(build_tools(["calculator"])) == ["calculator"]


def test_unknown_tool_name_lists_the_registered_ones() -> None:
    with pytest.raises(KeyError, match="registered: .*calculator.*python"):
        get_tool("nope")


@pytest.mark.usefixtures("registry")
def test_register_user_tool_and_refuse_a_taken_name() -> None:
    register_tool(Echo)
    assert get_tool("echo") is Echo and isinstance(build_tools(["echo"])["echo"], Echo)
    register_tool(Echo)  # registering the same class again (a re-import) is fine

    class Impostor(Echo):
        pass

    with pytest.raises(ValueError, match="'echo' is taken"):
        register_tool(Impostor)

    class Nameless(Tool):
        async def call(self, arguments: dict[str, Any], context: ToolContext) -> str:
            return ""

    with pytest.raises(TypeError, match="needs a class attribute `name`"):
        register_tool(Nameless)
    with pytest.raises(ValueError, match="listed twice"):
        build_tools(["echo", "echo"])


def test_python_tool_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match="wall_time_s, memory_mb"):
        PythonTool(wall_time_s=0, memory_mb=1)


# -- run_tool_call: success and every failure --------------------------------------------------
async def test_call_succeeds_and_carries_id_timing_and_context(tools: dict[str, Tool]) -> None:
    context = ToolContext("traj-1")
    result = await run_tool_call(tools, ToolCall("echo", {"text": "ab", "times": 2}, "call_0"), context)
    assert (result.text, result.ok, result.name, result.call_id) == ("abab", True, "echo", "call_0")
    assert result.error_kind is None and 0 < result.elapsed_s < 1
    await run_tool_call(tools, ToolCall("echo", {"text": "x"}), context)
    assert context.scratch["calls"] == 2  # per-trajectory state lives in the context, not the tool


async def test_unknown_tool_tells_the_model_what_exists(tools: dict[str, Tool]) -> None:
    result = await run_tool_call(tools, ToolCall("calc", {}), ToolContext())
    assert not result.ok and result.error_kind == "unknown_tool"
    assert result.text == "error: unknown tool 'calc'; available: bad, calculator, echo"


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        ({}, "missing required argument 'text'"),
        ({"text": 3}, "argument 'text' must be string, got integer"),
        ({"text": "a", "times": True}, "argument 'times' must be integer, got boolean"),
        ({"text": "a", "times": 1.5}, "argument 'times' must be integer, got number"),
        ({"text": "a", "mode": "shout"}, "argument 'mode' must be one of ['loud', 'quiet']"),
        ({"text": "a", "colour": "red"}, "unexpected argument 'colour'"),
        (["a"], "arguments must be a JSON object, got array"),
        ("text", "arguments must be a JSON object, got string"),
    ],
)
async def test_bad_arguments_are_explained_with_the_usage(
    tools: dict[str, Tool], arguments: Any, expected: str
) -> None:
    result = await run_tool_call(tools, ToolCall("echo", arguments), ToolContext())
    assert not result.ok and result.error_kind == "bad_arguments"
    assert result.text.startswith("error: ") and expected in result.text
    assert "Usage: echo(text: string, times?: integer, mode?: string, ratio?: number|null)" in result.text


def test_validate_arguments_accepts_union_types_and_unknown_types() -> None:
    assert validate_arguments(Echo.parameters, {"text": "a", "ratio": None}) == []
    assert validate_arguments(Echo.parameters, {"text": "a", "ratio": 2}) == []
    assert validate_arguments({"properties": {"x": {"type": "tensor"}}}, {"x": object()}) == []
    assert len(validate_arguments(Echo.parameters, {"times": "2", "colour": 1})) == 3


@pytest.mark.parametrize(
    ("do", "kind", "text"),
    [
        ("raise", "exception", "error: bad failed: ValueError: boom"),
        ("tool_error", "output_limit", "error: the input is wrong"),
        ("exit", "exception", "error: bad failed: SystemExit: 3"),
        ("own_timeout", "exception", "error: bad failed: TimeoutError: socket timed out"),
        ("number", "exception", "error: bad failed: it returned int, not text"),
    ],
)
async def test_a_failing_tool_becomes_an_error_result(
    tools: dict[str, Tool], do: str, kind: str, text: str
) -> None:
    result = await run_tool_call(tools, ToolCall("bad", {"do": do}, "c1"), ToolContext())
    assert (result.ok, result.error_kind, result.text, result.call_id) == (False, kind, text, "c1")
    assert result.error_message


async def test_a_hanging_tool_times_out_at_its_deadline(tools: dict[str, Tool]) -> None:
    start = time.perf_counter()
    result = await run_tool_call(tools, ToolCall("bad", {"do": "hang"}), ToolContext())
    assert (result.error_kind, result.text) == ("timeout", "error: bad timed out after 0.2s")
    elapsed = time.perf_counter() - start
    assert 0.15 <= elapsed < 5, (
        elapsed
    )  # uvloop's clock is cached per loop iteration: it may fire a little early
    assert tools["bad"].cleaned_up.is_set()  # type: ignore[attr-defined]


async def test_cancellation_propagates_and_the_tool_cleans_up(tools: dict[str, Tool]) -> None:
    bad = tools["bad"]
    bad.timeout_s = None  # only the cancellation can stop it
    task = asyncio.create_task(run_tool_call(tools, ToolCall("bad", {"do": "hang"}), ToolContext()))
    await asyncio.wait_for(bad.started.wait(), 5)  # type: ignore[attr-defined]
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert bad.cleaned_up.is_set()  # type: ignore[attr-defined]


async def test_malformed_call_objects_never_raise(tools: dict[str, Tool]) -> None:
    result = await run_tool_call(tools, ToolCall(["not", "hashable"], {}), ToolContext())  # type: ignore[arg-type]
    assert not result.ok and result.error_kind == "unknown_tool" and "['not', 'hashable']" in result.text
    result = await run_tool_call(tools, ToolCall(None, None, None), ToolContext())  # type: ignore[arg-type]
    assert not result.ok and result.error_kind == "unknown_tool" and result.call_id == ""

    class Broken(dict[str, Tool]):
        def get(self, key: Any, default: Any = None) -> Any:
            raise RuntimeError("lookup failed")

    result = await run_tool_call(Broken(tools), ToolCall("echo", {"text": "a"}), ToolContext())
    assert not result.ok and result.error_kind == "exception" and "RuntimeError" in result.text


async def test_long_responses_are_capped(tools: dict[str, Tool]) -> None:
    result = await run_tool_call(
        tools, ToolCall("bad", {"do": "long"}), ToolContext(), max_response_chars=100, truncate_side="right"
    )
    assert result.truncated and len(result.text) == 100 and result.text.endswith("...(truncated)")
    short = await run_tool_call(
        tools, ToolCall("echo", {"text": "hi"}), ToolContext(), max_response_chars=100
    )
    assert not short.truncated and short.text == "hi"


@pytest.mark.parametrize("side", ["left", "right", "middle"])
@pytest.mark.parametrize("limit", [0, 5, 14, 15, 20, 99, 100, 200])
def test_truncate_text_keeps_within_the_limit(side: str, limit: int) -> None:
    text = "".join(chr(ord("a") + i % 26) for i in range(100))
    cut, truncated = truncate_text(text, limit, side)  # type: ignore[arg-type]
    assert len(cut) <= limit and truncated == (limit < 100)
    if truncated and limit > 20:
        kept = cut.replace("...(truncated)", "")
        if side == "right":
            assert text.startswith(kept)
        elif side == "left":
            assert text.endswith(kept)
        else:
            assert text.startswith(kept[: len(kept) // 2]) and text.endswith(kept[len(kept) // 2 :])
    assert truncate_text(text, None) == (text, False)


def test_error_result_is_what_loops_show_for_parse_errors() -> None:
    result = error_result("parse_error", "invalid tool call #1: invalid JSON", call_id="call_0")
    assert (result.text, result.ok, result.error_kind) == (
        "error: invalid tool call #1: invalid JSON",
        False,
        "parse_error",
    )


# -- calculator ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("expression", "ok", "text"),
    [
        ("37*58", True, "2146"),
        ("(2+3)*-4 // 3", True, "-7"),
        ("1//0", False, "error: ZeroDivisionError"),
        ("__import__('os')", False, "error: ValueError"),
        ("2**10", False, "error: ValueError"),  # no power: no way to make a huge number
        ("1+" * 40 + "1", False, "error: expression too long"),
        ("1 +", False, "error: SyntaxError"),
    ],
)
async def test_calculator(tools: dict[str, Tool], expression: str, ok: bool, text: str) -> None:
    result = await run_tool_call(tools, ToolCall("calculator", {"expression": expression}), ToolContext())
    assert (result.ok, result.text) == (ok, text)
    assert result.error_kind == (None if ok else "tool_error")


def test_calculator_evaluates_arithmetic_and_nothing_else() -> None:
    assert calculator("37*58") == "2146"
    assert calculator("(1+2)*-3 - 7//2 % 2") == "-10"
    for bad in ["__import__('os')", "2**99999", "1/2", "1//0", "x", "1" * 80, "3.5*2"]:
        assert calculator(bad).startswith("error"), bad
