"""Hybrid models: LFM2 (short gated convolutions beside attention layers) and Qwen3.5 (Gated DeltaNet
beside gated attention) on both graphs against transformers, and their state as a cache kind
(runtime/statecache.py StateCache, SharedStateCache): prompts shorter than the convolution's kernel, a padded batch,
onnxruntime-genai, the manifest's layer record, snapshots and replayed rewinds, conversations with undo and a
re-rendering template, and prompt lookup decoding, each equal to a fresh run. tests/export/test_families.py holds the
families' transformers and onnxruntime-genai checks on the longer prompts."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from chat_package import make_chat_package
from family_cases import CASES, EOS, NEW_TOKENS, PROMPTS, QWEN35
from helpers import genai_greedy, hf_greedy, save_random_model
from test_chat import REWRITE

from edgelm.runtime import load
from edgelm.runtime.contract import Manifest
from edgelm.runtime.errors import PackageError
from edgelm.runtime.kvcache import kv_cache_bytes, make_cache
from edgelm.runtime.statecache import SharedStateCache, StateCache

TOLERANCE = 1e-4
# one token, two (shorter than the kernel of 3, so the state still holds its zeros), and eleven
EDGE_PROMPTS = [[7], [300, 12], PROMPTS[2]]
SYSTEM = "You are a terse assistant."
QUESTIONS = ["What is the moon made of?", "And the sun?", "Say it again, shorter."]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


GRAPHS = [(case, graph) for case in ("lfm2", "qwen3_5_text") for graph in ("fused", "standard")]


@pytest.fixture(scope="module", params=GRAPHS, ids=["-".join(g) for g in GRAPHS])
def hybrid(request, families):
    case, graph = request.param
    package = families.package(case, graph)
    return families.model(case)[0], package, load(package, provider="cpu")


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    out = tmp_path_factory.mktemp("hybrid") / "lfm2-chat"  # the fused graph: SharedStateCache
    return load(make_chat_package(out, family="lfm2", layers=4), provider="cpu", threads=1)


def test_short_prompts_alone_and_in_a_padded_batch_equal_transformers(hybrid):
    hf, package, model = hybrid
    expected = [hf_greedy(hf, prompt, NEW_TOKENS, pad_token_id=EOS) for prompt in EDGE_PROMPTS]
    for prompt, tokens in zip(EDGE_PROMPTS, expected, strict=True):
        with torch.no_grad():
            reference = hf(torch.tensor([prompt])).logits.numpy()
        assert np.abs(model.forward(np.array([prompt]))[0] - reference).max() < TOLERANCE
        assert model.generate(prompt, NEW_TOKENS, temperature=0, ignore_eos=True).token_ids == tokens
    batch = model.generate_batch(EDGE_PROMPTS, NEW_TOKENS, temperature=0, ignore_eos=True)
    # standard graph: left padding, zeroed inputs; fused: unequal prompts prefilled row by row
    assert [r.token_ids for r in batch] == expected
    assert genai_greedy(package, EDGE_PROMPTS[1], NEW_TOKENS) == expected[1]


def test_the_manifest_says_which_layer_holds_what(families):
    package = families.package("lfm2", "standard")
    arch = load(package, provider="cpu").spec.arch
    assert arch.states.layer_types == ["conv", "full_attention", "conv", "full_attention"]
    assert arch.states.conv_state == [64, 2] and arch.has_state  # (hidden, kernel - 1), as genai keeps it
    assert arch.states.recurrent_state is None
    decoder = json.loads((package / "genai_config.json").read_text())["model"]["decoder"]
    assert decoder["layer_types"] == arch.states.layer_types and decoder["conv_cache_size"] == 2
    assert decoder["inputs"]["past_conv_names"] == "past.%d.conv" and "past_recurrent_names" not in decoder["inputs"]
    qwen = load(families.package("qwen3_5_text", "standard"), provider="cpu")
    # conv over q, k and v (2 * 2 * 16 + 4 * 8 channels, kernel 4); the recurrent state value-major (4, 8, 16)
    assert qwen.spec.arch.states.conv_state == [96, 3] and qwen.spec.arch.states.recurrent_state == [4, 8, 16]
    assert qwen.spec.io.past_names(4, qwen.spec.arch.states.layer_types) == [
        "past.0.conv", "past.0.recurrent", "past_key_values.1.key", "past_key_values.1.value", "past.2.conv",
        "past.2.recurrent", "past_key_values.3.key", "past_key_values.3.value",
    ]  # fmt: skip
    data = json.loads((package / "edgelm.json").read_text())
    assert Manifest.parse(data).architecture.states.layer_types == arch.states.layer_types
    for bad in (["conv"] * 4, ["conv", "mamba", "conv", "full_attention"], ["conv"]):
        broken = json.loads(json.dumps(data))
        broken["architecture"]["layer_types"] = bad
        with pytest.raises(PackageError, match="layer_types"):
            Manifest.parse(broken)
    # the memory check counts the attention layers' KV and the fixed states: 2 layers x K, V (2 heads x 16) per
    # position, 2 conv states of 64 x 2
    assert kv_cache_bytes(load(package, provider="cpu").spec, batch=1, capacity=100) == 4 * (
        2 * 2 * 2 * 16 * 100 + 2 * 128
    )
    del data["architecture"]["conv_state"]
    with pytest.raises(PackageError, match="conv_state"):
        Manifest.parse(data)


def test_a_rotary_width_grouped_query_attention_cannot_take_rotates_before_it(tmp_path):
    # heads of 16, a quarter rotated: a table of width 2, not the multiple of 8 GroupQueryAttention takes
    from edgelm.export.onnx_export import export_package

    hf = save_random_model(tmp_path / "qwen", CASES["qwen3_5_text"].classes, QWEN35 | {"head_dim": 16})
    export_package(tmp_path / "qwen", tmp_path / "fused", progress=lambda _: None)
    model = load(tmp_path / "fused", provider="cpu")
    with torch.no_grad():
        reference = hf(torch.tensor([PROMPTS[2]])).logits.numpy()
    assert np.abs(model.forward(np.array([PROMPTS[2]]))[0] - reference).max() < TOLERANCE


def test_state_cache_snapshots_and_replayed_rewinds(hybrid):
    model = hybrid[2]
    ids = [int(i) for i in np.random.default_rng(0).integers(3, 2000, size=30)]
    whole = lambda tokens: model.forward(np.array([tokens]))[0][0, -1]  # noqa: E731
    cache = make_cache(model, [ids[:10]], capacity=12)  # the fused graph's buffers grow too
    assert isinstance(cache, (StateCache, SharedStateCache))
    cache.prompt()
    cache.extend(ids[10:20])
    assert np.abs(cache.extend(ids[20:]) - whole(ids)).max() < TOLERANCE
    assert [cache.rewind_point(n) for n in (30, 25, 20, 15, 9)] == [30, 20, 20, 10, 0]
    cache.rewind(15)  # between snapshots: the one at 10 and five ids fed again
    assert int(cache.lengths[0]) == 15
    assert np.abs(cache.extend([1, 2, 3]) - whole([*ids[:15], 1, 2, 3])).max() < TOLERANCE
    assert np.abs(cache.next(np.array([[5]]))[0] - whole([*ids[:15], 1, 2, 3, 5])).max() < TOLERANCE
    cache.rewind(0)
    assert np.abs(cache.extend(ids[:4]) - whole(ids[:4])).max() < TOLERANCE


def check_turns(model, conv, questions: list[str]) -> list:
    """Each reply equals a fresh generation from the whole history's rendering."""
    turns = []
    for question in questions:
        before = conv.messages + [{"role": "user", "content": question}]
        reply = conv.send(question, 12)
        expected_ids = model.encode(conv.template.render(before, add_generation_prompt=True))
        assert reply.prompt_token_ids == expected_ids
        assert reply.token_ids == model.generate(expected_ids, 12).token_ids, "the kept state diverged"
        turns.append((reply, conv.last_turn))
    return turns


