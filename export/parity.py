"""Export's proof: ONNX Runtime against the PyTorch reference model on the same inputs, a padded
batch's prompt and then decode steps, each side with its own cache. Export fails when the largest
logit difference passes the tolerance (llm.c checks its C forward against PyTorch the same way).

The reference models of every family share one call, model(input_ids, attention_mask, position_ids,
past) -> (logits, present), and one config vocabulary (n_layer, n_kv_head, head_dim, n_positions,
vocab_size), which is all these checks use.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from ..runtime import packed
from ..runtime.contract import Architecture, IONames, cache_records
from ..runtime.session import reclaiming_read_pages
from .checkpoint import CheckpointError
from .lazy_weights import float64_stream
from .traced import cache_architecture, state_layout


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


def _session(
    onnx_path: str | Path, *, prepacking: bool = False, half: bool = False, converted_for: Path | None = None
) -> ort.InferenceSession:
    """prepacking: as the runtime runs it; needed where a kernel's fast path exists only for prepacked weights
    (MatMulNBits' int8-activation path, accuracy_level 4). Off, no second copy of the float weights is made.

    half: a float16 graph. The CPU provider has no float16 MatMul and runs one through a Cast of each input to
    float32; its optimizer folds the weights' Casts into a float32 copy of every weight at session start, and
    unoptimized, the default order runs every weight's Cast first (they wait on no input), so all the copies
    are alive at once. Unoptimized, in priority order and without the arena, each weight's Cast runs next to its
    MatMul and its float32 output is freed after it: at most one weight's float32 copy is alive (the same logits
    to the bit; docs/results.md, "Every family streams")."""
    options = ort.SessionOptions()
    options.log_severity_level = 3  # not the notice that num_logits_to_keep, an input, is not folded
    if not prepacking:
        options.add_session_config_entry("session.disable_prepacking", "1")
    if half:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        options.execution_order = ort.ExecutionOrder.PRIORITY_BASED
        options.enable_cpu_mem_arena = options.enable_mem_pattern = False
    if converted_for is not None:  # a packed package's fallback graph (its float twin): arrays from its blocks
        prepared = packed.fallback(converted_for, options, "the proof's float twin", graph=Path(onnx_path))
    else:
        prepared = packed.prepare(Path(onnx_path), options, ["CPUExecutionProvider"])  # kept raw blocks: their ops
    with reclaiming_read_pages(Path(onnx_path).parent) if prepacking else nullcontext():
        session = ort.InferenceSession(str(prepared.model_path), options, providers=["CPUExecutionProvider"])
    packed.opened(session, prepared)
    return session


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
    arch = cache_architecture(model)

    def ort_feed(ids, mask, positions, past):
        feed = {io.input_ids: ids.numpy(), io.attention_mask: mask.numpy(), io.position_ids: positions.numpy()}
        return feed | dict(zip(arch.past_names(io), past, strict=True))

    if layer_types is None:
        ort_past = [np.zeros(arch.cache_shape(kind, 2, layer), np.float32) for layer, kind in arch.cache_layers()]
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


def _layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The reference model's list of decoder layers (its ModuleList of n_layer blocks)."""
    n_layer = model.config.n_layer
    return next(m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == n_layer)


def _prompts(config, *, decode_steps: int, seed: int, short: int = 5) -> tuple[torch.Tensor, list[int]]:
    """A batch of 2 right-padded prompts, of 7 and `short` tokens: ids (2, width) and the rows' lengths. A hybrid
    model's prompts are of one length (short 7): right padding would enter its states, so the runtime prefills a
    batch of unequal prompts row by row (runtime/statecache.py SharedStateCache)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = [min(7, config.n_positions - decode_steps), min(short, config.n_positions - decode_steps)]
    return torch.randint(0, config.vocab_size, (2, max(lengths)), generator=generator), lengths


def _right_padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, mask, positions) of a right-padded batch; padding at position 0."""
    width = max(len(row) for row in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)], mask[i, : len(row)] = torch.tensor(row), 1
    return ids, mask, torch.arange(width).unsqueeze(0).expand(len(rows), width) * mask


