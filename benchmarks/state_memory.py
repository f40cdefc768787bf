"""What a long chat's cache holds in the runtime: the bytes of the cache object's arrays (attention layers' KV
buffers, a hybrid's conv / recurrent states, their rewind snapshots) and the process's peak RSS, as one
conversation grows turn by turn to 32k tokens; beside the formula from the package's manifest.

    # a random checkpoint of a real model's per-layer shape with its first N layers (cache memory is per layer)
    python benchmarks/state_memory.py truncate SRC_HF_FOLDER OUT_FOLDER --layers 4
    edgelm export OUT_FOLDER PKG --quantize int4
    python benchmarks/state_memory.py measure PKG --lengths 1024,4096,16384,32768 --turn 512

`measure` prints one JSON line per length. Each turn is `--turn` new tokens fed with `extend`, the way a
Conversation feeds a turn: the cache starts as Conversation makes it (capacity of the first turn) and grows by
doubling; the hybrid's snapshots are those the cache keeps at turn boundaries. Token ids are random (memory
does not depend on them)."""

from __future__ import annotations

import argparse
import json
import resource
import shutil
from pathlib import Path

import numpy as np

from edgelm.runtime import model as runtime_model
from edgelm.runtime.kvcache import kv_cache_bytes, make_cache
from edgelm.runtime.state_layout import STATE_KINDS

HF_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def truncate(source: Path, out: Path, layers: int) -> None:
    """A random checkpoint of `source`'s config.json with its first `layers` layers (and layer types)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(source)
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:layers]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    for name in HF_FILES:
        if (source / name).exists():
            shutil.copy(source / name, out / name)
    kinds = getattr(config, "layer_types", None) or ["full_attention"] * layers
    print(json.dumps({"out": str(out), "layers": layers, "layer_types": kinds}))


def array_bytes(cache) -> dict[str, int]:
    """nbytes of the cache object's arrays, by part."""
    parts = {"kv": 0, "state": 0, "snapshots": 0}
    buffers = getattr(cache, "buffers", None)
    if buffers is not None:  # shared-buffer drivers: KV buffers of `capacity` positions
        parts["kv"] = sum(int(np.prod(b.shape())) * 4 for b in buffers)
        parts["state"] = sum(int(np.prod(v.shape())) * 4 for pair in getattr(cache, "state_pairs", []) for v in pair)
    else:  # concatenating drivers: past OrtValues, KV and states alike
        for value, kind in zip(cache.past, cache.model.spec.arch.cache_kinds(), strict=True):
            parts["state" if kind in STATE_KINDS else "kv"] += int(np.prod(value.shape())) * 4
    for arrays in getattr(cache, "snapshots", {}).values():
        parts["snapshots"] += sum(a.nbytes for a in arrays)
    parts["total"] = sum(parts.values())
    return parts


def formula(spec, length: int) -> dict[str, int]:
    """The state of one sequence of `length` tokens, from the manifest: 2 (K and V) x KV heads x head size x
    length for each attention layer, the conv and recurrent state shapes for the others; float32."""
    arch = spec.arch
    kinds = arch.cache_kinds()
    kv = kinds.count("key") * 2 * arch.n_kv_head * arch.head_dim * length * 4
    state = sum(int(np.prod(arch.cache_shape(kind, 1))) * 4 for kind in kinds if kind in STATE_KINDS)
    return {"kv": kv, "state": state, "total": kv + state}


def measure(package: Path, lengths: list[int], turn: int, threads: int | None) -> None:
    model = runtime_model.load(package, provider="cpu", threads=threads, verify=False)
    runner = model.runner(None)
    spec = model.spec
    arch = spec.arch
    layer_types = arch.states.layer_types or ["full_attention"] * arch.n_layer
    counts = {kind: layer_types.count(kind) for kind in dict.fromkeys(layer_types)}
    rng = np.random.default_rng(0)
    cache = make_cache(runner, [[0]], capacity=turn)  # as Conversation._prepare_cache makes it
    cache.rewind(0)
    rss_loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    held = 0
    for target in lengths:
        while held < target:
            ids = rng.integers(0, arch.vocab_size, size=min(turn, target - held)).tolist()
            cache.extend(ids)
            held += len(ids)
        row = {
            "package": package.name,
            "layers": counts,
            "tokens": held,
            "capacity": getattr(cache, "capacity", held),
            "edgelm": array_bytes(cache),
            "formula": formula(spec, held),
            "runtime_estimate": kv_cache_bytes(spec, batch=1, capacity=held),
            "peak_rss_loaded": rss_loaded,
            "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        }
        print(json.dumps(row), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    cut = commands.add_parser("truncate", help="random checkpoint of a config's first N layers")
    cut.add_argument("source", type=Path)
    cut.add_argument("out", type=Path)
    cut.add_argument("--layers", type=int, required=True)
    run = commands.add_parser("measure", help="cache bytes and peak RSS as a conversation grows")
    run.add_argument("package", type=Path)
    run.add_argument("--lengths", default="1024,4096,16384,32768")
    run.add_argument("--turn", type=int, default=512, help="tokens fed per extend (one turn)")
    run.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.command == "truncate":
        truncate(args.source, args.out, args.layers)
    else:
        measure(args.package, [int(x) for x in args.lengths.split(",")], args.turn, args.threads)


if __name__ == "__main__":
    main()