def test_a_conversation_keeps_its_state_and_undo_equals_a_fresh_chat(chat):
    conv = chat.conversation(system=SYSTEM)
    turns = check_turns(chat, conv, QUESTIONS)
    assert [turn.path for _, turn in turns][0] == "full"
    for (reply, _), (_, turn) in zip(turns, turns[1:], strict=False):
        assert turn.reused_tokens >= len(reply.prompt_token_ids)
    conv.undo()
    again = conv.send(QUESTIONS[2], 40, speculative="lookup")  # rewinds past rejected guesses, replaying
    assert again.token_ids == chat.generate(again.prompt_token_ids, 40).token_ids
    assert again.timings.proposed_tokens > again.timings.accepted_tokens  # some guesses were rejected
    assert conv.last_turn.reused_tokens == turns[2][1].reused_tokens  # the turn's start was a snapshot
    conv.undo()  # the speculative steps' snapshots did not push the turns' out
    conv.send(QUESTIONS[2], 12)
    assert conv.last_turn.reused_tokens == turns[2][1].reused_tokens


def test_a_re_rendering_template_falls_back_to_a_prefix_snapshot(chat):
    conv = chat.conversation(system=SYSTEM, template=REWRITE)
    turns = check_turns(chat, conv, QUESTIONS)
    for (previous, _), (_, turn) in zip(turns, turns[1:], strict=False):
        # the earlier reply is rendered shorter: the state goes back to where that turn's prompt began
        assert turn.path == "rewind" and 0 < turn.reused_tokens <= len(previous.prompt_token_ids)


def test_prompt_lookup_gives_the_plain_greedy_ids(chat):
    proposed = accepted = 0
    for prompt in (PROMPTS[1] * 3, PROMPTS[2], [9]):  # 100 tokens: the random model falls into a loop lookup finds
        plain = chat.generate(prompt, 100, ignore_eos=True)
        fast = chat.generate(prompt, 100, ignore_eos=True, speculative="lookup")
        assert fast.token_ids == plain.token_ids
        proposed, accepted = proposed + fast.timings.proposed_tokens, accepted + fast.timings.accepted_tokens
    assert 0 < accepted < proposed, "both accepted and rejected guesses (a replayed rewind) are exercised"