def _reference_logits(
    model: torch.nn.Module, rows: list[list[int]], *, on_layer: Callable[[], None] | None = None
) -> np.ndarray:
    """PyTorch's float64 logits (rows, longest, V) at every position of each row, in one pass without a cache:
    the exact answer the graph's prompt and cached decode steps are compared with. on_layer: called after each
    layer's forward (progress)."""

    def after_layer(*_) -> None:  # returns None: a forward hook's result would replace the layer's output
        on_layer()

    handles = [] if on_layer is None else [block.register_forward_hook(after_layer) for block in _layers(model)]
    ids, mask, positions = _right_padded(rows)
    try:
        with _one_thread(), float64_stream(model):
            return model(ids, mask, positions)[0].numpy()
    finally:
        for handle in handles:
            handle.remove()


def check_parity_shared(
    model: torch.nn.Module,
    onnx_path: str | Path,
    *,
    io: IONames,
    decode_steps: int = 5,
    seed: int = 0,
    prepacking: bool = False,
    on_step: Callable[[], None] | None = None,
) -> float:
    """Max |logit difference| between ONNX Runtime, run the way the runtime runs the fused graph (the
    cache one buffer per layer bound as both past and present, num_logits_to_keep 1 after the prompt; a batch
    of 2 right-padded prompts, then `decode_steps` greedy one-token steps), and the PyTorch model in float64 on
    the same tokens: the exact answer for the weights, so the figure is ONNX Runtime's float32 rounding alone,
    not the sum of two float32 roundings. The reference computes every position of the prompt and the tokens
    ONNX Runtime chose in one pass, without a cache (one read of a streamed model's weights, not one a step).
    io: the manifest's names, its logits_to_keep among them. on_step: called after each ONNX Runtime step and
    each reference layer (progress)."""
    config = model.config
    layout = state_layout(model)
    ids, lengths = _prompts(config, decode_steps=decode_steps, seed=seed, short=7 if layout.get("layer_types") else 5)
    outputs = _run_session(
        onnx_path, io, config, ids, lengths, decode_steps, layout=layout, prepacking=prepacking, on_step=on_step
    )
    rows = [
        ids[row, :length].tolist() + chosen
        for row, (length, chosen) in enumerate(zip(lengths, outputs["tokens"], strict=True))
    ]
    reference = _reference_logits(model, rows, on_layer=on_step)
    compared, expected = _compared(outputs["logits"], reference, ids.shape[1], lengths)
    return _worst(0.0, compared, expected)


def _compared(
    logits: list[np.ndarray], reference: np.ndarray, width: int, lengths: list[int]
) -> tuple[np.ndarray, np.ndarray]:
    """(positions, V) ONNX Runtime's logits at every real position (the prompt's unpadded ones, then each decode
    step's) and the reference's at the same positions."""
    real = np.arange(width)[None, :] < np.array(lengths)[:, None]
    got, expected = [logits[0][real]], [reference[:, :width][real]]
    for step, step_logits in enumerate(logits[1:]):  # (2, 1, V): the token fed at step `step`
        got.append(step_logits[:, 0])
        expected.append(np.stack([reference[row, length + step] for row, length in enumerate(lengths)]))
    return np.concatenate(got), np.concatenate(expected)


@dataclass(frozen=True)
class Int8Proof:
    """A graph whose matmuls round activations to int8 (MatMulNBits accuracy_level 4), proved in two parts on one
    token sequence. Its float twin (the same graph, every MatMulNBits at accuracy level 0) against the float64
    reference proves the graph: a wrong rotary, norm, head order, mask or scale moves logits far past float32's
    rounding (`float_max_abs`). The graph as shipped against the same reference bounds what int8 rounding does to
    the model's next-token distributions (KL(reference || graph) in nats, top-1 agreement): a model with massive
    activations or a large logit scale moves its logits by more than any fixed bound (Gemma 3 270M's by 11) and
    its distributions barely, while a broken int8 path scrambles them."""

    float_max_abs: float  # max |logit difference|, float twin vs float64
    int8_max_abs: float  # the same for the graph as shipped (reported, not bounded)
    mean_kl: float  # nats, over every compared position
    max_kl: float
    top1_agreement: float  # fraction of positions whose argmax is the reference's
    positions: int
    reference_peak: float  # max |reference logit|: float32's rounding grows with it


def _kl(reference: np.ndarray, logits: np.ndarray) -> np.ndarray:
    """KL(softmax(reference) || softmax(logits)) per row, in float64 nats."""

    def log_softmax(x: np.ndarray) -> np.ndarray:
        x = x.astype(np.float64)
        x = x - x.max(axis=-1, keepdims=True)
        return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))

    p_log = log_softmax(reference)
    return (np.exp(p_log) * (p_log - log_softmax(logits))).sum(axis=-1)


