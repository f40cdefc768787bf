"""onnxruntime-genai as a peer for benchmarks/peers/peers.py: its greedy loop on any package with a genai_config.json
(edgelm's own, Optimum's export, its model builder's). Threads go through `og.Config.overlay`;
`min_length = max_length`, since genai cannot step past EOS."""

from __future__ import annotations

import json
import time

import numpy as np
from peer_common import run_record


def child_genai(path: str, prompt: list[int], args) -> dict:
    import onnxruntime_genai as og

    started = time.perf_counter()
    config = og.Config(path)
    config.clear_providers()  # CPU
    options = {"intra_op_num_threads": args.threads, "inter_op_num_threads": 1}
    config.overlay(json.dumps({"model": {"decoder": {"session_options": options}}}))
    model = og.Model(config)
    load_s = time.perf_counter() - started
    ids = np.array(prompt, dtype=np.int32)

    def run(new_tokens: int) -> dict:
        started = time.perf_counter()
        params = og.GeneratorParams(model)
        length = len(prompt) + new_tokens
        params.set_search_options(do_sample=False, max_length=length, min_length=length, batch_size=1)
        generator = og.Generator(model, params)
        generator.append_tokens(ids)
        tokens, first = [], 0.0
        while not generator.is_done():
            generator.generate_next_token()
            tokens.append(int(generator.get_next_tokens()[0]))
            first = first or time.perf_counter()
        return run_record(started, first, time.perf_counter(), tokens)

    run(4)
    return {"load_s": load_s, "runs": [run(args.new_tokens) for _ in range(args.repeats)]}
