"""Export's proof: ONNX Runtime against the PyTorch reference model on the same inputs, a padded
batch's prompt and then decode steps, each side with its own cache. Export fails when the largest
logit difference passes the tolerance (llm.c checks its C forward against PyTorch the same way).

The reference models of every family share one call, model(input_ids, attention_mask, position_ids,
past) -> (logits, present), and one config vocabulary (n_layer, n_kv_head, head_dim, n_positions,
vocab_size), which is all these checks use.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from ..runtime.contract import LAYER_STATES, IONames
from .checkpoint import CheckpointError
from .traced import state_layout


def _worst(worst: float, ort_logits: np.ndarray, torch_logits: np.ndarray) -> float:
    """The running max |difference| over compared logits. max() drops a NaN (every comparison with one is
    false), so non-finite values are looked at first: the reference's are the checkpoint's fault (it cannot
    generate), ONNX Runtime's alone count as an infinite difference."""
    if not np.isfinite(torch_logits).all():
        raise CheckpointError(
            "the model's logits are not finite (NaN or inf) on the export check's prompt: this checkpoint cannot "
            "generate text"
        )
    if not np.isfinite(ort_logits).all():
        return float("inf")
    return max(worst, float(np.abs(ort_logits - torch_logits).max(initial=0.0)))


@contextmanager
def _one_thread() -> Iterator[None]:
    """PyTorch on one thread, no gradients: the checks run a few tokens at a time, where a second thread
    saves little and its OpenMP barriers spin against every other process on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            yield
    finally:
        torch.set_num_threads(threads)


def _session(onnx_path: str | Path, *, prepacking: bool = False) -> ort.InferenceSession:
    """prepacking: as the runtime runs it; needed where a kernel's fast path exists only for prepacked weights
    (MatMulNBits' int8-activation path, accuracy_level 4). Off, no second copy of the float weights is made."""
    options = ort.SessionOptions()
    options.log_severity_level = 3  # not the notice that num_logits_to_keep, an input, is not folded
    if not prepacking:
        options.add_session_config_entry("session.disable_prepacking", "1")
    return ort.InferenceSession(str(onnx_path), options, providers=["CPUExecutionProvider"])


def check_parity(
    model: torch.nn.Module,
    onnx_path: str | Path,
    *,
    io: IONames,
    last_token_logits: bool = False,
    decode_steps: int = 5,
    seed: int = 0,
) -> float:
    """Max |logit difference| between PyTorch and ONNX Runtime (CPU) over a batch-2, left-padded
    prompt and `decode_steps` one-token steps that feed each side its own cache. last_token_logits
    says how the graph was exported: its logits' second axis is symbolic, so it cannot be read off
    the session. io: the manifest's names for the graph's inputs and outputs."""
    config = model.config
    session = _session(onnx_path)
    generator = torch.Generator().manual_seed(seed)
    prompt_length = min(7, config.n_positions - decode_steps)
    input_ids = torch.randint(0, config.vocab_size, (2, prompt_length), generator=generator)
    attention_mask = torch.ones(2, prompt_length, dtype=torch.long)
    attention_mask[1, :2] = 0  # second row left-padded by two
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)

    layer_types = state_layout(model).get("layer_types")

    def ort_feed(ids, mask, positions, past):
        feed = {io.input_ids: ids.numpy(), io.attention_mask: mask.numpy(), io.position_ids: positions.numpy()}
        return feed | dict(zip(io.past_names(config.n_layer, layer_types), past, strict=True))

    if layer_types is None:
        empty = np.zeros((2, config.n_kv_head, 0, config.head_dim), dtype=np.float32)
        ort_past = [empty] * (2 * config.n_layer)
    else:  # a hybrid model's own empty state, flattened in the graph's order
        ort_past = [t.numpy() for layer in model.empty_state(2) for t in layer]
    torch_past = None
    worst = 0.0
    with _one_thread():
        for _step in range(decode_steps + 1):
            torch_logits, torch_present = model(
                input_ids, attention_mask, position_ids, torch_past, last_token_logits=last_token_logits
            )
            outputs = session.run(None, ort_feed(input_ids, attention_mask, position_ids, ort_past))
            # compare real (unpadded) positions only: padded query rows are never read
            real = attention_mask[:, -input_ids.shape[1] :].bool().numpy()
            if last_token_logits:
                real = real[:, -1:]
            assert outputs[0].shape == tuple(torch_logits.shape), (
                f"ONNX logits {outputs[0].shape} vs PyTorch {tuple(torch_logits.shape)}: compared without broadcasting"
            )
            worst = _worst(worst, outputs[0][real], torch_logits.numpy()[real])
            torch_past, ort_past = torch_present, outputs[1:]
            next_ids = torch_logits[:, -1, :].argmax(-1, keepdim=True)
            input_ids = next_ids
            attention_mask = torch.cat([attention_mask, torch.ones(2, 1, dtype=torch.long)], dim=1)
            position_ids = position_ids[:, -1:] + 1
    return worst


@contextmanager
def _float64(model: torch.nn.Module) -> Iterator[None]:
    """The model in float64 for the duration (fp32 values convert exactly, both ways)."""
    model.double()
    try:
        yield
    finally:
        model.float()


