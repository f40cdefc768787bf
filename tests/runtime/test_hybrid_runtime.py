"""The runtime around a hybrid model's state (LFM2, Qwen3.5), each graph: eight threads on one loaded model each get
what their request gets alone (greedy, sampled, streamed, speculative, a padded batch, a conversation); conversations
after undo and reset and with a template that re-renders history equal fresh generations; a standard graph exported
with --last-token-logits gives the last position's logits and the same tokens (speculative decoding plain, with a
warning). tests/export/test_hybrid.py holds transformers' parity and LFM2's fused conversation."""

from __future__ import annotations

import threading
import warnings
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from chat_package import make_chat_package
from family_cases import PROMPTS
from helpers import quiet
from test_chat import REWRITE
from test_hybrid import QUESTIONS, SYSTEM, check_turns

from edgelm.export.onnx_export import export_package
from edgelm.runtime import load

TARGETS = [(family, graph) for family in ("lfm2", "qwen3_5_text") for graph in ("fused", "standard")]
JOBS = [
    ("greedy", PROMPTS[0], {}),
    ("sampled", PROMPTS[1], dict(temperature=1.0, seed=1)),
    ("top-k", [9], dict(temperature=0.8, top_k=20, seed=2)),
    ("stream", PROMPTS[2], dict(stream=True)),
    ("lookup", [300, 12, 2001, 5] * 3, dict(speculative="lookup")),
    ("penalty", PROMPTS[2][:5], dict(repetition_penalty=1.5)),
    ("batch", [PROMPTS[0], [7, 8]], dict(batch=True)),
    ("chat", "What is the moon made of?", dict(chat=True)),
]


@pytest.fixture(scope="module", params=TARGETS, ids=["-".join(t) for t in TARGETS])
def chat_model(request, tmp_path_factory):
    family, graph = request.param
    out = make_chat_package(tmp_path_factory.mktemp(f"hybrid-{family}") / graph, family=family, attention=graph,
                            layers=4)  # fmt: skip
    return load(out, provider="cpu", threads=1)


def run_job(model, prompt, options) -> list:
    options = dict(options)
    if options.pop("stream", False):
        stream = model.stream(prompt, 16, ignore_eos=True, **options)
        assert "".join(stream) == stream.result.text
        return stream.result.token_ids
    if options.pop("batch", False):
        return [r.token_ids for r in model.generate_batch(prompt, 16, ignore_eos=True)]
    if options.pop("chat", False):
        conv = model.conversation(system=SYSTEM)
        return [conv.send(prompt, 8).token_ids, conv.send("And the sun?", 8).token_ids]
    return model.generate(prompt, 16, ignore_eos=True, **options).token_ids


def test_eight_threads_on_one_model_match_each_request_alone(chat_model):
    alone = [run_job(chat_model, prompt, options) for _, prompt, options in JOBS]
    assert len({str(ids) for ids in alone}) == len(JOBS), "the requests must give distinguishable outputs"
    start = threading.Barrier(len(JOBS))

    def worker(job):
        start.wait()  # all eight at once, each repeated so that their steps interleave
        return [run_job(chat_model, job[1], job[2]) for _ in range(3)]

    with ThreadPoolExecutor(len(JOBS)) as pool:
        together = list(pool.map(worker, JOBS))
    for (name, _, _), expected, repeats in zip(JOBS, alone, together, strict=True):
        assert repeats == [expected] * 3, f"cross-talk in the {name} request"


def test_conversations_after_undo_and_reset_and_a_re_rendering_template_equal_fresh_chats(chat_model):
    conv = chat_model.conversation(system=SYSTEM)
    first = check_turns(chat_model, conv, QUESTIONS)
    conv.undo()
    conv.undo()
    again = check_turns(chat_model, conv, QUESTIONS[1:])  # from the first turn's kept state
    assert [reply.token_ids for reply, _ in again] == [reply.token_ids for reply, _ in first[1:]]
    assert again[0][1].reused_tokens >= len(first[0][0].prompt_token_ids)
    conv.reset()
    assert [reply.token_ids for reply, _ in check_turns(chat_model, conv, QUESTIONS[:1])] == [first[0][0].token_ids]
    rewritten = chat_model.conversation(system=SYSTEM, template=REWRITE)
    turns = check_turns(chat_model, rewritten, QUESTIONS)
    for (previous, _), (_, turn) in zip(turns, turns[1:], strict=False):
        # the earlier reply is rendered shorter: the state goes back to a snapshot that is still a prefix
        assert turn.path == "rewind" and 0 < turn.reused_tokens <= len(previous.prompt_token_ids)


@pytest.mark.parametrize("case", ["lfm2", "qwen3_5_text"])
def test_last_token_logits_on_the_standard_graph(families, tmp_path, case):
    folder = families.model(case)[1]
    export_package(folder, tmp_path / "last", attention="standard", last_token_logits=True, progress=quiet)
    last = load(tmp_path / "last", provider="cpu", threads=1)
    full = load(families.package(case, "standard"), provider="cpu", threads=1)
    batch = np.array([PROMPTS[0][:6], PROMPTS[2][:6]])
    logits, _ = last.forward(batch)
    assert logits.shape == (2, 1, last.vocab_size)
    assert np.abs(logits[:, 0] - full.forward(batch)[0][:, -1]).max() < 1e-5
    for prompt in PROMPTS:
        expected = full.generate(prompt, 12, ignore_eos=True).token_ids
        assert last.generate(prompt, 12, ignore_eos=True).token_ids == expected
    padded = last.generate_batch(PROMPTS, 12, ignore_eos=True)  # left padding: every row's last position is last
    assert [r.token_ids for r in padded] == [r.token_ids for r in full.generate_batch(PROMPTS, 12, ignore_eos=True)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fast = last.generate(PROMPTS[0], 12, ignore_eos=True, speculative="lookup")
    assert any("last position's logits only" in str(w.message) for w in caught)
    assert fast.token_ids == full.generate(PROMPTS[0], 12, ignore_eos=True).token_ids
