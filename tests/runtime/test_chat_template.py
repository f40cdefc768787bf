"""Chat templates: exact renderings of three template styles (ChatML, Llama 3 headers, one that drops earlier
reasoning), parity with transformers' apply_chat_template, prefix stability, message validation, and
hostile templates that the bounded sandbox must refuse quickly."""

from __future__ import annotations

import copy
import json
import threading
import time
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgelm.runtime import ChatTemplateError, EdgelmError
from edgelm.runtime.template import ROLES, ChatTemplate

TEMPLATES = Path(__file__).parents[1] / "data" / "chat_templates"
QWEN_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
LLAMA_TOKENS = dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
CHATML_TOKENS = dict(bos_token=None, eos_token="<|im_end|>")
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city, in °C",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Bye"},
]


def load(name: str, **tokens: str | None) -> ChatTemplate:
    return ChatTemplate((TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8"), **tokens)


def generation_suffix(template: ChatTemplate, messages: list[dict], **variables) -> str:
    """The text add_generation_prompt appends after messages (e.g. '<|im_start|>assistant\\n')."""
    with_prompt = template.render(messages, add_generation_prompt=True, **variables)
    without = template.render(messages, add_generation_prompt=False, **variables)
    assert with_prompt.startswith(without), "the generation prompt is not a suffix of the rendered messages"
    return with_prompt[len(without) :]


def is_prefix_stable(template: ChatTemplate, history: list[dict], new_history: list[dict], **variables) -> bool:
    """Whether new_history (with the generation prompt) renders as history's rendering plus more text."""
    before = template.render(history, add_generation_prompt=False, **variables)
    after = template.render(new_history, add_generation_prompt=True, **variables)
    return after.startswith(before)


@pytest.fixture(scope="module")
def chatml() -> ChatTemplate:
    return load("chatml", **CHATML_TOKENS)


@pytest.fixture(scope="module")
def llama3() -> ChatTemplate:
    return load("llama3", **LLAMA_TOKENS)


@pytest.fixture(scope="module")
def think() -> ChatTemplate:
    return load("think", **CHATML_TOKENS)


# ---- exact renderings ----


def test_chatml_default_system_and_generation_prompt(chatml: ChatTemplate) -> None:
    text = chatml.render([{"role": "user", "content": "Hello"}])
    assert text == (
        f"<|im_start|>system\n{QWEN_SYSTEM}<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
    )


def test_chatml_multi_turn_with_system(chatml: ChatTemplate) -> None:
    expected = (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"
    )
    assert chatml.render(CHAT, add_generation_prompt=False) == expected
    assert chatml.render(CHAT) == expected + "<|im_start|>assistant\n"
    assert generation_suffix(chatml, CHAT) == "<|im_start|>assistant\n"


def test_chatml_tools_use_hf_tojson(chatml: ChatTemplate) -> None:
    calls = [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}]
    messages = [
        {"role": "user", "content": "Weather in Zürich?"},
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "content": '{"temperature": 21}'},
    ]
    text = chatml.render(messages, tools=[TOOL])
    assert "\n<tools>\n" + json.dumps(TOOL, ensure_ascii=False) + "\n</tools>" in text  # no \u00b0, no &lt;
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call><|im_end|>\n' in text
    assert text.endswith(
        '<|im_start|>user\n<tool_response>\n{"temperature": 21}\n</tool_response><|im_end|>\n<|im_start|>assistant\n'
    )


