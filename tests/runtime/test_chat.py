"""Chat on a tiny random Llama package with ChatML / Llama 3 special tokens (tests/chat_package.py).

The KV cache's extend and rewind against a prompt of the whole sequence (both graphs); conversations
whose every turn feeds exactly the ids of rendering the whole history (checked by generating from those
ids afresh: the same greedy tokens) in four template styles; undo, reset, a full context, cancelled
streams, EOS lists, errors that leave the conversation unchanged, and threads."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from chat_package import IM_END, TEMPLATES, make_chat_package

from edgelm.runtime import (
    ChatTemplateError,
    ContextLengthError,
    InvalidInputError,
    InvalidParameterError,
    load,
)
from edgelm.runtime.chat import Conversation
from edgelm.runtime.kvcache import make_cache
from edgelm.runtime.template import ChatTemplate

TOLERANCE = 1e-4
SYSTEM = "You are a terse assistant."
QUESTIONS = ["What is the moon made of?", "And the sun?", "Say it again, shorter.", "Thank you!"]
# A template that rewrites earlier turns: assistant replies before the last user message shrink to 4 characters
# (as reasoning templates drop <think> blocks); the rewrite is certain, not left to what the model says.
REWRITE = (
    (TEMPLATES / "chatml.jinja")
    .read_text()
    .replace(
        "{%- else %}\n        {{- '<|im_start|>' + message.role + '\\n' + message.content",
        "{%- elif message.role == 'assistant' and loop.index0 < turns | length - 1 %}\n"
        "        {{- '<|im_start|>assistant\\n' + message.content[:4] + '<|im_end|>\\n' }}\n"
        "    {%- else %}\n        {{- '<|im_start|>' + message.role + '\\n' + message.content",
    )
)


@pytest.fixture(scope="module", params=["fused", "standard"])
def graph_model(request, tmp_path_factory):
    out = make_chat_package(tmp_path_factory.mktemp("chat") / request.param, attention=request.param)
    return load(out, provider="cpu", threads=1)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load(make_chat_package(tmp_path_factory.mktemp("chat") / "fused"), provider="cpu", threads=1)


def template_source(name: str) -> str:
    return REWRITE if name == "rewrite" else (TEMPLATES / f"{name}.jinja").read_text()


# ---- the KV cache: extend and rewind ----------------------------------------------------------------


def test_extend_and_rewind_equal_a_prompt_of_the_whole(graph_model) -> None:
    model = graph_model
    ids = list(np.random.default_rng(0).integers(3, 2000, size=40))
    first, more = ids[:25], ids[25:]
    full = model.forward(np.array([ids]))[0][0]  # (T, V)

    cache = make_cache(model, [first], capacity=len(first))  # extend must grow the shared buffer
    assert np.abs(cache.prompt()[0] - full[len(first) - 1]).max() < TOLERANCE
    assert np.abs(cache.extend(more) - full[-1]).max() < TOLERANCE
    assert int(cache.lengths[0]) == len(ids)
    step = cache.next(np.array([[7]]))[0]
    assert np.abs(step - model.forward(np.array([[*ids, 7]]))[0][0, -1]).max() < TOLERANCE

    cache.rewind(10)  # forget the tail, and feed a different one
    other = [11, 12, 13, 14]
    assert np.abs(cache.extend(other) - model.forward(np.array([[*ids[:10], *other]]))[0][0, -1]).max() < TOLERANCE
    step = cache.next(np.array([[5]]))[0]
    assert np.abs(step - model.forward(np.array([[*ids[:10], *other, 5]]))[0][0, -1]).max() < TOLERANCE
    cache.rewind(0)
    assert np.abs(cache.extend(ids) - full[-1]).max() < TOLERANCE

    cache = make_cache(model, [first], capacity=len(first))  # decode steps past the capacity grow it too
    cache.prompt()
    for token in more:
        logits = cache.next(np.array([[token]]))[0]
    assert getattr(cache, "capacity", len(ids)) > len(first) and np.abs(logits - full[-1]).max() < TOLERANCE


# ---- every turn feeds the ids of the whole history --------------------------------------------------


def check_turns(model, conv: Conversation, questions: list[str], max_new_tokens: int = 12) -> list:
    """Send each question; check the prompt ids and the reply against a fresh generation from the full rendering."""
    replies = []
    for question in questions:
        before = conv.messages + [{"role": "user", "content": question}]
        reply = conv.send(question, max_new_tokens)
        head = 1 if before[0]["role"] == "system" else 0  # a full context dropped the oldest messages after it
        before = before[:head] + before[head + conv.last_turn.dropped_messages :]
        expected_ids = model.encode(conv.template.render(before, add_generation_prompt=True))
        assert reply.prompt_token_ids == expected_ids
        fresh = model.generate(expected_ids, max_new_tokens)
        assert reply.token_ids == fresh.token_ids, f"turn {len(replies) + 1}: the kept cache diverged"
        assert conv.messages == before + [{"role": "assistant", "content": reply.text}]
        turn = conv.last_turn
        assert turn.prompt_tokens == len(expected_ids) == turn.reused_tokens + turn.prefilled_tokens
        replies.append((reply, turn))
    return replies


@pytest.mark.parametrize("name", ["smollm2", "chatml", "llama3", "think", "rewrite"])
def test_turns_feed_the_ids_of_the_whole_history(model, name: str) -> None:
    conv = model.conversation(system=SYSTEM, template=template_source(name))
    replies = check_turns(model, conv, QUESTIONS)
    assert replies[0][1].path == "full" and replies[0][1].reused_tokens == 0
    for (previous, _), (_, turn) in zip(replies, replies[1:], strict=False):
        assert turn.path in ("prefix", "rewind")
        if name == "rewrite":  # the earlier reply is rendered shorter: the cache must rewind into it
            assert turn.path == "rewind" and turn.reused_tokens < len(previous.prompt_token_ids) + 4
        else:  # only the new turn's text (and any re-tokenized tail of the reply) is fed
            assert turn.reused_tokens >= len(previous.prompt_token_ids)
            assert turn.prefilled_tokens < turn.prompt_tokens // 2


def test_both_graphs_hold_a_conversation(graph_model) -> None:
    conv = graph_model.conversation(system=SYSTEM)
    replies = check_turns(graph_model, conv, QUESTIONS[:3], max_new_tokens=20)
    assert [turn.path for _, turn in replies][0] == "full"
    assert all(turn.reused_tokens > 0 for _, turn in replies[1:])


def test_model_chat_equals_a_conversation(model) -> None:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}]
    reply = model.chat(messages, max_new_tokens=10, temperature=0.9, seed=3)
    conv = model.conversation(system=SYSTEM)
    assert reply.token_ids == conv.send(QUESTIONS[0], 10, temperature=0.9, seed=3).token_ids
    template = ChatTemplate((TEMPLATES / "smollm2.jinja").read_text())
    assert reply.prompt_token_ids == model.encode(template.render(messages))
    assert messages[-1] == {"role": "user", "content": QUESTIONS[0]}, "the caller's list is not changed"


def test_any_eos_id_ends_a_turn(tmp_path_factory, model) -> None:
    reply = model.conversation().send(QUESTIONS[0], 12)
    assert reply.finish_reason == "length" and len(set(reply.token_ids)) > 3
    cut = next(i for i in range(2, 12) if reply.token_ids[i] not in reply.token_ids[:i])
    other = load(model.spec.folder, provider="cpu", threads=1)
    other.spec.tokens.eos_token_ids = [IM_END, reply.token_ids[cut]]  # a second end-of-turn id
    conv = other.conversation()
    short = conv.send(QUESTIONS[0], 12)
    assert short.finish_reason == "eos" and short.token_ids == reply.token_ids[:cut]
    check_turns(other, conv, QUESTIONS[1:3])  # the next turn renders <|im_end|> after it and feeds it


# ---- undo, reset, a full context, cancel ------------------------------------------------------------


def test_undo_and_reset(model) -> None:
    conv = model.conversation(system=SYSTEM)
    first = conv.send(QUESTIONS[0], 10)
    after_first = conv.messages
    second = conv.send(QUESTIONS[1], 10)
    reused_second = conv.last_turn.reused_tokens
    conv.undo()
    assert conv.messages == after_first
    again = conv.send(QUESTIONS[1], 10)
    assert again.token_ids == second.token_ids and conv.last_turn.reused_tokens == reused_second
    conv.undo()
    conv.undo()
    assert conv.messages == [{"role": "system", "content": SYSTEM}]
    with pytest.raises(InvalidInputError, match="no exchange"):
        conv.undo()
    conv.send(QUESTIONS[0], 10)
    conv.send(QUESTIONS[1], 10)
    conv.reset()
    assert conv.messages == [{"role": "system", "content": SYSTEM}]
    restarted = conv.send(QUESTIONS[0], 10)
    assert restarted.token_ids == first.token_ids
    assert conv.last_turn.path == "rewind" and conv.last_turn.reused_tokens > 5, "the system prompt stays cached"


def test_full_context_drops_the_oldest_turns_but_not_the_system(model) -> None:
    conv = model.conversation(system=SYSTEM)
    question = "Tell me about the kings of England, " * 2
    replies = check_turns(model, conv, [question] * 8, max_new_tokens=40)  # 256 tokens fill in about 3 turns
    dropped = [turn.dropped_messages for _, turn in replies]
    assert dropped[:2] == [0, 0] and sum(dropped) >= 4 and all(n % 2 == 0 for n in dropped)
    messages = conv.messages
    assert messages[0] == {"role": "system", "content": SYSTEM}
    assert len(messages) == 1 + 2 * (8 - sum(dropped) // 2)
    assert all(turn.prompt_tokens + 40 <= model.context_length for _, turn in replies)
    dropping = next(turn for _, turn in replies if turn.dropped_messages)
    assert dropping.path == "rewind" and dropping.reused_tokens > 5, "the system prompt is still reused"

    before = conv.messages
    with pytest.raises(ContextLengthError, match="context length 256"):
        conv.send("word " * 300, 40)
    with pytest.raises(ContextLengthError, match="below the context length"):
        conv.send("hi", 256)
    assert conv.messages == before
    with pytest.raises(ContextLengthError):  # model.chat drops nothing
        model.chat([{"role": "user", "content": question}] * 10, max_new_tokens=40)


def test_cancel_mid_stream_keeps_the_partial_reply(model) -> None:
    conv = model.conversation(system=SYSTEM)
    conv.send(QUESTIONS[0], 10)
    cancel = threading.Event()
    stream = conv.stream(QUESTIONS[1], 30, cancel=cancel)
    pieces = [next(stream) for _ in range(3)]
    cancel.set()
    pieces += list(stream)
    result = stream.result
    assert result.finish_reason == "cancelled" and 3 <= len(result.token_ids) < 30
    assert "".join(pieces) == result.text
    assert conv.messages[-1] == {"role": "assistant", "content": result.text}
    check_turns(model, conv, QUESTIONS[2:3])  # the next turn is consistent with the kept partial reply

    stream = conv.stream(QUESTIONS[3], 30)  # abandoned after one piece: the next call closes it
    next(stream)
    reply = conv.send(QUESTIONS[0], 12)
    assert reply.prompt_token_ids == model.encode(conv.template.render(conv.messages[:-1]))
    assert reply.token_ids == model.generate(reply.prompt_token_ids, 12).token_ids
    assert conv.messages[-3]["role"] == "assistant" and conv.messages[-4]["content"] == QUESTIONS[3]
    assert stream.result is not None and stream.result.finish_reason == "cancelled"
    conv.undo()
    conv.undo()  # the abandoned one goes like any other
    assert conv.messages[-2]["content"] == QUESTIONS[2]


# ---- errors leave the conversation unchanged ----------------------------------------------------------


def test_bad_input_raises_and_changes_nothing(model) -> None:
    conv = model.conversation(system=SYSTEM)
    conv.send(QUESTIONS[0], 8)
    before, turn = conv.messages, conv.last_turn
    for call, error in [
        (lambda: conv.send(42), InvalidInputError),
        (lambda: conv.send("hi", 8, temperature=-1), InvalidParameterError),
        (lambda: conv.send("hi", -1), InvalidParameterError),
        (lambda: conv.send("hi", 8, tempo=1), TypeError),
        (lambda: conv.send("\ud800"), InvalidInputError),
    ]:
        with pytest.raises(error):
            call()
        assert conv.messages == before and conv.last_turn is turn
    for messages, message in [
        ([{"role": "bot", "content": "x"}], "role 'bot'"),
        ([{"role": "user", "content": 3}], "not a string"),
        ([{"content": "x"}], "no 'role'"),
        ("hello", "must be a list"),
    ]:
        with pytest.raises(ChatTemplateError, match=message):
            model.chat(messages, max_new_tokens=4)
    check_turns(model, conv, QUESTIONS[1:2])


def test_a_package_without_a_template(model, tmp_path) -> None:
    out = make_chat_package(tmp_path / "plain", template="")
    plain = load(out, provider="cpu", threads=1)
    assert plain.info()["chat_template"] is False
    with pytest.raises(ChatTemplateError, match="no chat template"):
        plain.conversation()
    with pytest.raises(ChatTemplateError, match="no chat template"):
        plain.chat([{"role": "user", "content": "hi"}])
    source = template_source("smollm2")
    conv = plain.conversation(template=source)
    assert conv.send("hi", 6).token_ids == model.conversation().send("hi", 6).token_ids
    with pytest.raises(ChatTemplateError):
        plain.conversation(template="{% for %}")


# ---- threads --------------------------------------------------------------------------------------


def run_conversation(model, index: int) -> list:
    conv = model.conversation(system=f"You are assistant number {index}.")
    replies = [conv.send(f"{question} ({index})", 12, temperature=0.8, seed=index) for question in QUESTIONS[:3]]
    return [(reply.token_ids, reply.text) for reply in replies] + [conv.messages]


def test_eight_threads_each_with_its_own_conversation(model) -> None:
    alone = [run_conversation(model, index) for index in range(8)]
    results: list = [None] * 8
    errors: list = []

    def work(index: int) -> None:
        try:
            results[index] = run_conversation(model, index)
        except Exception as e:  # reported below: a thread's exception would otherwise vanish
            errors.append(e)

    threads = [threading.Thread(target=work, args=(index,)) for index in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    assert results == alone
