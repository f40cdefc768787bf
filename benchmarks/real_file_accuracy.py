"""edgelm against llama.cpp on the same real GGUF file: NLL on held-out text (the same token ids fed to both),
greedy ids on several prompts (the first difference, with edgelm's top-2 gap there to tell a near tie), and a
greedy chat answer. llama.cpp computes with int8 activations too, so its figures are the file's own.

llama.cpp runs in a child with llama-cpp-python's interpreter (benchmarks/peers/setup_llamacpp.sh makes
.venv-llamacpp); edgelm exports each file once into a temporary package (or uses --package).

    python benchmarks/real_file_accuracy.py --out benchmarks/results/real_file_accuracy.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village,",
    "The three primary colours are",
    "import numpy as np\n\nx = np.",
    "Water boils at a temperature of",
]
GREEDY_TOKENS = 24
QUESTION = "What is the capital of France?"


def child(request: dict) -> dict:
    """Runs under llama-cpp-python: NLL of `ids`, greedy continuations, and a chat answer."""
    import llama_cpp

    llm = llama_cpp.Llama(
        model_path=request["file"], n_ctx=request["n_ctx"], n_threads=2, logits_all=True, verbose=False, seed=0
    )
    ids = request["ids"]
    llm.reset()
    llm.eval(ids)
    logits = np.asarray(llm.scores[: len(ids)], dtype=np.float64)  # (T, V): the logits after each token
    shifted = logits - logits.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    nll = float(-np.mean(log_probs[np.arange(len(ids) - 1), ids[1:]]))
    greedy = []
    for prompt in request["prompts"]:
        llm.reset()
        out, tokens = [], list(prompt)
        llm.eval(tokens)
        for _ in range(request["greedy_tokens"]):
            token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            out.append(token)
            llm.eval([token])
        greedy.append(out)
    chat = None
    if request.get("chat"):
        llm.reset()
        reply = llm.create_chat_completion(
            messages=[{"role": "user", "content": QUESTION}], temperature=0.0, max_tokens=32, seed=0
        )
        chat = reply["choices"][0]["message"]["content"]
    tokenized = [llm.tokenize(text.encode(), add_bos=True, special=False) for text in request["texts"]]
    return {"nll": nll, "greedy": greedy, "chat": chat, "tokenized": tokenized, "version": llama_cpp.__version__}


def _nll(model, ids: list[int]) -> float:
    logits, _ = model.forward(np.array([ids], dtype=np.int64))
    logits = logits[0].astype(np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    return float(-np.mean(log_probs[np.arange(len(ids) - 1), ids[1:]]))


def _first_difference(model, prompt: list[int], ours: list[int], theirs: list[int]) -> dict | None:
    """Where two greedy runs part, and edgelm's gap between its top two logits there (a near tie is small)."""
    for index, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        if a != b:
            logits, _ = model.forward(np.array([prompt + ours[:index]], dtype=np.int64))
            last = np.sort(logits[0, -1])[::-1]
            return {"at": index, "edgelm": a, "llama.cpp": b, "top2_gap": float(last[0] - last[1])}
    return None


def compare(name: str, file: Path, package: Path, python: Path, *, tokens: int, chat: bool) -> dict:
    from edgelm.runtime import load

    model = load(package, threads=2)
    text = (REPO / "data" / "shakespeare-heldout.txt").read_text(encoding="utf-8")
    ids = model.tokenizer.encode(text, add_special_tokens=True)[:tokens]  # BOS where the file adds it
    prompts = [model.tokenizer.encode(p, add_special_tokens=True) for p in PROMPTS]
    request = {
        "file": str(file), "n_ctx": max(tokens, 512) + 64, "ids": ids, "prompts": prompts,
        "greedy_tokens": GREEDY_TOKENS, "chat": chat, "texts": [text[:2000], *PROMPTS],
    }  # fmt: skip
    result = subprocess.run(
        [str(python), __file__, "--child"], input=json.dumps(request), capture_output=True, text=True, check=True
    )
    theirs = json.loads(result.stdout.strip().splitlines()[-1])
    ours_greedy = [model.generate(p, max_new_tokens=GREEDY_TOKENS, ignore_eos=True).token_ids for p in prompts]
    row = {
        "file": file.name,
        "tokens": len(ids),
        "nll_edgelm": _nll(model, ids),
        "nll_llamacpp": theirs["nll"],
        "same_ids_as_llamacpp": [
            model.tokenizer.encode(t, add_special_tokens=True) == got
            for t, got in zip(request["texts"], theirs["tokenized"], strict=True)
        ],
        "greedy": [
            {
                "prompt": p,
                "equal_tokens": next((i for i, (a, b) in enumerate(zip(o, t, strict=True)) if a != b), len(o)),
                "first_difference": _first_difference(model, ids_, o, t),
                "edgelm": model.tokenizer.decode(o),
                "llama.cpp": model.tokenizer.decode(t),
                "prompt_ids": ids_,
                "llamacpp_ids": t,
            }
            for p, ids_, o, t in zip(PROMPTS, prompts, ours_greedy, theirs["greedy"], strict=True)
        ],
        "llama_cpp_python": theirs["version"],
    }
    row["nll_ratio"] = row["nll_edgelm"] / row["nll_llamacpp"]
    if chat:
        reply = model.chat([{"role": "user", "content": QUESTION}], max_new_tokens=32, temperature=0.0)
        row["chat"] = {"edgelm": reply.content, "llama.cpp": theirs["chat"]}
    print(f"{name}: NLL edgelm {row['nll_edgelm']:.4f} llama.cpp {row['nll_llamacpp']:.4f} "
          f"(x{row['nll_ratio']:.4f}); greedy equal tokens {[g['equal_tokens'] for g in row['greedy']]}")  # fmt: skip
    return row


def main() -> None:
    if "--child" in sys.argv:
        print(json.dumps(child(json.loads(sys.stdin.read()))))
        return
    sys.path.insert(0, str(REPO / "scripts"))
    from fetch_real_models import fetch

    from edgelm.export.onnx_export import export_package

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llamacpp-python", type=Path, default=REPO / ".venv-llamacpp" / "bin" / "python")
    parser.add_argument("--tokens", type=int, default=512, help="held-out tokens scored (default 512)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--record",
        type=Path,
        default=None,
        help="also write llama.cpp's greedy ids for the tests (tests/data/real_files_llamacpp.json)",
    )
    args = parser.parse_args()
    table = {}
    with tempfile.TemporaryDirectory(prefix="edgelm-accuracy-") as tmp:
        for name, chat in (("smollm2", True), ("gemma3", False)):
            file = fetch(name)
            package = Path(tmp) / name
            export_package(file, package, progress=lambda _: None)
            table[name] = compare(name, file, package, args.llamacpp_python, tokens=args.tokens, chat=chat)
    if args.out:
        args.out.write_text(json.dumps(table, indent=1, ensure_ascii=False) + "\n")
    if args.record:
        record = {
            "about": "llama.cpp's greedy ids on each real file (tests/real/test_real_files.py), made by "
            "`python benchmarks/real_file_accuracy.py --record tests/data/real_files_llamacpp.json` with "
            f"llama-cpp-python {table['smollm2']['llama_cpp_python']}; `agreed`: how many tokens edgelm's equalled "
            "when recorded (its first difference a near tie)",
            "files": {
                name: [
                    {"prompt": g["prompt"], "prompt_ids": g["prompt_ids"], "llamacpp_ids": g["llamacpp_ids"],
                     "agreed": g["equal_tokens"]}
                    for g in row["greedy"]
                ]
                for name, row in table.items()
            },
        }  # fmt: skip
        args.record.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
