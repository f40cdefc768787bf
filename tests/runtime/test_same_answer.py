"""The same greedy answer however the prompt was fed (issue 38): asked again after reset() or undo(), a question
gets the logits, and so the answer, of a fresh conversation, also on an int4 package whose MatMulNBits kernels
(accuracy level 4) compute a step of one row differently from a step of several."""

from __future__ import annotations

import numpy as np
import pytest
from chat_package import make_chat_package

QUESTIONS = ["Romeo speaks of love.", "Juliet speaks of the night.", "The Nurse speaks of Verona."]


@pytest.fixture(scope="module")
def int4_chat(tmp_path_factory):
    from edgelm.quantize.quantize import quantize_package
    from edgelm.runtime import load

    root = tmp_path_factory.mktemp("same-answer")
    fp32 = make_chat_package(root / "fp32", layers=2, seed=3)
    quantize_package(fp32, root / "int4", mode="int4", evaluate=False)
    return load(root / "int4", threads=1)


def first_logits(conv, question: str) -> tuple[np.ndarray, list[int]]:
    """The logits that chose the reply's first token (seen through the token_mask hook, which changes nothing)."""
    seen = []

    def watch(row, ids, logits):
        if not ids:
            seen.append(np.array(logits, copy=True))
        return logits

    result = conv.send(question, max_new_tokens=4, token_mask=watch)
    return seen[0], result.token_ids


def test_a_question_asked_again_after_reset_or_undo_gets_the_fresh_logits(int4_chat):
    for question in QUESTIONS:
        fresh, fresh_ids = first_logits(int4_chat.conversation(system="Be brief."), question)
        conv = int4_chat.conversation(system="Be brief.")
        conv.send(question, max_new_tokens=4)
        conv.reset()
        again, again_ids = first_logits(conv, question)
        assert conv.last_turn.prefilled_tokens == 2, "the last id is fed beside another, as a fresh prefill feeds it"
        np.testing.assert_array_equal(again, fresh)
        assert again_ids == fresh_ids
        conv.undo()
        undone, undone_ids = first_logits(conv, question)
        np.testing.assert_array_equal(undone, fresh)
        assert undone_ids == fresh_ids
