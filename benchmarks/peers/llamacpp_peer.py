"""llama.cpp as a peer for benchmarks/peers/peers.py, through llama-cpp-python.

GGUF files from the same Hugging Face folder as every other system's model: llama.cpp's own converter
(convert_hf_to_gguf.py from llama-cpp-python's source distribution, unpacked by
benchmarks/peers/setup_llamacpp.sh) writes f32 and q8_0, and `llama_cpp.llama_model_quantize` makes q4_0 from
the f32 file, as llama.cpp's `llama-quantize` does. The converter runs in this interpreter (it needs
torch and transformers); quantizing and generating run in the llama-cpp-python interpreter
(.venv-llamacpp), which needs nothing but llama_cpp and numpy from this file.

The converter names the tokenizer's pre-tokenizer by hashing how it splits a test string, and refuses
one it does not know ("BPE pre-tokenizer was not recognized"). The GPT-2 benchmark folder carries a
small byte-level BPE trained on Shakespeare, GPT-2's own pre-tokenizer with another vocabulary, so
`convert` can be given the name to fall back on (`gpt-2`; benchmarks/peers/peer_models.py names one per
model, `smollm` for SmolLM2's folder in case its rebuilt tokenizer.json hashes differently from the
Hub's). A tokenizer the converter recognizes keeps its own name. The benchmark feeds token ids, never
text, so the vocabulary in the GGUF does not enter the figures.

    python benchmarks/peers/llamacpp_peer.py convert FOLDER OUT.gguf --outtype f32|f16|q8_0 [--pre-tokenizer gpt-2]
    .venv-llamacpp/bin/python benchmarks/peers/llamacpp_peer.py quantize IN.gguf OUT.gguf --type q4_0|q4_k_m

The converter is looked for in $LLAMA_CPP (a llama.cpp source tree) when set, else where
benchmarks/peers/setup_llamacpp.sh unpacks it.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LLAMACPP_PYTHON = REPO / ".venv-llamacpp" / "bin" / "python"  # made by benchmarks/peers/setup_llamacpp.sh
LLAMA_CPP = Path(os.environ.get("LLAMA_CPP", REPO / "benchmarks" / ".llamacpp" / "llama.cpp"))
CONVERTER = LLAMA_CPP / "convert_hf_to_gguf.py"
SETUP = "run benchmarks/peers/setup_llamacpp.sh to make it, or pass --llamacpp-python"
# benchmark precision -> (GGUF type, how it is made): peers.py's precision names, so that rows line up;
# q8_0 sits with the dynamic int8 rows since ggml quantizes activations to 8 bits per block at run time
GGUF_TYPES = {"fp32": ("f32", "converter"), "int8-dynamic": ("q8_0", "converter"), "int4": ("q4_0", "quantize")}
QUANTIZE_TYPES = ("q4_0", "q4_1", "q8_0", "q4_k_m", "q5_k_m", "q6_k")
QUANTIZE_FTYPES = {name: f"LLAMA_FTYPE_MOSTLY_{name.upper()}" for name in QUANTIZE_TYPES}  # llama_cpp names


# ---- in this interpreter: the converter --------------------------------------------------------


def convert(folder: Path, outfile: Path, *, outtype: str, pre_tokenizer: str | None = None) -> None:
    """Runs llama.cpp's convert_hf_to_gguf.py on `folder`. With `pre_tokenizer`, an unrecognized BPE
    pre-tokenizer is written under that name instead of stopping the conversion."""
    if not CONVERTER.is_file():
        raise FileNotFoundError(f"no llama.cpp converter at {CONVERTER}: run benchmarks/peers/setup_llamacpp.sh")
    sys.path[:0] = [str(CONVERTER.parent), str(CONVERTER.parent / "gguf-py")]
    if pre_tokenizer is not None:
        from conversion.base import TextModel

        recognize = TextModel.get_vocab_base_pre

        def recognize_or_fall_back(self, tokenizer) -> str:
            try:
                return recognize(self, tokenizer)
            except NotImplementedError:
                print(f"pre-tokenizer not recognized by the converter: written as {pre_tokenizer!r}", flush=True)
                return pre_tokenizer

        TextModel.get_vocab_base_pre = recognize_or_fall_back
    sys.argv = [str(CONVERTER), str(folder), "--outtype", outtype, "--outfile", str(outfile)]
    config = json.loads((Path(folder) / "config.json").read_text())
    if config.get("model_type", "").startswith("qwen3_5") and not config.get("mtp_num_hidden_layers"):
        sys.argv.append("--no-mtp")  # a shaped Qwen3.5 has no multi-token-prediction block for the converter to find
    runpy.run_path(str(CONVERTER), run_name="__main__")


def build_ggufs(
    checkpoint: Path, out: Path, *, python: Path, pre_tokenizer: str | None, rebuild: bool
) -> dict[str, dict]:
    """The GGUF file of each precision in GGUF_TYPES, in out/llamacpp/; returns precision -> {"path",
    "recipe"}. Each step is a child process: the converter in this interpreter, quantizing in `python`."""
    folder = out / "llamacpp"
    folder.mkdir(parents=True, exist_ok=True)
    files = {}
    for precision, (gguf_type, tool) in GGUF_TYPES.items():
        path = folder / f"model-{gguf_type}.gguf"
        if tool == "converter":
            command = [sys.executable, __file__, "convert", str(checkpoint), str(path), "--outtype", gguf_type]
            command += ["--pre-tokenizer", pre_tokenizer] if pre_tokenizer else []
            recipe = f"convert_hf_to_gguf.py --outtype {gguf_type}"
        else:
            command = [str(python), __file__, "quantize", str(files["fp32"]["path"]), str(path), "--type", gguf_type]
            recipe = f"llama_model_quantize(f32 file, {QUANTIZE_FTYPES[gguf_type]})"
        if path.is_file() and not rebuild:
            print(f"  {path.name}: reusing (--rebuild to redo)", flush=True)
        else:
            started = time.perf_counter()
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                path.unlink(missing_ok=True)
                raise RuntimeError(f"{recipe} failed: {(done.stderr.strip().splitlines() or ['no output'])[-1]}")
            print(f"  {path.name}: {time.perf_counter() - started:.1f} s", flush=True)
        files[precision] = {"path": path, "recipe": recipe}
    return files


def interpreter(python: Path) -> dict:
    """The llama-cpp-python interpreter's versions, or "error", why it cannot run llama.cpp."""
    if not python.is_file():
        return {"python": str(python), "error": f"no llama-cpp-python interpreter at {python}: {SETUP}"}
    done = subprocess.run([str(python), __file__, "probe"], capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"python": str(python), "error": f"{python} cannot import llama_cpp ({last}): {SETUP}"}
    return {"python": str(python), **json.loads(done.stdout.strip().splitlines()[-1])}