def test_smollm2_relies_on_trim_and_lstrip_blocks() -> None:
    template = load("smollm2", **CHATML_TOKENS)
    smol = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    assert template.render([{"role": "user", "content": "Hi"}]) == (
        f"<|im_start|>system\n{smol}<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert template.render(CHAT[:2], add_generation_prompt=False) == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    )


def test_llama3_headers(llama3: ChatTemplate) -> None:
    head = "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
    dates = "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"
    body = (
        "You are terse.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nBye<|eot_id|>"
    )
    assert llama3.render(CHAT, add_generation_prompt=False, date_string="26 Jul 2024") == head + dates + body
    with_prompt = llama3.render(CHAT, date_string="26 Jul 2024")
    assert with_prompt == head + dates + body + "<|start_header_id|>assistant<|end_header_id|>\n\n"


def test_llama3_dates_with_strftime_now_and_raises(llama3: ChatTemplate) -> None:
    before = datetime.now()
    text = llama3.render([{"role": "user", "content": "Hi"}])
    dates = {(before + timedelta(seconds=s)).strftime("%d %b %Y") for s in (0, 60)}
    assert any(f"Today Date: {date}\n\n<|eot_id|>" in text for date in dates), text
    misplaced = [{"role": "user", "content": "Hi"}, {"role": "system", "content": "late"}]
    with pytest.raises(ChatTemplateError) as error:
        llama3.render(misplaced)
    assert str(error.value) == "The system message must come first."  # the template's own message


def test_think_drops_earlier_reasoning(think: ChatTemplate) -> None:
    history = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nTwo and two.\n</think>\n\n4"},
    ]
    last = "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n<think>\nTwo and two.\n</think>\n\n4<|im_end|>\n"
    assert think.render(history, add_generation_prompt=False) == last  # the last turn keeps its reasoning
    new = [*history, {"role": "user", "content": "3+3?"}]
    assert think.render(new) == (
        "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"
        "<|im_start|>user\n3+3?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert generation_suffix(think, new, enable_thinking=False) == "<|im_start|>assistant\n<think>\n\n</think>\n\n"


# ---- prefix stability ----


@pytest.mark.parametrize("name", ["chatml", "llama3", "think"])
def test_prefix_stable_without_reasoning(name: str, chatml, llama3, think) -> None:
    template = {"chatml": chatml, "llama3": llama3, "think": think}[name]
    for turns in range(1, len(CHAT)):
        assert is_prefix_stable(template, CHAT[:turns], CHAT, date_string="1 Jan 2025")


def test_prefix_unstable_when_earlier_reasoning_is_dropped(chatml, llama3, think) -> None:
    history = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>sum</think>4"}]
    new = [*history, {"role": "user", "content": "3+3?"}]
    assert not is_prefix_stable(think, history, new)
    assert is_prefix_stable(chatml, history, new)
    assert is_prefix_stable(llama3, history, new, date_string="1 Jan 2025")


# ---- parity with transformers ----


def hf_render(source: str, messages: list[dict], generation: bool, tokens: dict, **variables) -> str:
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    vocabulary = tokenizers.models.WordLevel({"<unk>": 0}, unk_token="<unk>")
    special = {name: value for name, value in tokens.items() if value is not None}
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizers.Tokenizer(vocabulary), **special)
    hf.chat_template = source
    return hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation, **variables)


PARITY_CASES = [
    [{"role": "user", "content": "Hello"}],
    CHAT,
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>a</think>4"}, CHAT[3]],
    [{"role": "user", "content": " spaced \n"}, {"role": "assistant", "content": "{{ not evaluated }}"}],
]


STYLES = [("chatml", CHATML_TOKENS), ("smollm2", CHATML_TOKENS), ("llama3", LLAMA_TOKENS), ("think", CHATML_TOKENS)]


@pytest.mark.parametrize("name,tokens", STYLES)
@pytest.mark.parametrize("case", range(len(PARITY_CASES)))
@pytest.mark.parametrize("generation", [True, False])
def test_same_text_as_transformers(name: str, tokens: dict, case: int, generation: bool) -> None:
    source = (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")
    messages, variables = PARITY_CASES[case], {"date_string": "26 Jul 2024", "enable_thinking": case % 2 == 0}
    if name == "chatml" and case == 1:
        variables["tools"] = [TOOL]
    ours = ChatTemplate(source, **tokens).render(messages, add_generation_prompt=generation, **variables)
    assert ours == hf_render(source, messages, generation, tokens, **variables)


# Real templates (as llama.cpp's models/templates keeps them) that read tool calls and reasoning: transformers
# drops a message's None-valued keys (an API's content=None beside tool_calls) and passes the reasoning as both
# reasoning_content and thinking; LFM2.5 wraps assistant turns in {% generation %}.
TOOL_CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
TOOL_CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
    {"role": "tool", "content": "21 C", "tool_call_id": "call_1", "name": None},
    {"role": "assistant", "content": "It is 21 C.", "reasoning": "The tool said so."},
    {"role": "user", "content": "Thanks"},
]


@pytest.mark.parametrize("name", ["glm-4.6", "minimax-m2", "lfm2.5"])
@pytest.mark.parametrize("generation", [True, False])
def test_tool_calls_and_reasoning_render_as_transformers(name: str, generation: bool) -> None:
    source = (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")
    tokens = dict(bos_token="<s>", eos_token="</s>")
    ours = ChatTemplate(source, **tokens).render(TOOL_CHAT, add_generation_prompt=generation, tools=[TOOL])
    assert ours == hf_render(source, TOOL_CHAT, generation, tokens, tools=[TOOL])
    assert "None" not in ours and "get_weather" in ours


def test_generation_blocks_render_their_body_as_transformers() -> None:
    source = (
        "{% for m in messages %}{% generation %}{% set kept = m.content %}<{{ kept }}>{% endgeneration %}"
        "[{{ kept }}]{% endfor %}{%- generation -%} {{ messages|length }} {%- endgeneration -%}"
    )
    ours = ChatTemplate(source).render(CHAT, add_generation_prompt=False)
    assert ours == hf_render(source, CHAT, False, {}) == "<You are terse.>[]<Hi>[]<Hello.>[]<Bye>[]4"


def test_none_valued_keys_are_dropped_as_transformers_drops_them(chatml: ChatTemplate) -> None:
    source = "{% for m in messages %}{{ m.role }}:{{ m.content is defined }},{{ m.tool_calls is defined }};{% endfor %}"
    messages = [CHAT[1], {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL], "name": None}]
    assert ChatTemplate(source).render(messages, add_generation_prompt=False) == "user:True,False;assistant:False,True;"
    assert hf_render(source, messages, False, {}) == "user:True,False;assistant:False,True;"


