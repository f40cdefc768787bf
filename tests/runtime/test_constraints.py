"""Constrained decoding (runtime/constraints.py, llguidance) on a tiny random Llama package (tests/chat_package.py):
JSON Schema, regex and Lark output that always parses and validates, batches with a grammar per row, speculative
decoding that gives plain constrained decoding's tokens, a conversation's kept cache, and forced tool calls whose
round trip renders as transformers renders it."""

from __future__ import annotations

import json
import re
from typing import Literal

import numpy as np
import pytest
from chat_package import TEMPLATES, make_chat_package
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgelm.runtime import InvalidParameterError, load
from edgelm.runtime.constraints import GrammarMask, constraint_from

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

QWEN = (TEMPLATES.parent / "templates" / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    package = make_chat_package(tmp_path_factory.mktemp("constraints") / "fused", context=1024)  # room for tools
    return load(package, provider="cpu", threads=1)


# ---- random small JSON schemas: the output always validates --------------------------------------------------

LEAVES = st.one_of(
    st.just({"type": "boolean"}),
    st.integers(-50, 50).map(lambda low: {"type": "integer", "minimum": low, "maximum": low + 100}),
    st.integers(0, 6).map(lambda n: {"type": "string", "maxLength": n}),
    st.lists(st.sampled_from(["red", "green", "blue", "x y", "é"]), min_size=1, max_size=3, unique=True).map(
        lambda values: {"enum": values}
    ),
    st.just({"type": "null"}),
)


def _object(children: st.SearchStrategy) -> st.SearchStrategy:
    names = st.sampled_from(["a", "b", "name", "value", "list"])
    return st.dictionaries(names, children, min_size=1, max_size=3).flatmap(
        lambda properties: st.lists(st.sampled_from(sorted(properties)), unique=True).map(
            lambda required: {
                "type": "object",
                "properties": properties,
                "required": required,
                "additionalProperties": False,
            }
        )
    )


SCHEMAS = st.recursive(
    LEAVES,
    lambda children: st.one_of(
        _object(children),
        children.map(lambda items: {"type": "array", "items": items, "maxItems": 3}),
        st.lists(children, min_size=2, max_size=2).map(lambda options: {"anyOf": options}),
    ),
    max_leaves=6,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=SCHEMAS, seed=st.integers(0, 1000), temperature=st.sampled_from([0.0, 1.0]))
def test_json_schema_output_always_validates(model, schema, seed, temperature) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    result = model.generate("Answer: ", 160, response_format=response_format, temperature=temperature, seed=seed)
    assert result.finish_reason == "eos", f"{result.text!r} did not complete"
    jsonschema.validate(json.loads(result.text), schema)


def test_json_object_regex_and_lark(model) -> None:
    for seed in range(4):  # any object: a random model may write keys until the budget ends
        result = model.generate("x", 60, response_format={"type": "json_object"}, temperature=1.0, seed=seed)
        assert result.text.startswith("{")
        if result.finish_reason == "eos":
            assert isinstance(json.loads(result.text), dict)
    for seed in range(3):
        result = model.generate("phone: ", 30, regex=r"\d{3}-\d{4}", temperature=1.0, seed=seed)
        assert re.fullmatch(r"\d{3}-\d{4}", result.text) and result.finish_reason == "eos"
    lark = 'start: answer " because " reason\nanswer: "yes" | "no"\nreason: /[a-z]{1,8}/'
    result = model.generate("Is it? ", 30, grammar=lark, temperature=1.0, seed=1)
    assert re.fullmatch(r"(yes|no) because [a-z]{1,8}", result.text)
    free = model.generate("phone: ", 8, temperature=1.0, seed=0)
    assert not re.fullmatch(r"\d{3}-\d{4}", free.text)  # the constraint did the work, not the model


def test_bad_constraints_raise_before_generating(model) -> None:
    for bad in (
        {"regex": "[a-"},
        {"grammar": "start: undefined_rule"},
        {"response_format": {"type": "yaml"}},
        {"response_format": {"type": "json_schema"}},
        {"regex": r"\d", "grammar": 'start: "a"'},
    ):
        with pytest.raises(InvalidParameterError):
            model.generate("x", 4, **bad)
    for bad, reason in [("(", "unclosed group"), ("[z-a]", "invalid character class range")]:
        with pytest.raises(InvalidParameterError, match=re.escape(reason)):  # the reason, not just "parse error:"
            model.generate("x", 4, regex=bad)
    with pytest.raises(InvalidParameterError, match="2 entries for 3 prompts"):
        model.generate_batch(["a", "b", "c"], 4, regex=[r"\d", None])


# ---- one mask for every path: batches, speculative decoding, a kept cache --------------------------------------


def test_a_grammar_per_row_equals_each_row_alone(model) -> None:
    prompts = ["one ", "two two ", "three three three "]
    regexes = [r"\d{2,6}", None, r"(ab|cd){1,4}!"]
    batch = model.generate_batch(prompts, 12, regex=regexes)
    for prompt, regex, row in zip(prompts, regexes, batch, strict=True):
        alone = model.generate(prompt, 12, regex=regex)
        assert row.token_ids == alone.token_ids
    assert re.fullmatch(r"\d{2,6}", batch[0].text) and re.fullmatch(r"(ab|cd){1,4}!", batch[2].text)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_speculative_constrained_equals_plain_constrained(model, temperature) -> None:
    regex = r"(the cat sat ){3,8}(on|in) [a-z]{2,12}\."
    prompt = "the cat sat the cat sat the cat sat the cat sat "
    options = {"regex": regex, "temperature": temperature, "seed": 5}
    plain = model.generate(prompt, 60, **options)
    fast = model.generate(prompt, 60, speculative="lookup", **options)
    assert re.fullmatch(regex, fast.text)
    assert fast.timings.proposed_tokens > 0 and fast.timings.accepted_tokens > 0
    if temperature == 0.0:
        assert fast.token_ids == plain.token_ids


def test_the_mask_follows_the_ids_it_is_given(model) -> None:
    """Speculative decoding asks for positions after guesses, then for positions after fewer ids once guesses are
    rejected: the mask keeps its matcher in step (rolling back), and a position after a refused id is left as is."""
    mask = GrammarMask(model, constraint_from(regex=r"abc(d|e)"))
    ab, c = model.tokenizer.encode("abc")  # llguidance keeps to the canonical tokens: "ab", "c"
    x = model.tokenizer.encode("x")[0]
    logits = np.zeros(model.vocab_size, dtype=np.float32)
    first = mask(0, [], logits)
    assert np.flatnonzero(np.isfinite(first)).tolist() == [ab]
    assert np.isfinite(mask(0, [ab], logits)[c]) and not np.isfinite(mask(0, [ab], logits)[x])
    assert np.isfinite(mask(0, [ab, c], logits)).sum() == 2  # d or e
    assert mask(0, [ab, x], logits) is logits  # after a refused guess: never chosen from, left unmasked
    assert np.array_equal(mask(0, [], logits), first)  # rolled back to the start
    assert np.isfinite(mask(1, [], logits)).sum() == 1  # another row has its own matcher


def test_conversation_turns_keep_their_cache_and_their_format(model) -> None:
    conv = model.conversation(system="Reply in JSON.")
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]}
    first = conv.send("A number?", 40, response_format={"type": "json_schema", "json_schema": {"schema": schema}})
    jsonschema.validate(json.loads(first.text), schema)
    second = conv.send("Another, as a word.", 40, regex=r"(one|two|three)")
    assert second.text in ("one", "two", "three")
    assert conv.last_turn.path == "prefix" and conv.last_turn.reused_tokens > 0
    assert conv.messages[-1]["content"] == second.text


