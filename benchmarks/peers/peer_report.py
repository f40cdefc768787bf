"""The report of benchmarks/peers/peers.py: ids against transformers', ratios to edgelm, the markdown tables, the
plot, the printed summary and peers.json."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from edgelm_peer import PRECISIONS
from peer_common import GENAI_ON_EDGELM, PEERS

CONTENTION_PCT = 5  # other processes' share of the machine's CPU above which a row is reported as contended


def compare_with_reference(rows: list[dict]) -> list[dict]:
    """Every row's token ids against transformers' fp32 ids: where they first differ, and
    transformers' top-1/top-2 logit gap there (a near-tie flips on rounding alone)."""
    reference = next((r for r in rows if r["system"] == "transformers" and "token_ids" in r), None)
    if reference is None:
        return []
    mismatches = []
    for row in rows:
        if "token_ids" not in row or row is reference:
            continue
        ids, ref = row["token_ids"], reference["token_ids"]
        first = next((i for i, (a, b) in enumerate(zip(ids, ref, strict=False)) if a != b), None)
        if first is None and len(ids) != len(ref):
            first = min(len(ids), len(ref))
        row["same_as_reference"] = first is None
        row["first_difference"] = first
        if first is not None and row["precision"] == "fp32":
            row["flagged"] = True
            gap = reference["top2_gaps"][first] if first < len(reference["top2_gaps"]) else None
            mismatches.append(
                {
                    "system": row["system"],
                    "precision": row["precision"],
                    "prompt_tokens": row["prompt_tokens"],
                    "first_difference": first,
                    "reference_top2_gap": gap,
                    "eos_in_reference": row["eos_token_id"] in ref[: first + 1],
                }
            )
    return mismatches


def add_ratios(rows: list[dict]) -> None:
    """Each row's figures divided by edgelm's at the same precision (same run, same prompt)."""
    edgelm = {r["precision"]: r for r in rows if r["system"] == "edgelm" and "decode_tokens_per_s" in r}
    for r in rows:
        ours = edgelm.get(r["precision"])
        if ours and "decode_tokens_per_s" in r:
            keys = ("decode_tokens_per_s", "ttft_s", "load_s", "peak_rss_mb", "size_bytes")
            r["vs_edgelm"] = {key: r[key] / ours[key] for key in keys}
            if r["system"] == GENAI_ON_EDGELM:  # the very same package file: expect the very same ids
                r["same_as_edgelm"] = r["token_ids"] == ours["token_ids"]