# ---- messages ----

BAD_MESSAGES = [
    ({"role": "user", "content": "Hi"}, "must be a list"),
    ("Hi", "must be a list"),
    (None, "must be a list"),
    (["Hi"], "message 0 is a str"),
    ([{"role": "bot", "content": "Hi"}], "message 0 has role 'bot'"),
    ([{"content": "Hi"}], "message 0 has no 'role'"),
    ([CHAT[1], {"role": "user"}], "message 1 (user) has no 'content'"),
    ([{"role": "user", "content": 42}], "content of type int"),
    ([{"role": "user", "content": ["Hi"]}], "content of type list"),
    ([{"role": "user", "content": None}], "content None"),
    ([{"role": "assistant", "content": None}], "content None"),
    ([{"role": "user", "content": "Hi", "extra": object()}], "a object value"),
    ([{"role": "user", "content": "Hi", "meta": {1: "x"}}], "not a string"),
]


@pytest.mark.parametrize("messages,message", BAD_MESSAGES)
def test_bad_messages_raise_a_clear_error(chatml: ChatTemplate, messages, message: str) -> None:
    with pytest.raises(ChatTemplateError, match=message.replace("(", r"\(").replace(")", r"\)")) as error:
        chatml.render(messages)
    assert isinstance(error.value, EdgelmError) and isinstance(error.value, ValueError)


def test_messages_are_not_changed_and_extra_keys_allowed(chatml: ChatTemplate) -> None:
    calls = [{"type": "function", "function": {"name": "f", "arguments": {}}}]
    messages = [CHAT[1], {"role": "assistant", "content": None, "tool_calls": calls, "name": "x"}]
    before = copy.deepcopy(messages)
    assert "<tool_call>" in chatml.render(messages)
    assert messages == before


def test_threads_render_independently(chatml: ChatTemplate) -> None:
    conversations = [[{"role": "user", "content": f"question {i} " * i}] for i in range(8)]
    alone = [chatml.render(messages) for messages in conversations]
    results: list[str | None] = [None] * 8

    def work(index: int) -> None:
        for _ in range(50):
            results[index] = chatml.render(conversations[index])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == alone


content_text = st.lists(
    st.one_of(
        st.text(alphabet="ab {}%#<>|/\n'\"\\", max_size=12),
        st.sampled_from(
            [
                "{{ 7*7 }}",
                "{% if true %}X{% endif %}",
                "{# c #}",
                "{{ raise_exception('x') }}",
                "<|im_end|>",
                "{%- raw %}",
                "{{ ''.__class__ }}",
                "}}{{",
                "{%",
                "%}",
            ]
        ),
    ),
    max_size=4,
).map("".join)
message = st.builds(lambda role, content: {"role": role, "content": content}, st.sampled_from(ROLES), content_text)


def expected_chatml(messages: list[dict], generation: bool) -> str:
    system, turns = (
        (messages[0]["content"], messages[1:]) if messages[0]["role"] == "system" else (QWEN_SYSTEM, messages)
    )
    text = f"<|im_start|>system\n{system}<|im_end|>\n"
    for m in turns:
        if m["role"] == "tool":
            text += f"<|im_start|>user\n<tool_response>\n{m['content']}\n</tool_response><|im_end|>\n"
        else:
            text += f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n"
    return text + ("<|im_start|>assistant\n" if generation else "")


@settings(max_examples=60, deadline=None)
@given(messages=st.lists(message, min_size=1, max_size=6), generation=st.booleans())
def test_contents_render_literally(chatml: ChatTemplate, messages: list[dict], generation: bool) -> None:
    assert chatml.render(messages, add_generation_prompt=generation) == expected_chatml(messages, generation)
    assert all(is_prefix_stable(chatml, messages[:turns], messages) for turns in range(1, len(messages) + 1))


# ---- hostile templates ----

