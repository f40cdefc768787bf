"""What constrained decoding costs (runtime/constraints.py): compiling a schema, and the token mask per token.

For a package (SmolLM2-135M-Instruct, 49,152 tokens) it generates a JSON-schema answer to a chat question, then
replays the answer's tokens through a fresh matcher and times each step's mask (llguidance's mask, numpy's
unpack and -inf fill over the vocabulary, the matcher taking the token) against the package's plain decode step
(greedy, no constraint, same prompt). For a tokenizer alone (--tokenizer, e.g. Qwen2's 151,936 tokens from
llama.cpp's ggml-vocab-qwen2.gguf through transformers) it replays the same JSON text, tokenized by that
tokenizer, through a matcher over that vocabulary.

    .venv/bin/python benchmarks/structured.py --package /path/to/smollm2-fp32 \\
        --tokenizer-gguf /path/to/ggml-vocab-qwen2.gguf --out benchmarks/results/structured.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "country": {"type": "string", "maxLength": 40},
        "population_millions": {"type": "number"},
        "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 3},
        "capital": {"type": "boolean"},
    },
    "required": ["city", "country", "population_millions", "landmarks", "capital"],
    "additionalProperties": False,
}
QUESTION = "Describe Paris as JSON: its country, population in millions, three landmarks, whether it is a capital."
# a larger schema for the compile time: 40 properties of mixed kinds
BIG = {
    "type": "object",
    "properties": {
        f"field_{i}": [
            {"type": "string", "pattern": "[a-z]{3,9}"},
            {"type": "integer", "minimum": 0, "maximum": 10**6},
            {"enum": ["a", "b", "c"]},
            {"type": "array", "items": {"type": "number"}},
        ][i % 4]
        for i in range(40)
    },
    "required": [f"field_{i}" for i in range(0, 40, 2)],
}


def replay(runner, constraint, tokens: list[int]) -> list[float]:
    """Seconds per step to mask each position of tokens as decoding does (GrammarMask given the ids so far)."""
    from edgelm.runtime.constraints import GrammarMask

    mask = GrammarMask(runner, constraint)
    logits = np.random.default_rng(0).standard_normal(runner.spec.arch.vocab_size).astype(np.float32)
    times = []
    for position, token in enumerate(tokens):
        started = time.perf_counter()
        masked = mask(0, tokens[:position], logits)
        times.append(time.perf_counter() - started)
        assert np.isfinite(masked[token]), "the replayed token must be allowed"
    return times


def compile_times(runner) -> dict:
    from edgelm.runtime.constraints import GrammarMask, constraint_from

    out = {}
    logits = np.zeros(runner.spec.arch.vocab_size, dtype=np.float32)
    for name, schema in (("answer schema", SCHEMA), ("40-property schema", BIG)):
        started = time.perf_counter()
        constraint = constraint_from(response_format={"type": "json_schema", "json_schema": {"schema": schema}})
        compiled = time.perf_counter()
        GrammarMask(runner, constraint)(0, [], logits)  # the matcher and its first mask (the lexer's first states)
        ready = time.perf_counter()
        out[name] = {"compile_ms": 1000 * (compiled - started), "first_mask_ms": 1000 * (ready - compiled)}
    return out


class TokenizerOnly:
    """What GrammarMask reads of a runner, for a tokenizer without a model."""

    def __init__(self, tokenizer, vocab: int, eos: int):
        from types import SimpleNamespace

        self.tokenizer = tokenizer
        self.spec = SimpleNamespace(arch=SimpleNamespace(vocab_size=vocab), tokens=SimpleNamespace(eos_token_ids=[eos]))


def summary(times: list[float]) -> dict:
    ms = [1000 * t for t in times]
    return {"tokens": len(ms), "median_ms": statistics.median(ms), "mean_ms": statistics.fmean(ms), "max_ms": max(ms)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--package", required=True)
    parser.add_argument("--tokenizer-gguf", default=None, help="a vocabulary-only GGUF with a larger vocabulary")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    from edgelm.runtime import load
    from edgelm.runtime.constraints import _ll_tokenizer, constraint_from
    from edgelm.runtime.text import Tokenizer

    model = load(args.package, provider="cpu", threads=args.threads)
    vocab, eos = model.vocab_size, tuple(model.spec.tokens.eos_token_ids)
    started = time.perf_counter()
    _ll_tokenizer(model.tokenizer, vocab, eos)  # built once per tokenizer, cached
    tokenizer_s = time.perf_counter() - started
    messages = [{"role": "user", "content": QUESTION}]
    response_format = {"type": "json_schema", "json_schema": {"schema": SCHEMA}}
    answer = model.chat(messages, 160, response_format=response_format)
    plain = model.generate(answer.prompt_token_ids, 128, ignore_eos=True)  # the same prompt, unconstrained
    step_ms = 1000 / plain.timings.decode_tokens_per_s
    constrained_step_ms = 1000 / answer.timings.decode_tokens_per_s
    constraint = constraint_from(response_format=response_format)
    mask = summary(replay(model, constraint, answer.token_ids))
    report = {
        "cpu": platform.processor() or platform.machine(),
        "threads": args.threads,
        "package": Path(args.package).name,
        "answer": answer.text,
        "answer_finish": answer.finish_reason,
        "vocab": vocab,
        "tokenizer_build_s": tokenizer_s,
        "plain_decode_step_ms": step_ms,
        "constrained_decode_step_ms": constrained_step_ms,
        "mask_per_token": mask,
        "mask_share_of_plain_step": mask["mean_ms"] / step_ms,
        "compile": compile_times(model),
    }
    if args.tokenizer_gguf:
        import transformers

        gguf = Path(args.tokenizer_gguf)
        big = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        saved = Path(args.out or "structured.json").with_suffix(".tokenizer.json")
        saved.write_text(big.backend_tokenizer.to_str())
        runner = TokenizerOnly(Tokenizer(saved), len(big), big.eos_token_id)
        saved.unlink()
        started = time.perf_counter()
        _ll_tokenizer(runner.tokenizer, len(big), (big.eos_token_id,))
        big_build = time.perf_counter() - started
        tokens = big(answer.text, add_special_tokens=False)["input_ids"]
        report["large_vocabulary"] = {
            "tokenizer": gguf.name,
            "vocab": len(big),
            "tokenizer_build_s": big_build,
            "mask_per_token": summary(replay(runner, constraint, tokens)),
            "compile": compile_times(runner),
        }
    text = json.dumps(report, indent=2, ensure_ascii=False)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