# ---- forced tool calls, and the round trip through a conversation -------------------------------------------------


def get_weather(city: Literal["Paris", "London"], unit: Literal["C", "F"] = "C") -> str:
    """The weather in a city (arguments from short lists: a random model would write a free string forever).

    Args:
        city: The city's name.
        unit: The temperature unit.
    """


def test_forced_tool_call_round_trip_renders_as_transformers(model) -> None:
    transformers = pytest.importorskip("transformers")
    conv = model.conversation(system="You help.", template=QWEN, tools=[get_weather])
    asked = conv.send("Weather in Paris?", 80, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert asked.tool_calls and asked.tool_calls[0].name == "get_weather", asked.text
    call = asked.tool_calls[0]
    from edgelm.runtime.tools import tool_schema

    jsonschema.validate(call.arguments, tool_schema(get_weather)["function"]["parameters"])
    assert asked.text.startswith("<tool_call>") and asked.content == ""
    assert conv.messages[-1]["tool_calls"] == [call.to_message()]
    result = {"role": "tool", "tool_call_id": call.id, "name": call.name, "content": '{"weather": "sunny"}'}
    reply = conv.send(result, 20)
    reference = transformers.PreTrainedTokenizerFast(tokenizer_file=str(model.spec.tokenizer_path))
    reference.chat_template = QWEN
    history = conv.messages[:-1]  # what the reply answered
    expected = reference.apply_chat_template(
        history, tools=[get_weather], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert reply.prompt_token_ids == list(expected)
    assert history[-2]["tool_calls"][0]["function"]["arguments"] == call.arguments


def test_required_tool_choice_and_its_errors(model) -> None:
    empty = {"type": "object", "properties": {}, "additionalProperties": False}
    weather = {"type": "function", "function": {"name": "weather", "parameters": empty}}
    result = model.chat(
        [{"role": "user", "content": "hi"}], 80, template=QWEN, tools=[get_weather, weather], tool_choice="required"
    )
    assert result.tool_calls and {call.name for call in result.tool_calls} <= {"get_weather", "weather"}
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(InvalidParameterError, match="not among the tools"):
        named = {"type": "function", "function": {"name": "x"}}
        model.chat(messages, 8, template=QWEN, tools=[weather], tool_choice=named)
    with pytest.raises(InvalidParameterError, match="needs tools"):
        model.chat(messages, 8, template=QWEN, tool_choice="required")
    with pytest.raises(InvalidParameterError, match="tool 0 has no function name"):
        model.chat(messages, 8, template=QWEN, tools=[{"type": "function"}], tool_choice="required")
    with pytest.raises(InvalidParameterError, match="tool_choice"):
        model.chat(messages, 8, template=QWEN, tools=[weather], tool_choice="always")


MISTRAL_SPECIAL = ("[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]")
MISTRAL_SPECIAL += ("[TOOL_RESULTS]", "[/TOOL_RESULTS]")


@pytest.fixture(scope="module")
def mistral_model(tmp_path_factory):
    template = str(TEMPLATES.parent / "templates" / "mistralai-Mistral-Nemo-Instruct-2407.jinja")
    out = tmp_path_factory.mktemp("mistral") / "fused"
    package = make_chat_package(out, template=template, context=1024, extra_special=MISTRAL_SPECIAL)
    return load(package, provider="cpu", threads=1)


def test_calls_behind_a_special_token_stream_with_their_ids(mistral_model) -> None:
    """Mistral's [TOOL_CALLS] is a control token, which decoding drops from the text: the calls are parsed from a
    decoding that keeps it, streamed as they complete, with the 9-character ids its template demands."""
    transformers = pytest.importorskip("transformers")
    conv = mistral_model.conversation(tools=[get_weather])
    stream = conv.stream("Weather in Paris?", 80, tool_choice="required")
    pieces = list(stream)
    result = stream.result
    assert "[TOOL_CALLS]" not in result.text and result.text.startswith("[{")
    streamed = [call for piece in pieces for call in piece.tool_calls]
    assert streamed == result.tool_calls and streamed and result.content == ""
    assert all(len(call.id) == 9 and call.id.isalnum() for call in streamed)
    results = [{"role": "tool", "tool_call_id": call.id, "content": '"sunny"'} for call in streamed]
    reply = conv.send(results, 8)
    reference = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(mistral_model.spec.tokenizer_path), bos_token="<|begin_of_text|>", eos_token="<|im_end|>"
    )
    reference.chat_template = (
        TEMPLATES.parent / "templates" / "mistralai-Mistral-Nemo-Instruct-2407.jinja"
    ).read_text()
    expected = reference.apply_chat_template(
        conv.messages[:-1], tools=[get_weather], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert reply.prompt_token_ids == list(expected)


HARMONY_SPECIAL = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>", "<|constrain|>")


def test_a_forced_gpt_oss_call_round_trip(tmp_path_factory) -> None:
    """gpt-oss's harmony format: the call's recipient in a header of control tokens, its history kept in the fields
    the template reads, the tool's turn rendered as transformers renders it."""
    transformers = pytest.importorskip("transformers")
    template = TEMPLATES.parent / "templates" / "openai-gpt-oss-120b.jinja"
    out = tmp_path_factory.mktemp("harmony") / "fused"
    model = load(
        make_chat_package(out, template=str(template), context=1024, extra_special=HARMONY_SPECIAL),
        provider="cpu",
        threads=1,
    )
    conv = model.conversation(tools=[get_weather], template_vars={"reasoning_effort": "low"})
    asked = conv.send("Weather in Paris?", 60, tool_choice="required")
    assert [call.name for call in asked.tool_calls] == ["get_weather"] and asked.content == "", asked.text
    assert conv.messages[-1] == {"role": "assistant", "content": "", "tool_calls": [asked.tool_calls[0].to_message()]}
    reply = conv.send({"role": "tool", "tool_call_id": asked.tool_calls[0].id, "content": "sunny"}, 8)
    reference = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(model.spec.tokenizer_path), bos_token="<|begin_of_text|>", eos_token="<|im_end|>"
    )
    reference.chat_template = template.read_text()
    expected = reference.apply_chat_template(
        conv.messages[:-1], tools=[get_weather], reasoning_effort="low", add_generation_prompt=True, tokenize=True,
        return_dict=False,
    )  # fmt: skip
    assert reply.prompt_token_ids == list(expected)


# ---- bounds: a hostile schema or grammar is a clean error before the first token --------------------------------


def _nested_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def test_a_schema_nested_thousands_deep_is_an_error_not_a_segfault() -> None:
    import subprocess
    import sys

    # in a child process: before the bound, llguidance's recursive conversion overflowed the C stack (exit -11)
    code = (
        "import json, sys\n"
        "from edgelm.runtime import InvalidParameterError\n"
        "from edgelm.runtime.constraints import constraint_from\n"
        "schema = {'type': 'string'}\n"
        "for _ in range(5000): schema = {'type': 'object', 'properties': {'a': schema}}\n"
        "try:\n"
        "    constraint_from(response_format={'type': 'json_schema', 'json_schema': {'schema': schema}})\n"
        "except InvalidParameterError as e:\n"
        "    print(e)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-500:]
    assert "nested more than 128 deep" in done.stdout


def test_schema_depth_is_bounded_where_llguidance_bounds_it(model) -> None:
    assert constraint_from(response_format={"type": "json_schema", "json_schema": {"schema": _nested_schema(60)}})
    for depth in (65, 200, 900):  # 130+ dicts deep: llguidance's own limit is 128 levels of JSON text
        with pytest.raises(InvalidParameterError, match="nested more than 128 deep|recursion limit"):
            constraint_from(response_format={"type": "json_schema", "json_schema": {"schema": _nested_schema(depth)}})
    deep_tool = {"type": "function", "function": {"name": "f", "parameters": _nested_schema(900)}}
    with pytest.raises(InvalidParameterError, match="the tool f's parameters"):
        model.chat([{"role": "user", "content": "hi"}], 8, template=QWEN, tools=[deep_tool], tool_choice="required")


def _properties(count: int, **extra) -> dict:
    properties = {f"p{i}": {"type": "boolean"} for i in range(count)}
    return {"type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": properties, **extra}}}


LIMITS = {
    "optional-properties": {"response_format": _properties(5_000, additionalProperties=False)},
    "mixed-enum": {
        "response_format": {
            "type": "json_schema",
            "json_schema": {
                "schema": {"enum": [[i] if i % 3 == 0 else {"k": i} if i % 3 == 1 else f"s{i}" for i in range(10_000)]}
            },
        }
    },
    "regex": {"regex": "^(a{1000}){1000}$"},
    "lark": {"grammar": "start: " + " | ".join(f'"w{i}"' for i in range(20_000))},
}


@pytest.mark.parametrize("options", LIMITS.values(), ids=LIMITS.keys())
def test_a_grammar_past_llguidances_limits_fails_before_the_first_token(model, options) -> None:
    pieces = []
    with pytest.raises(InvalidParameterError, match="past what constrained decoding can follow"):
        for piece in model.stream("Answer: ", 40, **options):
            pieces.append(piece)
    assert pieces == []


def test_a_large_schema_within_the_limits_still_runs(model) -> None:
    result = model.generate(
        "Answer: ", 60, response_format=_properties(5_000, required=[f"p{i}" for i in range(5_000)])
    )
    assert result.text.startswith('{"p0": ') and result.finish_reason == "length"