SANDBOX = "refused by the sandbox"
STOPPED = "stopped"
HOSTILE = [
    ("{{ ''.__class__.__mro__ }}", SANDBOX),
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", SANDBOX),
    ("{{ cycler.__init__.__globals__ }}", SANDBOX),
    ("{{ raise_exception.__globals__ }}", SANDBOX),
    ("{{ strftime_now.__code__.co_consts }}", SANDBOX),
    ("{{ joiner.__call__ }}", SANDBOX),
    ("{{ messages.append(1) }}", SANDBOX),
    ("{{ messages[0].update({'role': 'system'}) }}", SANDBOX),
    ("{% set ns = namespace() %}{% set ns.__class__ = 1 %}", SANDBOX),
    ("{{ '{0.__class__.__mro__}'.format(1) }}", SANDBOX),
    ("{{ ('{0.__class__}'|attr('format'))(1) }}", SANDBOX),
    ("{{ ''|attr('__class__') }}", SANDBOX),
    ("{{ dict.mro() }}", "mro"),
    ("{{ lipsum(10**6) }}", "undefined"),
    ("{% for i in range(10**9) %}x{% endfor %}", STOPPED),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "loop iterations"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "nested more than"),
    ("{% for x in [1] recursive %}{{ loop([1]) }}{% endfor %}", "nested more than"),
    ("{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(40) }}", STOPPED),
    ("{{ 'x' * 1000000000 }}", STOPPED),
    ("{{ 10 ** (10 ** 10) }}", STOPPED),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{{ 'x' * 1000 }}{% endfor %}{% endfor %}", STOPPED),
    ("{% set ns = namespace(s='a') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", STOPPED),
    ("{% macro f(s, n) %}{% if n %}{{ f(s ~ s, n - 1) }}{% endif %}{% endmacro %}{{ f('a', 40) }}", STOPPED),
    ("{{ ''|center(1000000000) }}", STOPPED),
    ("{{ 'x'.ljust(10**9) }}", STOPPED),
    ("{{ ([('x' * 4000000)] * 1000)|join }}", STOPPED),
    (
        "{% set big = 'x' * 4000000 %}{% macro m() %}{% for i in range(1000) %}{{ big }}{% endfor %}{% endmacro %}"
        "{{ m() }}",
        STOPPED,
    ),
    ("{% macro m() %}{% for i in range(100000) %}" + "y" * 10_000 + "{% endfor %}{% endmacro %}{{ m() }}", STOPPED),
    ("{{ foo.bar }}", "'foo' is undefined"),
    ("{{ 1 / 0 }}", "ZeroDivisionError"),
]


@pytest.mark.parametrize("source,message", HOSTILE)
def test_hostile_templates_fail_quickly(chatml: ChatTemplate, source: str, message: str) -> None:
    start = time.perf_counter()
    with pytest.raises(ChatTemplateError, match=message) as error:
        ChatTemplate(source).render(CHAT)
    assert time.perf_counter() - start < 10, "a bound did not stop the template"
    assert "\n" not in str(error.value)
    assert chatml.render(CHAT[1:2]).startswith("<|im_start|>system")  # nothing left broken behind


@pytest.mark.parametrize(
    "source,message",
    [
        ("{% for m in messages %}\n{{ m.content }\n{% endfor %}", "line 2"),
        ("Hello\n{% if x %}", "line 2"),
        ("{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}", "nested too deeply"),
        ("{% if a %}" * 100 + "x" + "{% endif %}" * 100, "nested too deeply"),  # Python's IndentationError
        ("{% for i in a %}" * 30 + "x" + "{% endfor %}" * 30, "nested too deeply"),  # Python's SyntaxError
        ("", "non-empty"),
    ],
)
def test_templates_that_do_not_compile(source: str, message: str) -> None:
    with pytest.raises(ChatTemplateError, match=message):
        ChatTemplate(source)


def test_large_numbers_are_fine_where_they_are_values() -> None:
    assert (
        ChatTemplate("{{ (10 ** 12)|int }} {{ 2 ** 64 }} {{ 'ab' * 3 }}").render([])
        == "1000000000000 18446744073709551616 ababab"
    )


def test_tojson_matches_hugging_face() -> None:
    value = {"b": "<é>", "a": [1, 2.5, None, True]}
    template = ChatTemplate(
        "{{ v|tojson }}|{{ v|tojson(indent=2, sort_keys=True) }}|{{ v|tojson(separators=(',', ':')) }}"
    )
    expected = [
        json.dumps(value, ensure_ascii=False),
        json.dumps(value, ensure_ascii=False, indent=2, sort_keys=True),
        json.dumps(value, ensure_ascii=False, separators=(",", ":")),
    ]
    assert template.render([], v=value) == "|".join(expected)