def check_parity_int8(
    model: torch.nn.Module,
    onnx_path: str | Path,
    float_twin: str | Path,
    *,
    io: IONames,
    decode_steps: int = 5,
    seed: int = 0,
    on_step: Callable[[], None] | None = None,
) -> Int8Proof:
    """The two-part proof of an int8-activation graph (Int8Proof), run as check_parity_shared runs one graph: the
    float twin chooses the greedy tokens, the shipped graph is fed the same ones, and one float64 reference pass
    serves both."""
    config = model.config
    layout = state_layout(model)
    ids, lengths = _prompts(config, decode_steps=decode_steps, seed=seed, short=7 if layout.get("layer_types") else 5)
    run = dict(layout=layout, prepacking=True, on_step=on_step)
    twin = _run_session(float_twin, io, config, ids, lengths, decode_steps, converted_for=twin_of(onnx_path), **run)
    shipped = _run_session(onnx_path, io, config, ids, lengths, decode_steps, forced=twin["tokens"], **run)
    rows = [
        ids[row, :length].tolist() + chosen
        for row, (length, chosen) in enumerate(zip(lengths, twin["tokens"], strict=True))
    ]
    reference = _reference_logits(model, rows, on_layer=on_step)
    float_logits, expected = _compared(twin["logits"], reference, ids.shape[1], lengths)
    int8_logits, _ = _compared(shipped["logits"], reference, ids.shape[1], lengths)
    float_max_abs = _worst(0.0, float_logits, expected)
    int8_max_abs = _worst(0.0, int8_logits, expected)
    if not np.isfinite(int8_max_abs):
        kl = np.full(len(expected), np.inf)
    else:
        kl = _kl(expected, int8_logits)
    return Int8Proof(
        float_max_abs=float_max_abs,
        int8_max_abs=int8_max_abs,
        mean_kl=float(kl.mean()),
        max_kl=float(kl.max()),
        top1_agreement=float((int8_logits.argmax(-1) == expected.argmax(-1)).mean()),
        positions=len(expected),
        reference_peak=float(np.abs(expected).max()),
    )


def twin_of(shipped: str | Path) -> Path | None:
    """The packed package whose fallback graph a float twin of `shipped` is (its arrays converted from the
    package's blocks), or None: the twin reads the shipped graph's own weights."""
    return Path(shipped) if packed.uses_packed(Path(shipped)) else None


def window_rows(model: torch.nn.Module) -> int | None:
    """The prompt length that puts a sliding window's edge inside the proof (the window + 8), where the
    model has windows and a float64 pass over that many tokens costs at most WINDOW_BUDGET multiply-adds; None:
    no windows, or too large a model (its family's tiny models prove the window's graph step instead)."""
    sliding = "sliding_attention" in (getattr(model.config, "layer_types", None) or ())
    window = getattr(model.config, "sliding_window", None)
    if not sliding or not isinstance(window, int) or window <= 0:
        return None
    if state_layout(model).get("layer_types") is not None:  # a hybrid's states: no windows
        return None
    length = window + 8
    if length > model.config.n_positions - 1:
        return None
    parameters = sum(p.numel() for p in model.parameters())
    return length if parameters * length <= WINDOW_BUDGET else None


WINDOW_BUDGET = 1e12  # multiply-adds of the window check's float64 pass (Gemma 3 270M at 520 tokens: 1.4e11)


def check_window(
    model: torch.nn.Module,
    onnx_path: str | Path,
    *,
    io: IONames,
    length: int,
    seed: int = 1,
    converted_for: Path | None = None,
) -> float:
    """Max |logit difference| at the last position of two random prompts of `length` tokens, longer than the
    model's smallest sliding window: a window one position off changes what that position attends to. A float
    graph (or an int8 graph's float twin) against the float64 reference, the last position's logits only."""
    config = model.config
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (2, length), generator=generator)
    layout = state_layout(model)
    outputs = _run_session(
        onnx_path, io, config, ids, [length, length], 0, layout=layout, prepacking=True, on_step=None, keep_first=1,
        converted_for=converted_for,
    )  # fmt: skip
    mask = torch.ones_like(ids)
    positions = torch.arange(length).unsqueeze(0).expand(2, length)
    with _one_thread(), float64_stream(model):
        reference = model(ids, mask, positions, None, last_token_logits=True)[0].numpy()
    return _worst(0.0, outputs["logits"][0][:, -1], reference[:, -1])