# ---- in the llama-cpp-python interpreter -------------------------------------------------------

MAX_BATCH = 512  # llama.cpp's own default n_ubatch: a 16k-token prompt in one batch holds a 16k x 16k score matrix


def quantize(source: Path, target: Path, *, gguf_type: str, threads: int = 2) -> None:
    import llama_cpp

    if gguf_type not in QUANTIZE_FTYPES:
        raise ValueError(f"unknown GGUF type {gguf_type!r}; valid: {', '.join(QUANTIZE_FTYPES)}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, QUANTIZE_FTYPES[gguf_type])
    params.nthread = threads
    status = llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), params)
    if status != 0:
        raise RuntimeError(f"llama_model_quantize({source} -> {gguf_type}) returned {status}")


def child_llamacpp(path: str, prompt: list[int], args) -> dict:
    """llama-cpp-python's Llama: the whole prompt in one batch (n_batch = n_ubatch = the prompt's
    length or more, up to MAX_BATCH: a longer prompt goes in batches of that many), greedy sampling in
    llama.cpp's sampler chain (temp 0 -> greedy), EOS not checked (generate() never stops on it). The
    model file is memory-mapped, llama.cpp's default, so its pages count in peak RSS once read. `path` is a
    GGUF file, or a folder with exactly one."""
    import llama_cpp

    model_file = Path(path)
    if model_file.is_dir():
        found = sorted(model_file.glob("*.gguf"))
        assert len(found) == 1, f"expected one .gguf file in {path}, found {[f.name for f in found]}"
        model_file = found[0]
    n_ctx = len(prompt) + args.new_tokens
    batch = min(max(512, len(prompt)), MAX_BATCH)
    started = time.perf_counter()
    llm = llama_cpp.Llama(
        model_path=str(model_file),
        n_ctx=n_ctx,
        n_batch=batch,
        n_ubatch=batch,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        verbose=False,
    )
    load_s = time.perf_counter() - started

    def run(new_tokens: int) -> dict:
        started = time.perf_counter()
        llm.reset()  # n_tokens = 0: the prompt is evaluated anew, no prefix of the last run's cache is reused
        tokens, first = [], 0.0
        for token in llm.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0, reset=False):
            tokens.append(int(token))
            first = first or time.perf_counter()
            if len(tokens) == new_tokens:
                break
        ended = time.perf_counter()
        rate = (len(tokens) - 1) / (ended - first) if len(tokens) > 1 else 0.0
        return {"ttft_s": first - started, "decode_tokens_per_s": rate, "token_ids": tokens}

    run(4)
    return {"load_s": load_s, "runs": [run(args.new_tokens) for _ in range(args.repeats)]}


def probe() -> dict:
    import importlib.metadata

    import llama_cpp

    return {
        "versions": {name: importlib.metadata.version(name) for name in ("llama-cpp-python", "numpy")},
        "system_info": llama_cpp.llama_print_system_info().decode().strip(),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    to_gguf = commands.add_parser("convert", help="a Hugging Face folder to GGUF with llama.cpp's converter")
    to_gguf.add_argument("folder", type=Path)
    to_gguf.add_argument("outfile", type=Path)
    to_gguf.add_argument("--outtype", choices=("f32", "f16", "bf16", "q8_0"), default="f32")
    to_gguf.add_argument("--pre-tokenizer", help="the name to write for a pre-tokenizer the converter does not know")
    requantize = commands.add_parser("quantize", help="a GGUF file to another type (llama-cpp-python interpreter)")
    requantize.add_argument("source", type=Path)
    requantize.add_argument("target", type=Path)
    requantize.add_argument("--type", choices=sorted(QUANTIZE_FTYPES), default="q4_0")
    commands.add_parser("probe", help="print llama-cpp-python's version and llama.cpp's system info as JSON")
    args = parser.parse_args()
    if args.command == "convert":
        convert(args.folder, args.outfile, outtype=args.outtype, pre_tokenizer=args.pre_tokenizer)
    elif args.command == "quantize":
        quantize(args.source, args.target, gguf_type=args.type)
    else:
        print(json.dumps(probe()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