def _reference_steps(model: torch.nn.Module, *, decode_steps: int, seed: int) -> list[dict]:
    """The runs check_parity_shared compares, with PyTorch's float64 logits: a batch of 2 right-padded prompts
    of different lengths with all-position logits, then one-token steps (greedy on the reference). A hybrid
    model's prompts are of one length: right padding would enter its states, so the runtime prefills a batch of
    unequal prompts row by row (runtime/kvcache.py SharedStateCache)."""
    config = model.config
    generator = torch.Generator().manual_seed(seed)
    short = 7 if state_layout(model) else 5
    lengths = [min(7, config.n_positions - decode_steps), min(short, config.n_positions - decode_steps)]
    width = max(lengths)
    input_ids = torch.randint(0, config.vocab_size, (2, width), generator=generator)
    mask = torch.zeros(2, width, dtype=torch.long)
    for row, length in enumerate(lengths):
        mask[row, :length] = 1
    position_ids = torch.arange(width).unsqueeze(0).expand(2, width) * mask  # padding at position 0
    steps = []
    with _one_thread(), _float64(model):
        logits, past = model(input_ids, mask, position_ids)
        steps.append(dict(ids=input_ids, mask=mask.numpy(), positions=position_ids, keep=0, logits=logits.numpy()))
        steps[0]["real"] = mask.bool().numpy()  # padded query rows are never read
        totals = list(lengths)
        next_ids = torch.stack([logits[row, totals[row] - 1].argmax() for row in range(2)]).unsqueeze(1)
        torch_mask = mask
        for _ in range(decode_steps):
            positions = torch.tensor(totals).unsqueeze(1)  # (2, 1)
            torch_mask = torch.cat([torch_mask, torch.ones(2, 1, dtype=torch.long)], dim=1)
            logits, past = model(next_ids, torch_mask, positions, past)  # its own growing, masked cache
            totals = [t + 1 for t in totals]
            ort_mask = (np.arange(max(totals))[None, :] < np.array(totals)[:, None]).astype(np.int64)
            steps.append(dict(ids=next_ids, mask=ort_mask, positions=positions, keep=1, logits=logits.numpy()))
            next_ids = logits[:, -1, :].argmax(-1, keepdim=True)
    return steps


def check_parity_shared(
    model: torch.nn.Module,
    onnx_path: str | Path,
    *,
    io: IONames,
    decode_steps: int = 5,
    seed: int = 0,
    prepacking: bool = False,
) -> float:
    """Max |logit difference| between ONNX Runtime, run the way the runtime runs the fused graph (the
    cache one buffer per layer bound as both past and present, num_logits_to_keep 1 after the prompt), and
    the PyTorch model on the same rows in float64: the exact answer for the weights, so the figure is ONNX
    Runtime's float32 rounding alone, not the sum of two float32 roundings. io: the manifest's names, its
    logits_to_keep among them."""
    config = model.config
    steps = _reference_steps(model, decode_steps=decode_steps, seed=seed)
    # after the float64 pass, so the two copies of the weights are not held at once
    session = _session(onnx_path, prepacking=prepacking)
    uses_positions = io.position_ids in {i.name for i in session.get_inputs()}  # rotary graphs have none
    capacity = steps[0]["ids"].shape[1] + decode_steps
    binding = session.io_binding()
    binding.bind_output(io.logits)  # first, so it is get_outputs()[0]; allocated by each run
    layout = state_layout(model)
    layer_types = layout.get("layer_types")
    past, present = io.past_names(config.n_layer, layer_types), io.present_names(config.n_layer, layer_types)
    states = []  # a hybrid's states: [past name, present name, past value, present value], swapped after a run
    kinds = [kind for layer in layer_types or ["full_attention"] * config.n_layer for kind in LAYER_STATES[layer]]
    for past_name, present_name, kind in zip(past, present, kinds, strict=True):
        if kind in ("conv", "recurrent"):
            values = [
                ort.OrtValue.ortvalue_from_numpy(np.zeros((2, *layout[f"{kind}_state"]), np.float32)) for _ in "ab"
            ]
            states.append([past_name, present_name, *values])
            continue
        zeros = np.zeros((2, config.n_kv_head, capacity, config.head_dim), dtype=np.float32)
        buffer = ort.OrtValue.ortvalue_from_numpy(zeros)
        binding.bind_ortvalue_input(past_name, buffer)
        binding.bind_ortvalue_output(present_name, buffer)

    worst = 0.0
    for step in steps:
        binding.bind_cpu_input(io.input_ids, step["ids"].numpy())
        binding.bind_cpu_input(io.attention_mask, step["mask"])
        if uses_positions:
            binding.bind_cpu_input(io.position_ids, step["positions"].numpy())
        # an overridable initializer: IO binding takes it as an OrtValue, not through bind_cpu_input
        keep = ort.OrtValue.ortvalue_from_numpy(np.array(step["keep"], dtype=np.int64))
        binding.bind_ortvalue_input(io.logits_to_keep, keep)
        binding.bind_output(io.logits)  # unallocated again: its length changes between calls
        for state in states:
            binding.bind_ortvalue_input(state[0], state[2])
            binding.bind_ortvalue_output(state[1], state[3])
            state[2], state[3] = state[3], state[2]  # the present is the next run's past
        session.run_with_iobinding(binding)
        logits = binding.get_outputs()[0].numpy()
        assert logits.shape == step["logits"].shape, f"ONNX logits {logits.shape} vs {step['logits'].shape}"
        real = step.get("real", np.ones(logits.shape[:2], dtype=bool))
        worst = _worst(worst, logits[real], step["logits"][real])
    return worst
