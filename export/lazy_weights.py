"""Weights read when they are used, not when the checkpoint is opened: what lets export stream a model bigger
than the memory it may take.

A checkpoint's tensors arrive as `TensorLoader`s (a shape, and a function that reads the tensor from the
safetensors or GGUF file in its own dtype); the reference model is built on the meta device with each
parameter carrying its loader (`lazy_parameter`). Export then reads each weight when it needs it:

- the graph's initializers are `LazyArray`s, read, converted to float32 and written one at a time
  (writers/onnxfile.py save_model);
- the proof runs the reference model in float64 module by module (`float64_stream`): each module's weights are
  read and widened just before its forward and let go after it, a Linear's in slices of its output rows, an
  Embedding's rows gathered, so no float64 (or float32) copy of the whole model is ever held;
- what needs the whole model in memory (LoRA merging, the standard graph's tracing) calls `materialize`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

SLICE_BYTES = 64 << 20  # float64 bytes of a Linear's weight widened at once in float64_stream
SMALL_BYTES = 1 << 20  # arrays below this are read at once (norms, biases), not kept lazy


@dataclass(frozen=True)
class TensorLoader:
    """A tensor not read yet: its shape, and `load()`, which reads it (a new tensor, in the file's dtype)."""

    shape: tuple[int, ...]
    load: Callable[[], torch.Tensor]
    rows: Callable[[torch.Tensor], torch.Tensor] | None = None  # some rows only (an Embedding's lookup), if cheaper
    row_range: Callable[[int, int], torch.Tensor] | None = None  # rows [start, stop) only, if cheaper (row_slices)

    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    # A family's work on its state dict (Phi-3's packed projections split, a GGUF file's squeezed axis put back)
    # takes loaders as it takes tensors: these shape operations give loaders of their results, nothing read.
    @property
    def ndim(self) -> int:
        return len(self.shape)

    def dim(self) -> int:
        return len(self.shape)

    def derived(self, change: Callable[[torch.Tensor], torch.Tensor]) -> TensorLoader:
        """The loader of `change(tensor)` (a view, a slice, a reshaping): its shape found on the meta device."""
        shape = tuple(change(torch.empty(self.shape, device="meta")).shape)
        return TensorLoader(shape, lambda: change(self.load()))

    def t(self) -> TensorLoader:
        return self.derived(torch.Tensor.t)

    def unsqueeze(self, dim: int) -> TensorLoader:
        return self.derived(lambda x: x.unsqueeze(dim))

    def reshape(self, *shape: int) -> TensorLoader:
        return self.derived(lambda x: x.reshape(*shape))

    def __getitem__(self, index) -> TensorLoader:
        return self.derived(lambda x: x[index])

    def split(self, sizes: int | list[int], dim: int = 0) -> tuple[TensorLoader, ...]:
        count = len(torch.empty(self.shape, device="meta").split(sizes, dim))
        return tuple(self.derived(lambda x, i=i: x.split(sizes, dim)[i]) for i in range(count))

    def chunk(self, chunks: int, dim: int = 0) -> tuple[TensorLoader, ...]:
        count = len(torch.empty(self.shape, device="meta").chunk(chunks, dim))
        return tuple(self.derived(lambda x, i=i: x.chunk(chunks, dim)[i]) for i in range(count))


def lazy_parameter(loader: TensorLoader) -> torch.nn.Parameter:
    """A meta-device parameter of the loader's shape that remembers how to read its values."""
    parameter = torch.nn.Parameter(torch.empty(loader.shape, device="meta"), requires_grad=False)
    parameter.loader = loader
    return parameter


def is_lazy(tensor: torch.Tensor) -> bool:
    return tensor.is_meta and hasattr(tensor, "loader")


def read(tensor: torch.Tensor) -> torch.Tensor:
    """A parameter's values: read from its file when lazy, else the tensor itself (detached)."""
    if tensor.is_meta:
        assert is_lazy(tensor), "a meta tensor without a loader has no values"
        return tensor.loader.load()
    return tensor.detach()


class LazyArray:
    """An array read when written (np.asarray calls `load`): what a Decoder holds for a large weight, float32 unless
    `dtype` says otherwise."""

    def __init__(
        self,
        shape: tuple[int, ...],
        load: Callable[[], np.ndarray],
        dtype: type = np.float32,
        chunks: Callable[[], Iterator[np.ndarray]] | None = None,
        rows: Callable[[int, int], np.ndarray] | None = None,
    ):
        """chunks: the array's slices along its first axis, in order, made one at a time; save_model writes a large
        array that way rather than all of it at once. rows: rows [start, stop) alone, where that is cheaper than
        all (a GGUF file's tensor whose rows are its own); `T` keeps it as `columns`."""
        self.shape, self.load, self.chunks, self.rows = tuple(shape), load, chunks, rows
        self.columns: Callable[[int, int], np.ndarray] | None = None  # of a transposed one: its columns' rows
        self.dtype = np.dtype(dtype)
        self.ndim = len(self.shape)
        self.size = int(np.prod(self.shape, dtype=np.int64))

    @property
    def T(self) -> LazyArray:  # noqa: N802 (numpy's name)
        transposed = LazyArray(tuple(reversed(self.shape)), lambda: self.load().T, self.dtype)
        transposed.columns = self.rows  # columns [start, stop) of the transpose, as rows (start..stop, K)
        return transposed

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        array = np.asarray(self.load(), dtype=self.dtype)
        assert array.shape == self.shape, f"a LazyArray of shape {self.shape} read {array.shape}"
        return array if dtype is None else array.astype(dtype, copy=False)


def float32_array(tensor: torch.Tensor) -> np.ndarray | LazyArray:
    """A parameter as the Decoder holds it: a LazyArray when it is lazy and large, else a float32 array."""
    if is_lazy(tensor) and tensor.numel() * 4 >= SMALL_BYTES:
        some = tensor.loader.row_range
        rows = None if some is None else lambda start, stop: some(start, stop).to(torch.float32).numpy()
        return LazyArray(tuple(tensor.shape), lambda: read(tensor).to(torch.float32).numpy(), rows=rows)
    return read(tensor).to(torch.float32).cpu().numpy()


def concatenated(arrays: list[np.ndarray | LazyArray]) -> np.ndarray | LazyArray:
    """Arrays joined along their first axis; lazily when one of them is lazy."""
    if not any(isinstance(a, LazyArray) for a in arrays):
        return np.concatenate(arrays)
    shape = (sum(a.shape[0] for a in arrays), *arrays[0].shape[1:])
    return LazyArray(shape, lambda: np.concatenate([np.asarray(a) for a in arrays]))


def lazy_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    return [(name, p) for name, p in model.named_parameters() if is_lazy(p)]


def materialize(model: torch.nn.Module) -> None:
    """Read every lazy parameter into memory as float32 (tied parameters stay one): for the paths that need the
    whole model (LoRA merging, tracing the standard graph)."""
    done: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, parameter in list(module._parameters.items()):
            if parameter is None or not is_lazy(parameter):
                continue
            if id(parameter) not in done:
                done[id(parameter)] = torch.nn.Parameter(read(parameter).to(torch.float32).contiguous())
            module._parameters[name] = done[id(parameter)]


def row_slices(tensor: torch.Tensor, row_bytes: int) -> Iterator[torch.Tensor]:
    """A tensor's values in slices along its first axis, each about SLICE_BYTES when a row takes `row_bytes` (as
    the caller converts it). Read slice by slice where its loader can (a GGUF file's blocks: its whole tied head
    would be 1 GB of float32 at 1B, and twice that again in gguf-py's dequantizers' temporaries), else read whole
    and sliced."""
    step = max(1, SLICE_BYTES // row_bytes)
    loader = tensor.loader if is_lazy(tensor) else None
    if loader is not None and loader.row_range is not None:
        for i in range(0, tensor.shape[0], step):
            yield loader.row_range(i, min(i + step, tensor.shape[0]))
        return
    weight = read(tensor)
    if weight.ndim == 0:
        yield weight
        return
    for i in range(0, weight.shape[0], step):
        yield weight[i : i + step]


def _linear(module: torch.nn.Linear, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    """A Linear's forward in `dtype`, its weight read (where it can be) and converted a slice of output rows at a
    time."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        # weight (out, in): slices of rows, the file's dtype
        parts = [x @ part.to(dtype).T for part in row_slices(module.weight, 8 * module.weight.shape[1])]
        y = torch.cat(parts, dim=-1)
        return y if module.bias is None else y + read(module.bias).to(dtype)

    return forward


def _embedding(module: torch.nn.Embedding, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    """An Embedding's forward in `dtype`: only the rows asked for are converted."""

    def forward(ids: torch.Tensor) -> torch.Tensor:
        weight = module.weight
        if is_lazy(weight) and weight.loader.rows is not None:  # only the rows asked for are read
            unique, inverse = torch.unique(ids, return_inverse=True)
            return weight.loader.rows(unique).to(dtype)[inverse]
        return F.embedding(ids, read(weight)).to(dtype)

    return forward


@contextmanager
def float64_stream(model: torch.nn.Module) -> Iterator[None]:
    """weights_stream in float64, the proof's reference: the exact answer for the weights. A model with no lazy
    weights (a family that reads its weights whole) is converted whole, for the duration, instead."""
    if lazy_parameters(model):
        with weights_stream(model, torch.float64):
            yield
        return
    model.double()
    try:
        yield
    finally:
        model.float()


@contextmanager
def weights_stream(model: torch.nn.Module, dtype: torch.dtype) -> Iterator[None]:
    """The model computing in `dtype` (float64: fp32, fp16 and bf16 values widen exactly) while no module holds
    its converted weights longer than its own forward: Linears and Embeddings compute from their weights read in
    slices, other modules' parameters are read and converted by a hook before their forward and dropped after it;
    buffers (rotary frequencies) are converted for the duration."""
    originals: list[tuple[torch.nn.Module, str, dict]] = []  # (module, _buffers or _parameters, as they were)
    handles = []
    for module in model.modules():
        buffers = {k: v for k, v in module._buffers.items() if v is not None and v.is_floating_point()}
        originals.append((module, "_buffers", dict(buffers)))
        for name, value in buffers.items():
            module._buffers[name] = value.to(dtype)
        if isinstance(module, torch.nn.Linear):
            module.forward = _linear(module, dtype)
        elif isinstance(module, torch.nn.Embedding):
            module.forward = _embedding(module, dtype)
        elif any(p is not None for p in module._parameters.values()):
            saved = dict(module._parameters)

            def widen(mod, _args, saved=saved):
                for name, p in saved.items():
                    if p is not None:
                        mod._parameters[name] = torch.nn.Parameter(read(p).to(dtype), requires_grad=False)

            def restore(mod, _args, _output, saved=saved):
                mod._parameters.update(saved)

            originals.append((module, "_parameters", saved))
            handles += [module.register_forward_pre_hook(widen), module.register_forward_hook(restore)]
    model.streaming = True
    try:
        yield
    finally:
        model.streaming = False
        for handle in handles:
            handle.remove()
        for module, kind, saved in originals:
            getattr(module, kind).update(saved)
            module.__dict__.pop("forward", None)