def _run_session(
    onnx_path: str | Path,
    io: IONames,
    config,
    ids: torch.Tensor,
    lengths: list[int],
    decode_steps: int,
    *,
    layout: dict,
    prepacking: bool,
    on_step: Callable[[], None] | None,
    forced: list[list[int]] | None = None,
    keep_first: int = 0,
    converted_for: Path | None = None,
) -> dict:
    """ONNX Runtime's logits for the prompt and each greedy decode step, and the tokens it chose (per row);
    layout: a hybrid's states (traced.state_layout). forced: the tokens each row is fed instead (another run's
    choices), so two graphs are compared on the same sequence. keep_first: the prompt's logits_to_keep (0: every
    position). converted_for: the packed package whose fallback graph `onnx_path` is."""
    half = io.kv_dtype == "float16"  # an fp16 graph: its cache, states and logits are half too
    session = _session(onnx_path, prepacking=prepacking, half=half, converted_for=converted_for)
    uses_positions = io.position_ids in {i.name for i in session.get_inputs()}  # rotary graphs have none
    capacity = ids.shape[1] + decode_steps
    binding = session.io_binding()
    binding.bind_output(io.logits)  # first, so it is get_outputs()[0]; allocated by each run
    arch = Architecture(
        type="", vocab_size=config.vocab_size, context_length=config.n_positions, n_layer=config.n_layer,
        n_head=config.n_head, n_kv_head=config.n_kv_head, head_dim=config.head_dim, **cache_records(layout),
    )  # fmt: skip
    past, present = arch.past_names(io), arch.present_names(io)
    states = []  # a hybrid's states: [past name, present name, past value, present value], swapped after a run
    dtype = np.float16 if half else np.float32
    for past_name, present_name, (layer, kind) in zip(past, present, arch.cache_layers(), strict=True):
        if kind in ("conv", "recurrent"):
            values = [ort.OrtValue.ortvalue_from_numpy(np.zeros((2, *layout[f"{kind}_state"]), dtype)) for _ in "ab"]
            states.append([past_name, present_name, *values])
            continue
        zeros = np.zeros(arch.cache_shape(kind, 2, layer, capacity), dtype=dtype)
        buffer = ort.OrtValue.ortvalue_from_numpy(zeros)
        binding.bind_ortvalue_input(past_name, buffer)
        binding.bind_ortvalue_output(present_name, buffer)
    _, mask, positions = _right_padded([ids[row, :length].tolist() for row, length in enumerate(lengths)])
    feed, keep, totals = ids, keep_first, list(lengths)
    all_logits, tokens = [], [[], []]
    for step in range(decode_steps + 1):
        binding.bind_cpu_input(io.input_ids, feed.numpy())
        binding.bind_cpu_input(io.attention_mask, mask.numpy())
        if uses_positions:
            binding.bind_cpu_input(io.position_ids, positions.numpy())
        # an overridable initializer: IO binding takes it as an OrtValue, not through bind_cpu_input
        binding.bind_ortvalue_input(io.logits_to_keep, ort.OrtValue.ortvalue_from_numpy(np.array(keep, np.int64)))
        binding.bind_output(io.logits)  # unallocated again: its length changes between calls
        for state in states:
            binding.bind_ortvalue_input(state[0], state[2])
            binding.bind_ortvalue_output(state[1], state[3])
            state[2], state[3] = state[3], state[2]  # the present is the next run's past
        session.run_with_iobinding(binding)
        logits = binding.get_outputs()[0].numpy()
        all_logits.append(logits)
        if on_step is not None:
            on_step()
        if step == decode_steps:
            break
        last = [logits[row, totals[row] - 1] if keep == 0 else logits[row, -1] for row in range(2)]
        chosen = [int(np.argmax(row_logits)) for row_logits in last] if forced is None else [r[step] for r in forced]
        for row, token in enumerate(chosen):
            tokens[row].append(token)
        feed, keep = torch.tensor(chosen).unsqueeze(1), 1
        positions = torch.tensor(totals).unsqueeze(1)  # (2, 1)
        totals = [t + 1 for t in totals]
        mask = torch.from_numpy((np.arange(max(totals))[None, :] < np.array(totals)[:, None]).astype(np.int64))
    return {"logits": all_logits, "tokens": tokens}
