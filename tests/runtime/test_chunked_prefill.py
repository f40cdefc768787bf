"""Chunked prefill (runtime/kvdrivers.py PREFILL_CHUNK, here 8): a prompt or a turn longer than a chunk is fed in
runs of a chunk each. On a Llama and an LFM2 (hybrid) model, both graphs: the first logits equal one run's
(Model.forward, 1e-5) and greedy ids equal the one-run ids, for batch 1, a uniform batch of 2 and a padded batch,
prompt lengths a multiple of the chunk and not; a chat turn with a long message equals the one-run turn; and the
memory check counts one chunk's logits, so a 16k-token prompt on a 152k vocabulary is not refused."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from chat_package import make_chat_package

from edgelm.runtime import kvcache, kvdrivers, load
from edgelm.runtime.kvcache import check_generation_memory, make_cache

CHUNK = 8
ONE_RUN = 10**6
TOLERANCE = 1e-5
NEW = 12
LENGTHS = (24, 29)  # three chunks exactly; three and a piece of five
CASES = [(case, graph) for case in ("llama-llama3-tied", "lfm2") for graph in ("fused", "standard")]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", params=CASES, ids=["-".join(c) for c in CASES])
def model(request, families):
    return load(families.package(*request.param), provider="cpu", threads=1)


@pytest.fixture(scope="module", params=["llama", "lfm2"])
def chat(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("chunked") / f"{request.param}-chat"
    return load(make_chat_package(out, family=request.param, layers=2), provider="cpu", threads=1)


def ids_of(length: int, seed: int) -> list[int]:
    return [int(i) for i in np.random.default_rng(seed).integers(3, 2000, size=length)]


def counted_runs(monkeypatch, model) -> list[int]:
    runs = []
    run = model.run
    monkeypatch.setattr(model, "run", lambda binding: (runs.append(1), run(binding))[1])
    return runs


@pytest.mark.parametrize("length", LENGTHS)
def test_chunked_prompts_give_the_one_run_logits(model, monkeypatch, length):
    prompts = [ids_of(length, 0), ids_of(length, 1)]
    monkeypatch.setattr(kvdrivers, "PREFILL_CHUNK", CHUNK)
    runs = counted_runs(monkeypatch, model)
    for batch in ([prompts[0]], prompts):
        runs.clear()
        cache = make_cache(model, batch, capacity=length + NEW)
        logits = cache.prompt()
        rows = len(batch) if model.spec.io.kv_cache == "shared_buffer" else 1  # the fused graph: row by row
        assert len(runs) == -(-length // CHUNK) * rows, "the prompt was not fed a chunk per run"
        assert np.abs(logits - model.forward(np.array(batch))[0][:, -1]).max() < TOLERANCE
        assert int(cache.lengths[0]) == length
        # a decode step after the chunks sees the whole prompt
        step = cache.next(np.array([[5]] * len(batch)))
        whole = model.forward(np.array([[*p, 5] for p in batch]))[0][:, -1]
        assert np.abs(step - whole).max() < TOLERANCE


@pytest.mark.parametrize("length", LENGTHS)
def test_chunked_prompts_give_the_one_run_greedy_ids(model, monkeypatch, length):
    uniform = [ids_of(length, 2), ids_of(length, 3)]
    padded = [ids_of(length, 4), ids_of(13, 5)]  # the fused graph: row by row

    def greedy() -> list:
        one = model.generate(uniform[0], NEW, temperature=0, ignore_eos=True).token_ids
        batches = [model.generate_batch(p, NEW, temperature=0, ignore_eos=True) for p in (uniform, padded)]
        return [one, *([r.token_ids for r in batch] for batch in batches)]

    monkeypatch.setattr(kvdrivers, "PREFILL_CHUNK", ONE_RUN)
    expected = greedy()
    monkeypatch.setattr(kvdrivers, "PREFILL_CHUNK", CHUNK)
    assert greedy() == expected


def test_a_long_extend_is_chunked_and_equals_one_run(model, monkeypatch):
    ids = ids_of(40, 6)
    monkeypatch.setattr(kvdrivers, "PREFILL_CHUNK", CHUNK)
    runs = counted_runs(monkeypatch, model)
    cache = make_cache(model, [ids[:5]], capacity=12)  # the fused graph's buffers grow between chunks
    cache.prompt()
    runs.clear()
    logits = cache.extend(ids[5:])
    assert len(runs) == 5
    assert np.abs(logits - model.forward(np.array([ids]))[0][0, -1]).max() < TOLERANCE
    cache.rewind(cache.rewind_point(5))  # a hybrid's snapshots: at the turn's start and end, not per chunk
    assert int(cache.lengths[0]) == 5
    assert np.abs(cache.extend(ids[5:16]) - model.forward(np.array([ids[:16]]))[0][0, -1]).max() < TOLERANCE


def test_a_chat_turn_with_a_long_message_equals_one_run(chat, monkeypatch):
    document = " ".join(["The quality of mercy is not strained; it droppeth as the gentle rain from heaven."] * 4)
    questions = ["Hello there.", f"Summarize this: {document}"]

    def conversation() -> list:
        conv = chat.conversation(system="You are terse.")
        replies = [conv.send(question, NEW).token_ids for question in questions]
        assert conv.last_turn.path != "full" and conv.last_turn.prefilled_tokens > 4 * CHUNK
        return replies

    monkeypatch.setattr(kvdrivers, "PREFILL_CHUNK", ONE_RUN)
    expected = conversation()
    monkeypatch.setattr(kvdrivers, "PREFILL_CHUNK", CHUNK)
    assert conversation() == expected


def test_the_memory_check_counts_one_chunk_of_logits(model, monkeypatch):
    """A 16k-token prompt on Qwen3's vocabulary: one run's logits would be 9.3 GiB, a chunk's 0.3 GiB."""
    arch = dataclasses.replace(model.spec.arch, vocab_size=151936, context_length=32768)
    spec = dataclasses.replace(model.spec, arch=arch)
    monkeypatch.setattr(kvcache, "available_memory_bytes", lambda: 4 << 30)
    check_generation_memory(spec, [16384], new_tokens=256)
    check_generation_memory(spec, [16384, 16384], new_tokens=256)
    with pytest.raises(MemoryError, match="batch size"):
        check_generation_memory(spec, [16384] * 16, new_tokens=256)  # 16 rows of a chunk: still too much
