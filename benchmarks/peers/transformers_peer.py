"""transformers as a peer for benchmarks/peers/peers.py: `generate` in PyTorch, fp32, greedy, EOS disabled; the
reference every fp32 row's ids are compared with. `generate_runs` is also Optimum's loop (optimum_peer.py)."""

from __future__ import annotations

import time

from peer_common import run_record


def child_transformers(path: str, prompt: list[int], args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    load_s = time.perf_counter() - started
    runs = generate_runs(model, prompt, args)
    # untimed: transformers' logits, for the top-1/top-2 gap at any token where another system differs
    input_ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=args.new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    gaps = [float(d[0] - d[1]) for d in (torch.topk(step[0], 2).values for step in out.logits)]
    return {"load_s": load_s, "runs": runs, "top2_gaps": gaps}


def generate_runs(model, prompt: list[int], args) -> list[dict]:
    """transformers' `generate`, greedy, EOS disabled (like edgelm's ignore_eos), a streamer clocking
    each token: a warm-up, then --repeats timed runs."""
    import torch
    from transformers.generation.streamers import BaseStreamer

    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = model.config.eos_token_id  # batch 1, no padding: silences a warning

    class Clock(BaseStreamer):
        """generate() calls put() with the prompt, then once per new token."""

        def __init__(self):
            self.times: list[float] = []

        def put(self, value):
            self.times.append(time.perf_counter())

        def end(self):
            pass

    input_ids = torch.tensor([prompt])
    mask = torch.ones_like(input_ids)

    def run(new_tokens: int) -> dict:
        clock = Clock()
        started = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                input_ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, streamer=clock
            )
        ended = time.perf_counter()
        first = clock.times[1]
        return run_record(started, first, ended, out[0, len(prompt) :].tolist())

    run(4)
    return [run(args.new_tokens) for _ in range(args.repeats)]
