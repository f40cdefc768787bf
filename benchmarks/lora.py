"""LoRA slots and adapters on a real model: decode speed, switching cost and accuracy.

    python benchmarks/lora.py make-adapter OUT_DIR            # a random rank-16 PEFT adapter for SmolLM2-135M
    python benchmarks/lora.py speed --package plain=out/smol --package slots=out/smol-slots \
        --adapter out/smol-slots:lora.onnx_adapter --rounds 6
    python benchmarks/lora.py switch out/smol-slots lora.onnx_adapter
    python benchmarks/lora.py accuracy --text data/shakespeare-heldout.txt --reference out/smol-merged \
        out/smol-slots-int4:lora.onnx_adapter

speed: each variant's decode tokens/s (greedy, 32-token prompt, 128 new tokens, the best of --best-of runs),
variants alternating within a round (the order reversed every other round) so a shared machine's drift falls on
all of them; reports the median per-round ratio to the first variant (benchmarks/ab.py, the models loaded once in
this process and taking turns).
switch: what changing adapter costs a request: making its runner and binding the adapter's tensors into a new
binding (median over repeats), against the same step with the base. accuracy: top-1 agreement and mean KL of
a package + adapter against a reference package (the fp32 merged model) over a text's tokens.
The adapter: SmolLM2-135M's q/k/v/o/gate/up/down at rank 16, A and B random (B drawn small, N(0, 0.02), so
the adapted model still writes text), made by the peft library on a random model of SmolLM2's shape.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import ab
import numpy as np

SMOLLM2 = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)  # fmt: skip
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(out: Path, *, rank: int, seed: int) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file, save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**SMOLLM2))
    config = LoraConfig(r=rank, lora_alpha=rank, target_modules=TARGETS, init_lora_weights=False)
    get_peft_model(model, config).save_pretrained(out)
    weights = out / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    for name in tensors:
        if ".lora_B." in name:
            tensors[name] = torch.randn(tensors[name].shape) * 0.02
    save_file(tensors, str(weights))
    print(f"wrote {out}: rank {rank} on {', '.join(TARGETS)}")


def _load(path: str, threads: int, adapter: str | None):
    from edgelm.runtime import load

    model = load(path, provider="cpu", threads=threads)
    name = model.load_adapter(adapter) if adapter else None
    return model, name


def speed(args: argparse.Namespace) -> None:
    variants = []  # (label, model, adapter name)
    for spec in args.package:
        label, path = spec.split("=", 1)
        package, _, adapter = path.partition(":")
        model, name = _load(package, args.threads, adapter or None)
        variants.append((label, model, name))
    prompt = list(range(100, 100 + args.prompt_tokens))
    for _, model, name in variants:
        model.generate(prompt, 8, ignore_eos=True, adapter=name)  # warm-up

    def best_rate(model, name: str | None) -> float:
        """The best of a few runs: what other processes took is not the model's."""
        runs = [model.generate(prompt, args.new_tokens, ignore_eos=True, adapter=name) for _ in range(args.best_of)]
        return max(run.timings.decode_tokens_per_s for run in runs)

    turns = [ab.here(label, best_rate, model, name) for label, model, name in variants]
    result = ab.run(turns, rounds=args.rounds, order="reverse")  # the order reversed every other round
    first = result["baseline"]
    for label, medians in result["medians"].items():
        ratio = result["ratios"][label]["value"]
        print(f"{label}: median {medians['value']:.1f} tokens/s, per-round ratio to {first} median "
              f"{ratio['median']:.3f} (min {ratio['min']:.3f}, max {ratio['max']:.3f})")  # fmt: skip


def switch(args: argparse.Namespace) -> None:
    from edgelm.runtime.kvcache import make_cache

    model, name = _load(args.package, args.threads, args.adapter)
    prompt = list(range(100, 132))
    timings: dict[str, list[float]] = {"base": [], "adapter": []}
    for _ in range(args.repeats):
        for label, adapter in (("base", None), ("adapter", name)):
            cache = make_cache(model, [prompt], capacity=64)  # a request's cache: its own binding
            started = time.perf_counter()
            runner = model.runner(adapter)
            if adapter is not None:
                for key, value in runner.adapter.values.items():  # what AdapterRunner.run does once per binding
                    cache.binding.bind_ortvalue_input(key, value)
            timings[label].append(time.perf_counter() - started)
    tensors = len(model.runner(name).adapter.values)
    for label, values in timings.items():
        print(f"{label}: runner + binding {1e6 * statistics.median(values):.0f} us (median of {args.repeats})")
    print(f"adapter tensors bound per switch: {tensors}")


def _tokens(path: str, model) -> np.ndarray:
    return np.array(model.tokenizer.encode(Path(path).read_text(encoding="utf-8")), dtype=np.int64)


def accuracy(args: argparse.Namespace) -> None:
    reference, _ = _load(args.reference, args.threads, None)
    ids = _tokens(args.text, reference)[: args.tokens]
    for spec in args.package:
        package, _, adapter = spec.partition(":")
        model, name = _load(package, args.threads, adapter or None)
        agree, kl, count = 0, 0.0, 0
        for start in range(0, len(ids) - 1, args.chunk):
            chunk = ids[None, start : start + args.chunk]
            p = reference.forward(chunk)[0][0].astype(np.float64)
            q = model.forward(chunk, adapter=name)[0][0].astype(np.float64)
            p, q = p - p.max(-1, keepdims=True), q - q.max(-1, keepdims=True)
            logp = p - np.log(np.exp(p).sum(-1, keepdims=True))
            logq = q - np.log(np.exp(q).sum(-1, keepdims=True))
            kl += float((np.exp(logp) * (logp - logq)).sum())
            agree += int((p.argmax(-1) == q.argmax(-1)).sum())
            count += chunk.shape[1]
        print(f"{spec}: top-1 agreement {100 * agree / count:.2f}%, mean KL {kl / count:.5f} nats over {count} tokens")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("make-adapter")
    m.add_argument("out", type=Path)
    m.add_argument("--rank", type=int, default=16)
    m.add_argument("--seed", type=int, default=0)
    s = sub.add_parser("speed")
    s.add_argument("--package", action="append", required=True, help="LABEL=PACKAGE[:ADAPTER_FILE]")
    s.add_argument("--rounds", type=int, default=6)
    s.add_argument("--prompt-tokens", type=int, default=32)
    s.add_argument("--new-tokens", type=int, default=128)
    s.add_argument("--best-of", type=int, default=3, help="generations per variant and round; the fastest counts")
    w = sub.add_parser("switch")
    w.add_argument("package")
    w.add_argument("adapter")
    w.add_argument("--repeats", type=int, default=200)
    a = sub.add_parser("accuracy")
    a.add_argument("package", nargs="+", help="PACKAGE[:ADAPTER_FILE]")
    a.add_argument("--reference", required=True)
    a.add_argument("--text", required=True)
    a.add_argument("--tokens", type=int, default=2048)
    a.add_argument("--chunk", type=int, default=256)
    for parser in (s, w, a):
        parser.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    if args.command == "make-adapter":
        make_adapter(args.out, rank=args.rank, seed=args.seed)
    else:
        {"speed": speed, "switch": switch, "accuracy": accuracy}[args.command](args)


if __name__ == "__main__":
    main()
