"""One greedy chat question, fed four ways: fresh, after reset(), as row 0 of a padded batch of 4, and with
speculative="lookup"; prints whether each gives the fresh answer and any warning (issue 38).

    python benchmarks/experiments/same_answer.py PACKAGE [PACKAGE ...]
"""

from __future__ import annotations

import sys
import warnings

from edgelm.runtime import load

QUESTION = "What is the capital of France?"
OTHERS = ["Name three colours.", "What is 2 + 2?", "Say hello in French."]


def check(path: str) -> None:
    model = load(path, threads=2)
    conv = model.conversation()
    fresh = conv.send(QUESTION, max_new_tokens=24).token_ids
    conv.reset()
    again = conv.send(QUESTION, max_new_tokens=24).token_ids
    prompts = [conv.ids_of([{"role": "user", "content": question}]) for question in [QUESTION, *OTHERS]]
    batch = model.generate_batch(prompts, max_new_tokens=24)[0].token_ids
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lookup = model.chat([{"role": "user", "content": QUESTION}], max_new_tokens=24, speculative="lookup").token_ids
    print(f"{path}: {model.tokenizer.decode(fresh)[:60]!r}")
    print(f"  after reset: {again == fresh}, batch of 4: {batch == fresh}, lookup: {lookup == fresh}")
    for warning in caught:
        print(f"  warning: {warning.message}")


if __name__ == "__main__":
    for package in sys.argv[1:]:
        check(package)
