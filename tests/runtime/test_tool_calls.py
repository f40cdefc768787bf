"""Replies parsed by the template's convention (runtime/tool_calls.py): each family's tool-call and reasoning
format from outputs written as the model cards and templates show them, streamed deltas that add up to the
final parse whatever the chunking, and a streamed chat on a tiny model whose pieces carry the parsed parts."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgelm.runtime.tool_calls import CONVENTIONS, ReplyParser, convention_for, starts_in_reasoning

TEMPLATES = Path(__file__).parents[1] / "data" / "templates"


def convention(template: str):
    return convention_for((TEMPLATES / f"{template}.jinja").read_text())


WEATHER = {"location": "San Francisco, CA, USA"}
# (template, reply as the model writes it (special tokens kept), content, reasoning, calls)
RECORDED = [
    (
        "Qwen-Qwen2.5-7B-Instruct",
        '<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": "San Francisco, CA, USA"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_temperature_date", "arguments": {"location": "San Francisco, CA, '
        'USA", "date": "2024-10-01"}}\n</tool_call>',
        "",
        None,
        [("get_current_temperature", WEATHER), ("get_temperature_date", WEATHER | {"date": "2024-10-01"})],
    ),
    (
        "Qwen-Qwen3-0.6B",
        '<think>\nThe user wants the weather; I should call the tool.\n</think>\n\nLet me check.\n<tool_call>\n{"name":'
        ' "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        "Let me check.",
        "The user wants the weather; I should call the tool.",
        [("get_weather", {"city": "Paris"})],
    ),
    ("Qwen-Qwen3-0.6B", "<think>\n2 + 2 is 4.\n</think>\n\nIt is 4.", "It is 4.", "2 + 2 is 4.", []),
    ("Qwen-Qwen3-0.6B", "<think>\n\n</think>\n\nHello!", "Hello!", "", []),
    (
        "NousResearch-Hermes-3-Llama-3.1-8B-tool_use",
        '<tool_call>\n{"arguments": {"symbol": "TSLA"}, "name": "get_stock_fundamentals"}\n</tool_call>',
        "",
        None,
        [("get_stock_fundamentals", {"symbol": "TSLA"})],
    ),
    (
        "meta-llama-Llama-3.1-8B-Instruct",
        '{"name": "get_current_conditions", "parameters": {"location": "San Francisco, CA", "unit": "Fahrenheit"}}',
        "",
        None,
        [("get_current_conditions", {"location": "San Francisco, CA", "unit": "Fahrenheit"})],
    ),
    (
        "meta-llama-Llama-3.1-8B-Instruct",
        '<|python_tag|>brave_search.call(query="current weather in Menlo Park, California")',
        "",
        None,
        [("brave_search", {"query": "current weather in Menlo Park, California"})],
    ),
    (
        "meta-llama-Llama-3.2-3B-Instruct",
        '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}',
        "",
        None,
        [("a", {"x": 1}), ("b", {})],
    ),
    ("meta-llama-Llama-3.2-3B-Instruct", '{"x": 1} is a JSON object.', '{"x": 1} is a JSON object.', None, []),
    (
        "mistralai-Mistral-Nemo-Instruct-2407",
        '[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": "Paris, France", "format": '
        '"celsius"}}]',
        "",
        None,
        [("get_current_weather", {"location": "Paris, France", "format": "celsius"})],
    ),
    (
        "ibm-granite-granite-3.3-2B-Instruct",
        '<|tool_call|>[{"arguments": {"location": "Boston"}, "name": "get_current_weather"}]',
        "",
        None,
        [("get_current_weather", {"location": "Boston"})],
    ),
    (
        "openai-gpt-oss-120b",
        "<|channel|>analysis<|message|>User asks for Tokyo's weather; call the tool.<|end|><|start|>assistant"
        '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"location": "Tokyo"}',
        "",
        "User asks for Tokyo's weather; call the tool.",
        [("get_weather", {"location": "Tokyo"})],
    ),
    (
        "openai-gpt-oss-120b",
        "<|channel|>analysis<|message|>Simple.<|end|><|start|>assistant<|channel|>final<|message|>Paris.",
        "Paris.",
        "Simple.",
        [],
    ),
    ("Qwen-Qwen2.5-7B-Instruct", "Plain answer, <b>no</b> markup.\n", "Plain answer, <b>no</b> markup.\n", None, []),
    (  # not a call after all: the block stays text
        "Qwen-Qwen2.5-7B-Instruct",
        "Use <tool_call>like this</tool_call>.",
        "Use <tool_call>like this</tool_call>.",
        None,
        [],
    ),
]
# the rows no template above selects, from the markup their model cards document
PHI4 = next(row for row in CONVENTIONS if row.name == "phi4")
GEMMA = next(row for row in CONVENTIONS if row.name == "tool_code")
OTHERS = [
    (
        PHI4,
        'I will look.<|tool_call|>[{"name": "get_weather_updates", "arguments": {"location": "London"}}]<|/tool_call|>',
        "I will look.",
        None,
        [("get_weather_updates", {"location": "London"})],
    ),
    (
        GEMMA,
        '```tool_code\nget_weather(city="Paris", days=2)\n```',
        "",
        None,
        [("get_weather", {"city": "Paris", "days": 2})],
    ),
]
CASES = [(convention(name), *rest) for name, *rest in RECORDED] + OTHERS


@pytest.mark.parametrize(("row", "text", "content", "reasoning", "calls"), CASES)
def test_each_convention_parses_its_recorded_output(row, text, content, reasoning, calls) -> None:
    parsed = row.parse(text, final=True)
    assert (parsed.content, parsed.reasoning, parsed.calls) == (content, reasoning, calls)


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(1, 400), max_size=30))
def test_streamed_deltas_add_up_to_the_final_parse(case, cuts) -> None:
    row, text = case[0], case[1]
    parser = ReplyParser(row)
    content, reasoning, calls = "", "", []
    for cut in sorted({min(cut, len(text)) for cut in cuts}):
        delta = parser.update(text[:cut])
        content, reasoning, calls = content + delta.content, reasoning + delta.reasoning, calls + delta.calls
    delta, parsed = parser.finish(text)
    content, reasoning, calls = content + delta.content, reasoning + delta.reasoning, calls + delta.calls
    assert (content, reasoning, calls) == (parsed.content, parsed.reasoning or "", parsed.calls)


def test_a_prompt_that_opens_the_reasoning() -> None:
    row = convention("Qwen-Qwen3-0.6B")
    assert starts_in_reasoning("<|im_start|>assistant\n<think>\n")
    assert not starts_in_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    parsed = row.parse("Two and two.\n</think>\n\nFour.", final=True, in_reasoning=True)
    assert (parsed.content, parsed.reasoning) == ("Four.", "Two and two.")


def test_templates_select_their_rows() -> None:
    names = {name: convention(name) for name, *_ in RECORDED}
    assert {name: (row.name, row.think) for name, row in names.items()} == {
        "Qwen-Qwen2.5-7B-Instruct": ("hermes", False),
        "Qwen-Qwen3-0.6B": ("hermes", True),
        "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": ("hermes", False),
        "meta-llama-Llama-3.1-8B-Instruct": ("llama3", False),
        "meta-llama-Llama-3.2-3B-Instruct": ("llama3", False),
        "mistralai-Mistral-Nemo-Instruct-2407": ("mistral", False),
        "ibm-granite-granite-3.3-2B-Instruct": ("phi4", True),  # its thinking mode writes <think>
        "openai-gpt-oss-120b": ("harmony", False),
    }
    assert convention("HuggingFaceTB-SmolLM3-3B").think and convention("HuggingFaceTB-SmolLM3-3B").name == "plain"
    assert len(convention("mistralai-Mistral-Nemo-Instruct-2407").new_id()) == 9  # its template demands 9


# ---- a streamed chat whose pieces carry the parsed parts ----------------------------------------------------------


@pytest.fixture(scope="module")
def think_model(tmp_path_factory):
    pytest.importorskip("llguidance")
    from chat_package import make_chat_package

    from edgelm.runtime import load

    package = make_chat_package(tmp_path_factory.mktemp("think") / "fused", template="think", context=512)
    return load(package, provider="cpu", threads=1)


def test_a_streamed_reply_separates_reasoning_and_keeps_the_history_as_written(think_model) -> None:
    grammar = 'start: "<think>\\n" /[a-z ]{1,12}/ "\\n</think>\\n\\n" /[a-z ]{1,10}/'  # a random model thinks on cue
    conv = think_model.conversation()
    stream = conv.stream("Why?", 60, grammar=grammar)
    pieces = list(stream)
    result = stream.result
    assert "".join(pieces) == result.text and result.text.startswith("<think>\n")
    assert result.reasoning == result.text.split("</think>")[0].removeprefix("<think>\n").strip()
    assert result.content == result.text.split("</think>")[1].lstrip() and result.tool_calls == []
    assert "".join(p.reasoning for p in pieces) == result.reasoning
    assert "".join(p.content for p in pieces) == result.content
    assert conv.messages[-1] == {"role": "assistant", "content": result.text}  # the template drops it itself
    plain = think_model.conversation().send("Why?", 8)
    assert plain.content == plain.text and plain.reasoning is None


def test_openai_messages_become_what_templates_read() -> None:
    from edgelm.runtime.tool_calls import from_openai

    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"city": "Paris"}'}}
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Hi, "}, {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    converted = from_openai(messages)
    assert converted[0]["content"] == "Hi, there"
    assert converted[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'  # not changed in place
    bad = {**call, "function": {"name": "f", "arguments": "not json"}}
    assert from_openai([{"role": "assistant", "tool_calls": [bad]}])[0]["tool_calls"] == [bad]


def test_a_prompt_that_opens_think_starts_the_reply_in_reasoning(think_model) -> None:
    source = (Path(__file__).parents[1] / "data" / "chat_templates" / "think.jinja").read_text()
    opens = source.replace("{{- '<|im_start|>assistant\\n' }}", "{{- '<|im_start|>assistant\\n<think>\\n' }}")
    assert opens != source
    free = think_model.conversation(template=opens).send("Why?", 6)
    assert free.reasoning == free.text.strip() and free.content == ""
    fixed = think_model.conversation(template=opens).send("Why?", 6, regex="(yes|no)")
    assert fixed.content == fixed.text in ("yes", "no") and fixed.reasoning is None


# ---- hostile model output: a call that does not parse stays text, and parsing never raises -------------------

HERMES = convention("Qwen-Qwen2.5-7B-Instruct")
MISTRAL = convention("mistralai-Mistral-Nemo-Instruct-2407")
LLAMA3 = convention("meta-llama-Llama-3.1-8B-Instruct")
HARMONY = convention("openai-gpt-oss-120b")


def _hermes(arguments: str) -> str:
    return '<tool_call>\n{"name": "f", "arguments": ' + arguments + "}\n</tool_call>"


def _gemma(call: str) -> str:
    return f"```tool_code\n{call}\n```"


HOSTILE = [
    *[
        (HERMES, _hermes(arguments))
        for arguments in (
            "[" * 1_000 + "]" * 1_000,  # past Python's json recursion
            '{"a": ' + "[" * 200 + "]" * 200 + "}",  # parses, but past the bound
            '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}",
            '{"a": ' + "7" * 4_400 + "}",  # past Python's int/str limit
            '{"a": NaN}',
            '{"a": Infinity}',
            '{"a": -Infinity}',
            '{"a": 1e999}',
            '"{\\"a\\": NaN}"',  # arguments as JSON text holding NaN
        )
    ],
    (MISTRAL, '[TOOL_CALLS][{"name": "f", "arguments": ' + "[" * 5_000 + "]" * 5_000 + "}]"),
    (MISTRAL, '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1e400}}]'),
    (PHI4, '<|tool_call|>[{"name": "f", "arguments": {"a": ' + "9" * 5_000 + "}}]<|/tool_call|>"),
    (LLAMA3, '{"name": "f", "parameters": ' + "{" * 3_000 + "}" * 3_000 + "}"),
    (LLAMA3, '{"name": "f", "parameters": {"x": NaN}}'),
    (LLAMA3, "<|python_tag|>" + "a." * 50_000 + "call(x=1)"),
    (HARMONY, '<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"a": ' + "[" * 2_000 + "]" * 2_000),
    (HARMONY, '<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"a": Infinity}'),
    *[
        (GEMMA, _gemma(call))
        for call in (
            "f(a={[]: 1})",  # unhashable key: TypeError in literal_eval
            "f(a=" + "-" * 100_000 + "1)",  # MemoryError in the parser
            "a." * 50_000 + "a(x=1)",  # RecursionError in unparse
            "f(a=" + "[" * 1_000 + "]" * 1_000 + ")",
            "f(a=" + "(" * 150 + "1" + ")" * 150 + ")",
            "f(a=" + "1" * 5_000 + ")",
            "f(a={1, 2})",  # a set, bytes, a complex number, Ellipsis: no JSON word for them
            'f(a=b"x")',
            "f(a=1j)",
            "f(a=...)",
            "f(a={1: 2})",  # JSON keys are strings
            "f(a=1e999)",
            "f(a=--1)",
            "f(a=x)",
            "f(**k)",
            "f(1)",
            "f(a=1)(b=2)",
        )
    ],
]


@pytest.mark.parametrize(("row", "text"), HOSTILE, ids=[f"{row.name}-{i}" for i, (row, _) in enumerate(HOSTILE)])
def test_hostile_output_stays_text_and_never_raises(row, text) -> None:
    parsed = row.parse(text, final=True)
    assert parsed.calls == []
    assert parsed.content == text or row.name == "harmony"  # harmony's message bodies are its content
    parser = ReplyParser(row)  # and streamed the same way
    for cut in (len(text) // 3, len(text) // 2, len(text) - 1):
        parser.update(text[:cut])
    _, streamed = parser.finish(text)
    assert streamed.calls == []


def test_python_literals_a_model_writes_become_json_values() -> None:
    text = _gemma('f(a=-1, b=[1, (2, 3.5)], c={"k": None, "t": True}, d=+2, e="x")\ng.h(i=[])')
    parsed = GEMMA.parse(text, final=True)
    assert parsed.calls == [
        ("f", {"a": -1, "b": [1, [2, 3.5]], "c": {"k": None, "t": True}, "d": 2, "e": "x"}),
        ("g.h", {"i": []}),
    ]


def test_deep_but_bounded_arguments_still_parse_and_go_out_as_strict_json() -> None:
    import json

    from edgelm.runtime.tool_calls import ToolCall

    nested = "[" * 100 + "]" * 100
    parsed = HERMES.parse(_hermes('{"a": ' + nested + ', "n": ' + "7" * 4_000 + "}"), final=True)
    assert len(parsed.calls) == 1 and parsed.calls[0][1]["n"] == int("7" * 4_000)
    sent = ToolCall("call_1", *parsed.calls[0]).to_openai()["function"]["arguments"]
    assert json.loads(sent) == parsed.calls[0][1]
    with pytest.raises(ValueError):
        ToolCall("call_2", "f", {"a": float("nan")}).to_openai()
