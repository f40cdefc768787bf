"""Speculative decoding on SmolLM2-135M-Instruct: edgelm plain vs edgelm prompt lookup vs llama.cpp's prompt lookup.

Two prompt sets in SmolLM2's chat template: input-grounded (summarise, rewrite and extract from a ~400-token
passage of data/tinyshakespeare.txt, a code edit, a multi-turn chat that asks the model to repeat its own reply)
and free generation (open questions). Every system gets the same token ids, generates 128 tokens greedily
(EOS ignored, so every run is 128 tokens) on --threads threads; decode speed is new tokens per second after the
first token. Systems take turns on each prompt (their order rotated per prompt and per round), and each round
gives a ratio per system (its decode tokens/s over edgelm plain's, all prompts of a set); the median of the per-round
ratios is reported, because the machine is shared and noisy (docs/benchmarks.md, "Speculative decoding"); the
turn orders and the ratios are benchmarks/ab.py's, the harness every A/B script uses.

llama.cpp runs in a child process of the llama-cpp-python interpreter (benchmarks/peers/setup_llamacpp.sh), kept
loaded between rounds: `Llama(draft_model=LlamaPromptLookupDecoding(...))` with its defaults (10 tokens, n-grams
of up to 2), and plain for reference. Its GGUF files: --gguf PRECISION=FILE (f32 and q8_0 can be made from the
Q4_1 file with `python benchmarks/speculative.py requantize Q4_1.gguf OUT.gguf --type f32|q8_0` in that
interpreter: the same weights as edgelm's --dequantize export and its int8 package).

    .venv/bin/python benchmarks/speculative.py --package fp32=pk/fp32 --package int8=pk/int8 \\
        --package int4=pk/int4 --gguf fp32=f32.gguf --gguf int8=q8_0.gguf --gguf int4=Q4_1.gguf \\
        --llamacpp-python /work/llamacpp-venv/bin/python --rounds 3 --out benchmarks/results/speculative.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import ab

REPO = Path(__file__).resolve().parent.parent
NEW_TOKENS = 128
PASSAGE = (REPO / "data" / "tinyshakespeare.txt").read_text(encoding="utf-8")[:1750]  # about 420 tokens
CODE = """def summarize(records):
    totals = {}
    counts = {}
    for record in records:
        key = record["region"]
        totals[key] = totals.get(key, 0) + record["amount"]
        counts[key] = counts.get(key, 0) + 1
    result = []
    for key in sorted(totals):
        average = totals[key] / counts[key]
        result.append({"region": key, "total": totals[key], "average": average})
    return result
