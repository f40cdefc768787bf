"""Calibration for static quantization, shaped the way a decoder LM is really run, in bounded memory.

A decoder sees two kinds of input: the prompt pass (many tokens, empty cache) and decode steps
(one token, a cache of past keys/values). Activation ranges differ between them, so calibrating on
prompt passes alone (what a generic reader does) mis-sizes the decode path. For every sample window
of the calibration text the reader runs the fp32 package itself: one prompt pass over the window's
first part, then a few decode steps, each fed the past keys/values the fp32 model produced. Its feeds
are made one sample at a time, as they are read.

`calibrated_ranges` runs those feeds through the fp32 graph with the activations to calibrate added as
outputs and folds each feed's activations into running statistics, as onnxruntime's calibrators compute
them (a running min and max; for percentile and entropy, its HistogramCollector, which merges histograms
feed by feed), then drops them: memory is one feed's activations plus the histograms, whatever the number
of samples. (onnxruntime's own histogram calibrators keep every feed's activations until the end.) That one
session also gives the reader each run's present keys/values for the next feed, and maps the package's
weights without prepacked copies, so calibration holds the fp32 weights once (mapped from the data file),
not a second session's copy of them.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Generator, Iterator
from dataclasses import dataclass

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper
from onnxruntime.quantization import CalibrationDataReader

from ..runtime import Model
from ..runtime.kvcache import plain_feed
from ..runtime.package import PackageSpec

# onnxruntime's settings for each method (create_calibrator, with quantize's CalibTensorRangeSymmetric=False)
HISTOGRAMS = {
    "percentile": {"num_bins": 2048, "num_quantized_bins": 2048, "percentile": 99.999},
    "entropy": {"num_bins": 128, "num_quantized_bins": 128, "percentile": 99.999},
}


@dataclass(frozen=True)
class PackageFacts:
    """What the reader needs of a package to make its feeds (a runtime Model's spec, uses_position_ids and
    kv_dtype), read without building an ONNX Runtime session: calibrated_ranges runs the feeds."""

    spec: PackageSpec
    uses_position_ids: bool
    kv_dtype: type = np.float32

    @classmethod
    def of(cls, spec: PackageSpec) -> PackageFacts:
        graph = onnx.load(str(spec.model_path), load_external_data=False).graph
        return cls(spec, spec.io.position_ids is not None and spec.io.position_ids in {i.name for i in graph.input})


class DecoderCalibrationReader(CalibrationDataReader):
    """model: a runtime Model, or PackageFacts where only calibrated_ranges runs the feeds."""

    def __init__(
        self, model: Model | PackageFacts, ids: np.ndarray, *, samples: int = 32, decode_steps: int = 4, seed: int = 0
    ):
        if samples < 1:
            raise ValueError(f"calibration samples must be >= 1, got {samples}")
        self.model, self.ids, self.samples, self.decode_steps = model, ids, samples, decode_steps
        window = min(model.spec.arch.context_length, 128)
        rng = np.random.default_rng(seed)
        starts = rng.integers(0, max(1, len(ids) - window), size=samples)
        self.windows = []  # (tokens, prompt length) of each sample
        for start in starts:
            tokens = ids[start : start + window]
            # vary the prompt length so ranges cover short and long prompts and caches
            prompt_length = int(rng.integers(max(1, len(tokens) // 4), len(tokens) - decode_steps + 1))
            self.windows.append((tokens, prompt_length))
        self._iter = None

    def __len__(self) -> int:
        return self.samples * (1 + self.decode_steps)

    def feeds(self) -> Generator[dict, list | None, None]:
        """Every sample's prompt feed and decode-step feeds, made as they are read. Each decode step is fed the
        present keys/values of the run before: those sent back (`send`) by whoever ran the feed, else the
        package's own session's (a runtime Model's forward)."""
        model = self.model
        for tokens, prompt_length in _progress(self.windows, "calibration"):
            prompt = tokens[:prompt_length][None, :]
            past = (yield plain_feed(model, prompt)) or model.forward(prompt)[1]
            for step in range(self.decode_steps):
                step_ids = tokens[prompt_length + step : prompt_length + step + 1][None, :]
                past = (yield plain_feed(model, step_ids, past)) or model.forward(step_ids, past)[1]

    def get_next(self) -> dict | None:
        if self._iter is None:
            self._iter = self.feeds()
        return next(self._iter, None)

    def rewind(self) -> None:
        self._iter = None


def calibrated_ranges(source, reader: DecoderCalibrationReader, *, nodes: list[str], method: str):
    """onnxruntime TensorsData: the range of each named MatMul's activation input (what the QDQ recipe
    quantizes) over the reader's feeds. source: quantize/weights.SourceModel, whose weights the session maps
    from the source package's data file."""
    from onnxruntime.quantization.calibrate import CalibrationMethod, HistogramCollector, TensorsData

    wanted = set(nodes)
    tensors = list(dict.fromkeys(n.input[0] for n in source.model.graph.node if n.name in wanted))
    session = _session(source, tensors)
    if method == "minmax":
        lowest, highest = {}, {}
        for outputs in _runs(session, tensors, reader):
            for name, value in zip(tensors, outputs, strict=True):
                # onnxruntime's ReduceMin / ReduceMax, reshaped to (1,), then nanmin / nanmax over the runs
                low, high = np.nanmin(value).reshape(1), np.nanmax(value).reshape(1)
                lowest[name] = low if name not in lowest else np.nanmin([lowest[name], low], axis=0)
                highest[name] = high if name not in highest else np.nanmax([highest[name], high], axis=0)
        return TensorsData(CalibrationMethod.MinMax, {name: (lowest[name], highest[name]) for name in tensors})
    collector = HistogramCollector(method=method, symmetric=False, scenario="same", **HISTOGRAMS[method])
    for outputs in _runs(session, tensors, reader):
        with contextlib.redirect_stdout(io.StringIO()):  # it prints a line on every call
            collector.collect({name: np.ravel(value) for name, value in zip(tensors, outputs, strict=True)})
    calibration = {"percentile": CalibrationMethod.Percentile, "entropy": CalibrationMethod.Entropy}[method]
    return TensorsData(calibration, collector.compute_collection_result())


def _runs(session: ort.InferenceSession, tensors: list[str], reader: DecoderCalibrationReader) -> Iterator[list]:
    """`tensors`' values on each of the reader's feeds, run once each: the run's present keys/values go back to
    the reader for its next feed."""
    spec = reader.model.spec
    present = spec.io.present_names(spec.arch.n_layer, spec.arch.states.layer_types)
    feeds = reader.feeds()
    feed = next(feeds, None)
    while feed is not None:
        outputs = session.run([*tensors, *present], feed)
        yield outputs[: len(tensors)]
        feed = _send(feeds, outputs[len(tensors) :])


def _send(feeds: Generator, present: list) -> dict | None:
    try:
        return feeds.send(present)
    except StopIteration:
        return None


def _session(source, tensors: list[str]) -> ort.InferenceSession:
    """The source graph with `tensors` as extra outputs, its weights mapped from the source's data file."""
    model = onnx.ModelProto()
    model.CopyFrom(source.model)  # the graph only: loaded without its weights
    model.graph.output.extend(helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None) for name in tensors)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # as onnxruntime's calibrators
    options.add_session_config_entry("session.disable_prepacking", "1")  # the mapped weights, no packed copies
    options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(source.path.parent))
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _progress(iterable, desc: str):
    try:
        from tqdm import tqdm
    except ModuleNotFoundError:
        return iterable
    return tqdm(iterable, desc=desc, unit="sample", leave=False, disable=None)