def best_peers(rows: list[dict], bounds: dict) -> str:
    """edgelm at each precision against the best peer at that precision (each edgelm int8 against the best
    int8 peer: the peers' int8 is one recipe, labelled int8-dynamic): decode tokens/s (higher is better), first
    token, load time and peak RSS (lower is better), and edgelm's fraction of the bandwidth bound."""
    measured = [r for r in rows if "decode_tokens_per_s" in r]
    lines = [
        "| precision | edgelm tokens/s | best peer | its tokens/s | edgelm / best | of bound "
        "| first token: edgelm / best peer | load: edgelm / best peer | peak RSS: edgelm / best peer |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for ours in (r for r in measured if r["system"] == "edgelm"):
        kind = "int8-dynamic" if ours["precision"].startswith("int8") else ours["precision"]
        peers = [r for r in measured if r["system"] in PEERS and r["precision"] == kind]
        if not peers:
            continue
        best = max(peers, key=lambda r: r["decode_tokens_per_s"])
        fastest = min(r["ttft_s"] for r in peers)
        quickest = min(r["load_s"] for r in peers)
        smallest = min(r["peak_rss_mb"] for r in peers)
        rate, best_rate = ours["decode_tokens_per_s"], best["decode_tokens_per_s"]
        lines.append(
            f"| {ours['precision']} | {rate:.1f} | {best['system']} {best['precision']} | {best_rate:.1f} | "
            f"**{rate / best_rate:.2f}x** | {100 * rate / bounds[ours['precision']]['tokens_per_s']:.0f}% | "
            f"{ours['ttft_s'] / fastest:.2f}x | {ours['load_s'] / quickest:.2f}x | "
            f"{ours['peak_rss_mb'] / smallest:.2f}x |"
        )
    return "\n".join(lines)


def markdown(rows: list[dict], bounds: dict) -> str:
    header = (
        "| system | precision | size MB | load s | first token ms | vs edgelm | decode tokens/s | vs edgelm "
        "| of bound | peak RSS MB | ids = transformers fp32 |\n|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    edgelm = {r["precision"]: r for r in rows if r["system"] == "edgelm" and "decode_tokens_per_s" in r}
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['system']} | {r['precision']} | | | | | failed: {r['error'][:80]} | | | | |")
            continue
        rate = r["decode_tokens_per_s"]
        ours = edgelm.get(r["precision"])
        ttft_versus = f"{r['ttft_s'] / ours['ttft_s']:.2f}x" if ours else "-"
        versus = f"{rate / ours['decode_tokens_per_s']:.2f}x" if ours else "-"
        bound = bounds[r["precision"]]["tokens_per_s"] if r["precision"] in bounds else None
        of_bound = f"{100 * rate / bound:.0f}%" if bound else "-"
        if r["system"] == "transformers":
            same = "(reference)"
        elif r.get("first_difference") is None:
            same = "yes"
        else:
            same = f"differs from token {r['first_difference']}"
        flag = " ⚠" if r.get("flagged") else ""
        lines.append(
            f"| {r['system']} | {r['precision']} | {r['size_bytes'] / 1e6:.0f} | {r['load_s']:.2f} | "
            f"{r['ttft_s'] * 1000:.1f} | {ttft_versus} | {rate:.1f}{flag} | {versus} | {of_bound} | "
            f"{r['peak_rss_mb']:.0f} | {same} |"
        )
    return header + "\n".join(lines)


def plot(results: dict, bounds_by_prompt: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    prompts = list(results)
    fig, axes = plt.subplots(1, len(prompts), figsize=(max(9, 7 * len(prompts)), 5), squeeze=False)
    systems = list(dict.fromkeys(r["system"] for rows in results.values() for r in rows))
    width = 0.8 / len(systems)
    for ax, prompt in zip(axes[0], prompts, strict=True):
        for s, system in enumerate(systems):
            for p, precision in enumerate(PRECISIONS):
                row = next((r for r in results[prompt] if r["system"] == system and r["precision"] == precision), None)
                if row is None or "decode_tokens_per_s" not in row:
                    continue
                x, rate = p - 0.4 + (s + 0.5) * width, row["decode_tokens_per_s"]
                ax.bar(x, rate, width, color=f"C{s}", label=system)
                mark = " (ids differ!)" if row.get("flagged") else ""
                ax.text(x, rate, f"{rate:.0f}{mark}", ha="center", va="bottom", fontsize=7, rotation=90 if mark else 0)
        for p, precision in enumerate(PRECISIONS):
            if precision not in bounds_by_prompt[prompt]:
                continue
            bound = bounds_by_prompt[prompt][precision]["tokens_per_s"]
            ax.hlines(bound, p - 0.45, p + 0.45, colors="black", linestyles="dashed", label="memory-bandwidth bound")
        ax.set_xticks(range(len(PRECISIONS)), PRECISIONS)
        ax.set_ylabel("decode tokens/s")
        ax.set_title(f"{prompt}-token prompt")
        handles, labels = ax.get_legend_handles_labels()
        unique = dict(zip(labels, handles, strict=True))
        ax.legend(unique.values(), unique.keys(), fontsize=8, loc="upper left")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- the printed summary and peers.json ---------------------------------------------------------


@dataclass
class Run:
    """What one peers.py run measured with, beside its rows."""

    model_title: str
    args: object  # the parsed options
    facts: dict  # peer_common.machine()
    bandwidth: dict  # peer_common.memory_bandwidth(), plus one thread's
    optimum: dict  # the Optimum interpreter: its versions, or "error"
    llamacpp: dict  # the llama.cpp interpreter, likewise
    built: object  # peers.Built: the packages each system ran
    missing: dict  # system -> why it is not measured

    @property
    def title(self) -> str:
        a = self.args
        return (
            f"{self.model_title}, CPU, {a.threads} threads, "
            f"batch 1, greedy, {a.new_tokens} new tokens, median of {a.repeats}"
        )


def print_setup(run: Run) -> None:
    """The title, the machine, every interpreter's versions and every package's recipe."""
    facts, optimum, llamacpp = run.facts, run.optimum, run.llamacpp
    print(f"\n{run.title}")
    print(f"machine: {facts['nproc']} CPUs, {facts['cpu']}, {facts['ram_gib']} GiB; load average at start ", end="")
    print(f"{facts['load_average_at_start'][0]:.2f}; memory bandwidth {run.bandwidth['gb_per_s']:.1f} GB/s")
    print("versions:", ", ".join(f"{name} {v}" for name, v in facts["versions"].items() if v))
    if "versions" in optimum:
        versions = optimum["versions"]
        print(f"Optimum interpreter {optimum['python']}:", ", ".join(f"{n} {v}" for n, v in versions.items() if v))
        if versions["onnxruntime"] != facts["versions"]["onnxruntime"]:
            print(
                f"WARNING: Optimum runs onnxruntime {versions['onnxruntime']}, the other systems "
                f"{facts['versions']['onnxruntime']}: the rows differ by more than the system"
            )
    for precision, package in run.built.optimum.items():
        print(f"Optimum {precision}: {package['recipe']['summary']}")
    if "versions" in llamacpp:
        print(
            f"llama.cpp interpreter {llamacpp['python']}:",
            ", ".join(f"{n} {v}" for n, v in llamacpp["versions"].items()),
        )
        print(f"llama.cpp system info: {llamacpp['system_info']}")
    for precision, gguf in run.built.ggufs.items():
        print(f"llama.cpp {precision}: {gguf['path'].name}, {gguf['recipe']}")
    for precision, package in run.built.builder.items():
        print(f"genai model builder {precision}: {package['recipe']}")


def print_tables(results: dict, bounds_by_prompt: dict) -> None:
    for prompt_tokens, rows in results.items():
        print(f"\n{prompt_tokens}-token prompt\n")
        print(markdown(rows, bounds_by_prompt[prompt_tokens]))
        print(f"\nedgelm against the best peer ({', '.join(PEERS)}), {prompt_tokens}-token prompt\n")
        print(best_peers(rows, bounds_by_prompt[prompt_tokens]))
        print("\n| precision | MB read per decode step | bound tokens/s |\n|---|---|---|")
        for precision, b in bounds_by_prompt[prompt_tokens].items():
            print(f"| {precision} | {b['bytes_per_token'] / 1e6:.0f} | {b['tokens_per_s']:.1f} |")


def print_checks(results: dict, mismatches: list[dict], missing: dict) -> None:
    """fp32 ids against transformers', contended rows, genai against edgelm on one package, what is missing."""
    print("\nfp32 greedy ids against transformers:", "all identical" if not mismatches else "")
    for m in mismatches:
        gap = m["reference_top2_gap"]
        print(
            f"  MISMATCH {m['system']} {m['precision']}, {m['prompt_tokens']}-token prompt: differs from token "
            f"{m['first_difference']} (transformers' top-1/top-2 logit gap there: "
            f"{'n/a' if gap is None else f'{gap:.2e}'}{'; EOS in the reference' if m['eos_in_reference'] else ''})"
        )
    rows = [r for rows in results.values() for r in rows]
    contended = [
        f"{r['system']} {r['precision']} ({r['prompt_tokens']}): {r['other_cpu_pct']:.0f}%"
        for r in rows
        if r.get("other_cpu_pct", 0) > CONTENTION_PCT
    ]
    print(
        f"rows measured while other processes used more than {CONTENTION_PCT}% of the CPU: "
        + ("; ".join(contended) if contended else "none")
    )
    same_package = [
        f"{r['precision']} ({r['prompt_tokens']}-token prompt): {'same ids' if r['same_as_edgelm'] else 'ids DIFFER'}"
        for r in rows
        if "same_as_edgelm" in r
    ]
    if same_package:
        print("onnxruntime-genai against edgelm on the same package:", "; ".join(same_package))
    if missing:
        print("\nnot measured:")
        for name, reason in missing.items():
            print(f"  {name}: {reason}")


def paths_and_recipes(built: dict) -> dict:
    return {precision: {"path": str(b["path"]), "recipe": b["recipe"]} for precision, b in built.items()}


def report_json(run: Run, results: dict, bounds_by_prompt: dict, mismatches: list[dict]) -> dict:
    return {
        "title": run.title,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": run.facts,
        "memory_bandwidth": run.bandwidth,
        "bounds": bounds_by_prompt,
        "results": results,
        "mismatches": mismatches,
        "missing": run.missing,
        "optimum_interpreter": run.optimum,
        "optimum_packages": paths_and_recipes(run.built.optimum),
        "llamacpp_interpreter": run.llamacpp,
        "ggufs": paths_and_recipes(run.built.ggufs),
        "genai_builder_packages": paths_and_recipes(run.built.builder),
    }


def report(run: Run, results: dict, *, bounds_by_prompt: dict, out: Path) -> None:
    """Checks the rows against each other, prints the summary and tables, writes peers.json and peers.png."""
    mismatches = [m for rows in results.values() for m in compare_with_reference(rows)]
    for rows in results.values():
        add_ratios(rows)
    print_setup(run)
    print_tables(results, bounds_by_prompt)
    print_checks(results, mismatches, run.missing)
    (out / "peers.json").write_text(json.dumps(report_json(run, results, bounds_by_prompt, mismatches), indent=1))
    plot(results, bounds_by_prompt, out / "peers.png", run.title)
    print(f"\nwrote {out / 'peers.json'} and {out / 'peers.png'}")