"""
REPLY = (
    "Here are three tips for a good night's sleep: keep a regular schedule and go to bed at the same time every "
    "night; keep your bedroom dark, quiet and cool; and avoid caffeine, alcohol and screens in the hour before bed."
)


def prompt_sets() -> dict[str, list[list[dict]]]:
    user = lambda text: {"role": "user", "content": text}  # noqa: E731
    grounded = [
        [user(f"Summarise this scene, quoting the key lines:\n\n{PASSAGE}")],
        [user(f"Rewrite this scene with each speaker's name in capitals, keeping every line:\n\n{PASSAGE}")],
        [user(f"List every line spoken by the First Citizen in this scene, word for word:\n\n{PASSAGE}")],
        [user(f"Rename the variable `totals` to `sums` in this code and return the whole function:\n\n{CODE}")],
        [
            user("Give me three tips for a good night's sleep."),
            {"role": "assistant", "content": REPLY},
            user("Repeat your answer word for word, then add a fourth tip."),
        ],
    ]
    free = [
        [user("Write a short story about a lighthouse keeper who finds a message in a bottle.")],
        [user("Explain how a bicycle stays upright, for a ten-year-old.")],
    ]
    return {"grounded": grounded, "free": free}


def cpu_name() -> str:
    done = subprocess.run(["lscpu"], capture_output=True, text=True, check=False)
    for line in done.stdout.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


# ---- edgelm (this interpreter) ----------------------------------------------------------------------------


def chat_ids(model, messages: list[dict]) -> list[int]:
    from edgelm.runtime.chat import package_template
    from edgelm.runtime.template import chat_prompt_ids

    return chat_prompt_ids(package_template(model), model.tokenizer, messages)


def edgelm_run(model, ids: list[int], speculative) -> dict:
    result = model.generate(ids, NEW_TOKENS, ignore_eos=True, speculative=speculative)
    t = result.timings
    return {
        "decode_s": t.total_s - t.time_to_first_token_s,
        "tokens": result.token_ids,
        "proposed": t.proposed_tokens,
        "accepted": t.accepted_tokens,
    }


# ---- llama.cpp (a child process in the llama-cpp-python interpreter) -------------------------------------


class LlamaChild:
    """A loaded llama.cpp model in a child process; one JSON line per request and per answer."""

    def __init__(self, python: str, gguf: str, *, lookup: bool, threads: int, context: int):
        command = [python, __file__, "child", gguf, "--threads", str(threads), "--context", str(context)]
        command += ["--lookup"] if lookup else []
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert json.loads(self.process.stdout.readline())["ready"], f"llama.cpp did not load {gguf}"

    def run(self, ids: list[int]) -> dict:
        self.process.stdin.write(json.dumps(ids) + "\n")
        self.process.stdin.flush()
        return json.loads(self.process.stdout.readline())

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)


def child(args: argparse.Namespace) -> None:
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    draft = LlamaPromptLookupDecoding() if args.lookup else None
    llm = llama_cpp.Llama(
        model_path=args.gguf,
        n_ctx=args.context,
        n_batch=args.context,
        n_ubatch=args.context,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        draft_model=draft,
        verbose=False,
    )
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        ids = json.loads(line)
        llm.reset()
        tokens, first = [], 0.0
        for token in llm.generate(ids, top_k=1, temp=0.0, repeat_penalty=1.0, reset=False):
            tokens.append(int(token))
            first = first or time.perf_counter()
            if len(tokens) == NEW_TOKENS:
                break
        print(json.dumps({"decode_s": time.perf_counter() - first, "tokens": tokens}), flush=True)


def requantize(args: argparse.Namespace) -> None:
    """A GGUF file to f32 or q8_0 (from Q4_1: its weights dequantized, the same as edgelm's --dequantize)."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = {"f32": llama_cpp.LLAMA_FTYPE_ALL_F32, "q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0}[args.type]
    params.allow_requantize = True
    params.nthread = 2
    status = llama_cpp.llama_model_quantize(args.source.encode(), args.target.encode(), params)
    assert status == 0, f"llama_model_quantize returned {status}"


# ---- rounds ------------------------------------------------------------------------------------------------


def systems_for(precision: str, args: argparse.Namespace, prompts: dict) -> tuple:
    """The model, the prompts as ids, and name -> callable(ids): edgelm plain and lookup, llama.cpp plain and lookup."""
    from edgelm.runtime import load

    model = load(dict(args.package)[precision], threads=args.threads)
    ids = {name: [chat_ids(model, messages) for messages in group] for name, group in prompts.items()}
    systems = {
        "edgelm plain": lambda i: edgelm_run(model, i, None),
        "edgelm lookup": lambda i: edgelm_run(model, i, "lookup"),
    }
    gguf = dict(args.gguf).get(precision)
    if gguf and args.llamacpp_python:
        context = max(len(i) for group in ids.values() for i in group) + NEW_TOKENS + 16
        for lookup in (False, True) if args.llamacpp_plain else (True,):
            llama = LlamaChild(args.llamacpp_python, gguf, lookup=lookup, threads=args.threads, context=context)
            systems["llama.cpp lookup" if lookup else "llama.cpp plain"] = llama.run
    return model, ids, systems


def one_round(systems: dict, ids: dict, order: list[str]) -> dict:
    """system -> set -> {"decode_s", "new_tokens", "tokens" (per prompt), "proposed", "accepted"} for one pass over
    every prompt. The systems take turns on each prompt (the order rotated per prompt), so a change in the
    machine's load falls on all of them alike."""
    runs = {name: {set_name: [] for set_name in ids} for name in order}
    for set_name, group in ids.items():
        for index, prompt in enumerate(group):
            turn = ab.order_of(order, index, "rotate")
            for name in turn:
                runs[name][set_name].append(systems[name](prompt))
        print(f"  {set_name}: done", flush=True)
    return {
        name: {
            set_name: {
                "decode_s": sum(r["decode_s"] for r in done),
                "new_tokens": sum(len(r["tokens"]) - 1 for r in done),
                "tokens": [r["tokens"] for r in done],
                "proposed": sum(r.get("proposed", 0) for r in done),
                "accepted": sum(r.get("accepted", 0) for r in done),
            }
            for set_name, done in sets.items()
        }
        for name, sets in runs.items()
    }


def summarise(rounds: list[dict]) -> dict:
    """set -> system -> median decode tokens/s, median ratio to edgelm plain, acceptance, identical output."""
    summary = {}
    for set_name in rounds[0]["edgelm plain"]:
        summary[set_name] = {}
        for name in rounds[0]:
            rates = [r[name][set_name]["new_tokens"] / r[name][set_name]["decode_s"] for r in rounds]
            base = [r["edgelm plain"][set_name]["new_tokens"] / r["edgelm plain"][set_name]["decode_s"] for r in rounds]
            first = rounds[0][name][set_name]
            llama_plain = name.startswith("llama.cpp") and "llama.cpp plain" in rounds[0]
            reference = "llama.cpp plain" if llama_plain else "edgelm plain"  # whose tokens must be the same
            plain = rounds[0][reference][set_name]
            summary[set_name][name] = {
                "decode_tokens_per_s": statistics.median(rates),
                "ratio_to_edgelm_plain": ab.spread(ab.per_round_ratios(rates, base))["median"],
                "per_round_ratios": ab.per_round_ratios(rates, base),
                "proposed": first["proposed"],
                "accepted": first["accepted"],
                "same_tokens_as_plain": first["tokens"] == plain["tokens"],
            }
    return summary


def plot(report: dict, path: Path) -> None:
    """Decode tokens/s relative to edgelm plain, per precision and prompt set, one bar per system."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)", file=sys.stderr)
        return
    groups = [(precision, set_name) for precision in report["results"] for set_name in ("grounded", "free")]
    systems = list(report["results"][groups[0][0]]["grounded"])
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(systems)
    for index, name in enumerate(systems):
        ratios = [report["results"][p][s].get(name, {}).get("ratio_to_edgelm_plain", 0) for p, s in groups]
        xs = [g + (index - (len(systems) - 1) / 2) * width for g in range(len(groups))]
        bars = ax.bar(xs, ratios, width, label=name)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks(range(len(groups)), [f"{p}\n{s}" for p, s in groups])
    ax.set_ylabel("decode tokens/s / edgelm plain")
    ax.set_title(f"SmolLM2-135M-Instruct, greedy, {report['new_tokens']} tokens, {report['threads']} threads")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def table(report: dict) -> str:
    """The markdown table of docs/benchmarks.md: medians of per-round ratios."""
    rows = [
        "| precision | prompts | edgelm plain tokens/s | lookup / plain | lookup / llama.cpp lookup "
        "| llama.cpp lookup / edgelm plain | guesses accepted | same ids as plain |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for precision, result in report["results"].items():
        for set_name in ("grounded", "free"):
            r = result[set_name]
            ours, theirs = r["edgelm lookup"], r.get("llama.cpp lookup")
            versus = peer = "n/a"
            if theirs:
                pairs = ab.per_round_ratios(ours["per_round_ratios"], theirs["per_round_ratios"])
                versus = f"{ab.spread(pairs)['median']:.2f}x"
                peer = f"{theirs['ratio_to_edgelm_plain']:.2f}x"
            same = "yes" if ours["same_tokens_as_plain"] else "NO"
            rows.append(
                f"| {precision} | {set_name} | {r['edgelm plain']['decode_tokens_per_s']:.1f} "
                f"| {ours['ratio_to_edgelm_plain']:.2f}x | {versus} | {peer} "
                f"| {ours['accepted']} of {ours['proposed']} | {same} |"
            )
    return "\n".join(rows)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command")
    sub = commands.add_parser("child")
    sub.add_argument("gguf")
    sub.add_argument("--threads", type=int, default=2)
    sub.add_argument("--context", type=int, default=2048)
    sub.add_argument("--lookup", action="store_true")
    sub = commands.add_parser("requantize")
    sub.add_argument("source")
    sub.add_argument("target")
    sub.add_argument("--type", choices=("f32", "q8_0"), required=True)
    sub = commands.add_parser("plot", help="the plot of recorded runs (their precisions together)")
    sub.add_argument("png", type=Path)
    sub.add_argument("json", type=Path, nargs="+")
    pair = lambda text: tuple(text.split("=", 1))  # noqa: E731
    parser.add_argument("--package", type=pair, action="append", default=[], help="PRECISION=FOLDER (edgelm)")
    parser.add_argument("--gguf", type=pair, action="append", default=[], help="PRECISION=FILE (llama.cpp)")
    parser.add_argument("--llamacpp-python", default=None, help="the llama-cpp-python interpreter")
    parser.add_argument("--llamacpp-plain", action="store_true", help="also time llama.cpp without lookup")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "speculative.json")
    return parser.parse_args()


def run_rounds(args: argparse.Namespace) -> dict:
    """Every precision's systems in turn on each prompt, round after round; the report is saved after each round."""
    report = {"command": " ".join(sys.argv), "cpu": cpu_name(), "threads": args.threads, "new_tokens": NEW_TOKENS}
    report["results"] = {}
    prompts = prompt_sets()
    for precision, _ in args.package:
        model, ids, systems = systems_for(precision, args, prompts)
        rounds = []
        for index in range(args.rounds):
            order = ab.order_of(list(systems), index, "rotate")
            rounds.append(one_round(systems, ids, order))
            print(f"{precision} round {index + 1}: " + json.dumps(summarise(rounds[-1:])), flush=True)
            report["results"][precision] = summarise(rounds)
            report["results"][precision]["rounds"] = len(rounds)
            report["results"][precision]["prompt_tokens"] = {k: [len(i) for i in group] for k, group in ids.items()}
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=2) + "\n")  # after every round: a partial run is kept
        for system in systems.values():
            getattr(getattr(system, "__self__", None), "close", lambda: None)()
    return report


def main() -> int:
    args = parse_args()
    if args.command == "child":
        child(args)
    elif args.command == "requantize":
        requantize(args)
    elif args.command == "plot":
        reports = [json.loads(path.read_text()) for path in args.json]
        merged = {**reports[0], "results": {k: v for r in reports for k, v in r["results"].items()}}
        plot(merged, args.png)
        print(table(merged))
    else:
        print(json.dumps(run_rounds(args)["results"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
