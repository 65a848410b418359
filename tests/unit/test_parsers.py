"""Tool-call parsers (hermes, gpt-oss): well-formed, nested, unicode, several, malformed and
<think>-wrapped calls; no text makes a parser raise; rendering calls and parsing gives them back."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from rlasync.tools import (
    HarmonyParser,
    HermesParser,
    ParsedTurn,
    ToolCall,
    ToolResult,
    error_result,
    get_parser,
    register_parser,
    registered_parsers,
)
from rlasync.tools.parsers import registry as parsers_module

hermes = get_parser("hermes")
harmony = get_parser("gpt-oss")


def call(name: str, arguments: dict[str, Any]) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}</tool_call>"


# -- registry --------------------------------------------------------------------------------
def test_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    assert {"hermes", "gpt-oss"} <= set(registered_parsers())
    assert isinstance(hermes, HermesParser) and isinstance(harmony, HarmonyParser)
    assert get_parser("hermes") is hermes  # stateless: one shared instance
    with pytest.raises(KeyError, match="registered: .*gpt-oss.*hermes"):
        get_parser("qwen-xml")
    monkeypatch.setattr(parsers_module, "_PARSERS", parsers_module._PARSERS.copy())

    @register_parser("mine")
    class Mine(HermesParser):
        pass

    assert isinstance(get_parser("mine"), Mine) and Mine.name == "mine"
    with pytest.raises(ValueError, match="'hermes' is taken"):
        register_parser("hermes")(Mine)


# -- hermes ----------------------------------------------------------------------------------
def test_hermes_one_call_and_the_text_around_it() -> None:
    turn = hermes.parse(
        'Let me compute. <tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}</tool_call>'
    )
    assert turn == ParsedTurn(
        content="Let me compute.", calls=[ToolCall("calculator", {"expression": "2*3"}, "call_0")]
    )


def test_hermes_several_calls_nested_and_unicode() -> None:
    nested = {
        "query": {"filters": [{"field": "città", "op": "=", "value": "東京 🗼"}], "limit": 3},
        "flags": [True, None, 1.5],
    }
    text = f"{call('search', nested)}\n{call('calculator', {'expression': '1+1'})}\n{call('émoji_😀', {})}"
    turn = hermes.parse(text, call_id_prefix="t3_")
    assert turn.calls == [
        ToolCall("search", nested, "t3_0"),
        ToolCall("calculator", {"expression": "1+1"}, "t3_1"),
        ToolCall("émoji_😀", {}, "t3_2"),
    ]
    assert turn.errors == [] and turn.content == ""


def test_hermes_lenient_shapes() -> None:
    text = (
        '<tool_call>\n{"name": "a", "arguments": "{\\"x\\": 1}"}\n</tool_call>'  # arguments as a JSON string (Qwen's newlines)
        '<tool_call>{"name": "b", "parameters": {"y": 2}}</tool_call>'  # "parameters"
        '<tool_call>{"name": "c"}</tool_call>'  # no arguments
        '<tool_call>{"name": "d", "arguments": ""}</tool_call>'  # empty string
        '<tool_call>{"name": "e", "arguments": {"code": "print(\'</tool_call>\')"}}</tool_call>'  # the tag inside a string
        '<tool_call>{"name": "f", "arguments": {"z": 3}}'  # the engine stopped at (and dropped) </tool_call>
    )
    turn = hermes.parse(text)
    assert [(c.name, c.arguments) for c in turn.calls] == [
        ("a", {"x": 1}),
        ("b", {"y": 2}),
        ("c", {}),
        ("d", {}),
        ("e", {"code": "print('</tool_call>')"}),
        ("f", {"z": 3}),
    ]
    assert turn.errors == [] and [c.id for c in turn.calls] == [f"call_{i}" for i in range(6)]


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        ('{"name": "a", "arguments": {"x": 1}', "invalid JSON (Expecting ',' delimiter at character 35)"),
        ("{'name': 'a', 'arguments': {}}", "invalid JSON (Expecting property name enclosed in double quotes"),
        ('{"name": "a", "arguments": {}}}', "unexpected text after the JSON object"),
        ('{"arguments": {}}', 'missing "name"'),
        ('{"name": "", "arguments": {}}', 'missing "name"'),
        ('{"name": 7, "arguments": {}}', 'missing "name"'),
        ('{"name": "a", "arguments": [1, 2]}', '"arguments" must be a JSON object, got an array'),
        ('{"name": "a", "arguments": "x=1"}', '"arguments" is a string but not JSON'),
        ('{"name": "a", "arguments": "[1]"}', '"arguments" must be a JSON object, got an array'),
        ('["a", {}]', 'a call must be a JSON object with "name" and "arguments"'),
        ("", "invalid JSON (Expecting value at character 0)"),
        ("[" * 100_000, "invalid JSON (nested too deeply)"),
    ],
)
def test_hermes_malformed_call_is_an_error_and_the_next_call_still_counts(body: str, problem: str) -> None:
    turn = hermes.parse(f"Hi <tool_call>{body}</tool_call> there {call('ok', {'n': 1})}")
    assert len(turn.errors) == 1 and turn.errors[0].startswith(f"invalid tool call #1: {problem}")
    assert "<tool_call>{" in turn.errors[0]  # the message shows the model the expected format
    assert turn.calls == [ToolCall("ok", {"n": 1}, "call_0")] and turn.content == "Hi  there"


def test_hermes_unclosed_call_is_an_error() -> None:
    turn = hermes.parse('<tool_call>{"name": "a", "arguments": {"x": 1} and then')
    assert turn.calls == [] and "no </tool_call>" in turn.errors[0]


def test_hermes_ignores_calls_inside_think() -> None:
    text = f"<think>maybe {call('calculator', {'expression': '1+1'})}? no.</think>Answer: {call('python', {'code': 'print(1)'})}"
    turn = hermes.parse(text)
    assert turn.calls == [ToolCall("python", {"code": "print(1)"}, "call_0")] and turn.content == "Answer:"
    assert turn.reasoning.startswith("maybe <tool_call>") and turn.errors == []


def test_hermes_unclosed_think_swallows_the_rest() -> None:
    turn = hermes.parse(f"Sure. <think>I could {call('calculator', {'expression': '1+1'})} or {{bad json")
    assert (turn.calls, turn.errors, turn.content) == ([], [], "Sure.")


def test_hermes_think_opened_by_the_prompt() -> None:
    # A generation prompt ending in "<think>\n" (DeepSeek-R1, QwQ) leaves only the closing tag.
    turn = hermes.parse(
        f"plan: {call('x', {})} later</think>\n\n42 {call('calculator', {'expression': '6*7'})}"
    )
    assert turn.reasoning.startswith("plan:") and turn.content == "42"
    assert turn.calls == [ToolCall("calculator", {"expression": "6*7"}, "call_0")]
    # …but a </think> inside a call's arguments, with no <think> before, is just text.
    code_call = call("python", {"code": "print('</think>')"})
    assert hermes.parse(code_call).calls == [ToolCall("python", {"code": "print('</think>')"}, "call_0")]


def test_hermes_render_turn_and_responses_are_what_the_chat_template_renders() -> None:
    from rlasync.models import build_tokenizer

    tok = build_tokenizer()
    calls = [
        ToolCall("calculator", {"expression": "2*3"}, "call_0"),
        ToolCall("python", {"code": 'print("é")', "n": [1, {"a": None}]}, "call_1"),
    ]
    results = [
        ToolResult(text="6", name="calculator", call_id="call_0"),
        error_result("exception", "python failed", name="python"),
    ]
    history = [{"role": "user", "content": "hi"}]
    assistant = {
        "role": "assistant",
        "content": "ok",
        "tool_calls": [
            {"type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls
        ],
    }
    before = str(tok.apply_chat_template([*history, assistant], tokenize=False))  # type: ignore[arg-type]
    messages = [*history, assistant, *hermes.format_responses(results)]
    after = str(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))  # type: ignore[arg-type]
    assert before.endswith(
        "<|im_start|>assistant\n" + hermes.render_turn(calls, content="ok") + "<|im_end|>\n"
    )
    assert after == before + hermes.render_responses(results)
    assert hermes.parse(hermes.render_turn(calls, content="ok")).calls == calls


def test_format_responses_are_tool_messages() -> None:
    results = [ToolResult(text="6", name="calculator", call_id="call_0")]
    expected = [{"role": "tool", "name": "calculator", "tool_call_id": "call_0", "content": "6"}]
    assert hermes.format_responses(results) == harmony.format_responses(results) == expected


# -- gpt-oss (harmony) -----------------------------------------------------------------------
DOC_EXAMPLE = (  # openai/harmony docs/format.md, "Receiving tool calls", after the prompt's <|start|>assistant
    "<|channel|>analysis<|message|>Need to use function get_weather.<|end|>"
    '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"location":"San Francisco"}<|call|>'
)


def test_harmony_doc_example() -> None:
    turn = harmony.parse(DOC_EXAMPLE)
    assert turn == ParsedTurn(
        reasoning="Need to use function get_weather.",
        calls=[ToolCall("get_weather", {"location": "San Francisco"}, "call_0")],
    )
    assert harmony.parse("<|start|>assistant" + DOC_EXAMPLE) == turn  # with the header start generated too


@pytest.mark.parametrize(
    "header",
    [
        "<|channel|>commentary to=functions.lookup <|constrain|>json",
        "<|channel|>commentary to=functions.lookup<|constrain|>json",  # no space
        "<|channel|>commentary to=functions.lookup",  # no constrain
        "<|channel|>commentary to=functions.lookup json",  # the content type without the token
        " to=functions.lookup<|channel|>commentary <|constrain|>json",  # recipient in the role part
    ],
)
def test_harmony_header_variants(header: str) -> None:
    args = {"q": {"nested": [1, {"deep": "ü"}]}, "k": 5}
    turn = harmony.parse(f"{header}<|message|>{json.dumps(args, ensure_ascii=False)}<|call|>")
    assert turn.calls == [ToolCall("lookup", args, "call_0")] and turn.errors == []


def test_harmony_final_answer_and_preamble_are_content_analysis_is_not() -> None:
    final = "<|channel|>analysis<|message|>User asks 2+2. Simple.<|end|><|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|return|>"
    assert harmony.parse(final) == ParsedTurn(content="2 + 2 = 4.", reasoning="User asks 2+2. Simple.")
    preamble = (
        "<|channel|>analysis<|message|>think<|end|><|start|>assistant<|channel|>commentary<|message|>Checking both cities.<|end|>"
        '<|start|>assistant<|channel|>commentary to=functions.weather <|constrain|>json<|message|>{"city": "Zürich"}<|call|>'
        '<|start|>assistant<|channel|>commentary to=functions.weather <|constrain|>json<|message|>{"city": "大阪"}<|call|>'
    )
    turn = harmony.parse(preamble)
    assert turn.content == "Checking both cities." and turn.reasoning == "think"
    assert turn.calls == [
        ToolCall("weather", {"city": "Zürich"}, "call_0"),
        ToolCall("weather", {"city": "大阪"}, "call_1"),
    ]


def test_harmony_stop_token_dropped_by_the_engine() -> None:
    turn = harmony.parse('<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"a": 1}')
    assert turn.calls == [ToolCall("f", {"a": 1}, "call_0")]
    assert harmony.parse("<|channel|>final<|message|>done").content == "done"


def test_harmony_malformed_calls_are_errors() -> None:
    text = (
        "<|channel|>commentary to=functions.a <|constrain|>json<|message|>{not json}<|call|>"
        '<|start|>assistant<|channel|>commentary to=functions.b <|constrain|>json<|message|>["x"]<|call|>'
        "<|start|>assistant<|channel|>analysis to=python<|message|>print(1)<|call|>"  # a built-in tool: not here
        "<|start|>assistant<|channel|>commentary to=functions. <|constrain|>json<|message|>{}<|call|>"
        "<|start|>assistant<|channel|>commentary to=functions.c <|constrain|>json<|end|>"  # no body
        '<|start|>assistant<|channel|>commentary to=functions.ok <|constrain|>json<|message|>{"n": 1}<|call|>'
    )
    turn = harmony.parse(text)
    assert turn.calls == [ToolCall("ok", {"n": 1}, "call_0")]
    assert [e.split(":")[0] for e in turn.errors] == [
        "invalid tool call #1 to a",
        "invalid tool call #2 to b",
        "invalid tool call #3",
        "invalid tool call #4",
        "invalid tool call #5 to functions.c",
    ]
    assert (
        "invalid JSON" in turn.errors[0]
        and "got an array" in turn.errors[1]
        and "'python' is not a function" in turn.errors[2]
    )
    assert all("to=functions.NAME" in e for e in turn.errors)  # each shows the model the expected format


def test_harmony_ignores_messages_of_other_roles_and_keeps_plain_text() -> None:
    made_up = '<|start|>functions.f to=assistant<|channel|>commentary<|message|>{"sunny": true}<|end|>'
    text = "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}<|call|>" + made_up
    assert harmony.parse(text) == ParsedTurn(calls=[ToolCall("f", {}, "call_0")])
    assert harmony.parse("The answer is 4.") == ParsedTurn(
        content="The answer is 4."
    )  # a model that ignores the format


def test_harmony_render_responses_follows_the_format() -> None:
    results = [
        ToolResult(text='{"sunny": true, "temperature": 20}', name="get_weather", call_id="call_0"),
        error_result("parse_error", "bad"),
    ]
    assert harmony.render_responses(results) == (
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{"sunny": true, "temperature": 20}<|end|>'
        "<|start|>functions.unknown to=assistant<|channel|>commentary<|message|>error: bad<|end|>"
        "<|start|>assistant"
    )
    assert not harmony.render_responses(results, add_generation_prompt=False).endswith("<|start|>assistant")


def test_harmony_render_turn_matches_the_doc_example() -> None:
    rendered = harmony.render_turn(
        [ToolCall("get_weather", {"location": "San Francisco"})],
        reasoning="Need to use function get_weather.",
    )
    assert rendered == DOC_EXAMPLE.replace('{"location":"San Francisco"}', '{"location": "San Francisco"}')


# -- properties ------------------------------------------------------------------------------
FRAGMENTS = [
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    '{"name": "f", "arguments": {',
    '"x": [1, {"y": "z"}]',
    "}}",
    '"',
    "{",
    "}",
    "[",
    "]",
    ",",
    ":",
    "\\",
    "null",
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|channel|>",
    "<|constrain|>",
    "<|call|>",
    "<|return|>",
    "assistant",
    "analysis",
    "final",
    "commentary",
    " to=functions.f",
    " to=python",
    "json",
    "functions.",
    "\n",
    " ",
    "é",
    "😀",
    "\x00",
    "\ud800",
]
model_output = st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=8)), max_size=40).map("".join)


@pytest.mark.parametrize("parser", [hermes, harmony], ids=["hermes", "gpt-oss"])
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=model_output)
def test_no_text_makes_a_parser_raise(parser: Any, text: str) -> None:
    turn = parser.parse(text)
    assert isinstance(turn.content, str) and isinstance(turn.reasoning, str)
    assert all(isinstance(c.name, str) and c.name and isinstance(c.arguments, dict) for c in turn.calls)
    assert all(isinstance(e, str) and e for e in turn.errors)
    assert [c.id for c in turn.calls] == [f"call_{i}" for i in range(len(turn.calls))]


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
arguments = st.dictionaries(st.text(max_size=8), json_values, max_size=4)
names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_.\-]{0,15}", fullmatch=True)
tool_calls = st.lists(st.builds(ToolCall, names, arguments), max_size=4)

HERMES_TAGS = re.compile(r"<think>|</think>|<tool_call>")
HARMONY_TOKENS = re.compile(r"<\|(?:start|end|message|channel|constrain|call|return)\|>")
hermes_text = st.text(max_size=30).filter(lambda s: HERMES_TAGS.search(s) is None)
harmony_text = st.text(max_size=30).filter(lambda s: HARMONY_TOKENS.search(s) is None)


def with_ids(calls: list[ToolCall]) -> list[ToolCall]:
    return [ToolCall(c.name, c.arguments, f"call_{i}") for i, c in enumerate(calls)]


@settings(max_examples=250, deadline=None)
@given(calls=tool_calls, content=hermes_text, reasoning=st.none() | hermes_text)
def test_hermes_round_trip(calls: list[ToolCall], content: str, reasoning: str | None) -> None:
    turn = hermes.parse(hermes.render_turn(calls, content=content, reasoning=reasoning))
    assert turn == ParsedTurn(
        content=content.strip(), reasoning=(reasoning or "").strip(), calls=with_ids(calls)
    )


@settings(max_examples=250, deadline=None)
@given(calls=tool_calls, content=harmony_text, reasoning=st.none() | harmony_text)
def test_harmony_round_trip(calls: list[ToolCall], content: str, reasoning: str | None) -> None:
    # A real harmony tokenizer cannot put its control tokens inside a JSON string: neither may we.
    assume(not any(HARMONY_TOKENS.search(json.dumps(c.arguments, ensure_ascii=False)) for c in calls))
    turn = harmony.parse(harmony.render_turn(calls, content=content, reasoning=reasoning))
    assert turn == ParsedTurn(
        content=content.strip(), reasoning=(reasoning or "").strip(), calls=with_ids(calls)
    )
