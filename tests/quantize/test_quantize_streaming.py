"""Quantize and eval at any size: the recipes work on the graph with the weights read one tensor at a time and
give exactly what onnxruntime's own tools give on the whole model; static calibration keeps running ranges;
eval tokenizes and scores its text piece by piece with the numbers of a direct computation on full logits."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from edgelm.runtime import load

REPO = Path(__file__).resolve().parents[2]
BUNDLED = REPO / "models" / "shakespeare"
HELDOUT = REPO / "data" / "shakespeare-heldout.txt"
CALIBRATION = REPO / "data" / "shakespeare-calibration.txt"


@pytest.fixture(scope="module")
def fp32_package(tmp_path_factory) -> Path:
    from edgelm.export.onnx_export import export_package

    out = tmp_path_factory.mktemp("stream") / "fp32"
    export_package(BUNDLED, out, progress=lambda _: None)
    return out


@pytest.fixture(scope="module")
def int4_package(fp32_package) -> Path:
    from edgelm.quantize.quantize import quantize_package

    out = fp32_package.parent / "int4"
    quantize_package(fp32_package, out, mode="int4", evaluate=False, progress=lambda _: None)
    return out


def _contents(model: onnx.ModelProto) -> tuple[dict, list]:
    weights = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    nodes = [
        (n.op_type, n.name, list(n.input), list(n.output), [str(a) for a in n.attribute]) for n in model.graph.node
    ]
    return weights, nodes


def _assert_same(ours: Path, reference: onnx.ModelProto) -> None:
    weights, nodes = _contents(onnx.load(str(ours)))
    ref_weights, ref_nodes = _contents(reference)
    assert nodes == ref_nodes
    assert weights.keys() == ref_weights.keys()
    for name, value in ref_weights.items():
        assert weights[name].dtype == value.dtype and np.array_equal(weights[name], value), name


def _reference(mode: str, src: Path, scratch: Path) -> onnx.ModelProto:
    """What onnxruntime's tools make of the whole model loaded in memory (the recipes before streaming)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
    from onnxruntime.transformers.float16 import convert_float_to_float16

    from edgelm.quantize import recipes
    from edgelm.quantize.tied_embedding import share_int8_embedding, tied_gathers

    model = onnx.load(str(src))
    if mode == "fp16":
        return convert_float_to_float16(model, keep_io_types=False, disable_shape_infer=True)
    tied = {g.input[0] for g in tied_gathers(model)}
    if mode == "dynamic":
        scratch.mkdir()
        for name in ("model.onnx", "model.onnx.data"):  # the tool writes beside its input
            shutil.copyfile(src.parent / name, scratch / name)
        quantize_dynamic(
            str(scratch / "model.onnx"),
            str(scratch / "out.onnx"),
            per_channel=True,
            reduce_range=True,
            weight_type=QuantType.QInt8,
            op_types_to_quantize=["MatMul"],
            nodes_to_quantize=recipes._linear_matmuls(model),
            extra_options={"MatMulConstBOnly": True, "DefaultTensorType": onnx.TensorProto.FLOAT},
        )
        quantized = onnx.load(str(scratch / "out.onnx"))
        share_int8_embedding(quantized, {t: (f"{t}_quantized", f"{t}_scale", f"{t}_zero_point") for t in tied})
        return quantized
    bits = {"int4": 4, "int8-weight-only": 8}[mode]
    options = dict(is_symmetric=True, accuracy_level=4, op_types_to_quantize=("MatMul",))
    head = recipes._lm_head(model)
    width = next(
        i.dims[0] for n in model.graph.node if n.name == head for i in model.graph.initializer if i.name == n.input[1]
    )
    first = MatMulNBitsQuantizer(model, bits=bits, block_size=32, nodes_to_exclude=[head], **options)
    first.process()
    quantized = first.model.model
    # the head at 8 bits either way, in blocks of 128 where they divide its inputs
    second = MatMulNBitsQuantizer(quantized, bits=8, block_size=128 if width % 128 == 0 else 32, **options)
    second.process()
    quantized = second.model.model
    recipes._gather_tied_from_nbits(quantized)
    return quantized


@pytest.mark.parametrize(
    ("mode", "slab"),
    [("int4", None), ("int4", 1 << 16), ("int8-weight-only", None), ("dynamic", None), ("fp16", 1 << 16)],
)
def test_recipes_equal_onnxruntime_tools_on_the_whole_model(fp32_package, tmp_path, monkeypatch, mode, slab):
    """slab: the weights read 64 KiB at a time (several slabs a weight), as a large model's are."""
    from edgelm.quantize import weights
    from edgelm.quantize.recipes import RECIPES, Options

    if slab is not None:
        monkeypatch.setattr(weights, "SLAB_BYTES", slab)
    src = fp32_package / "model.onnx"
    RECIPES[mode].run(src, tmp_path / "model.onnx", Options())
    _assert_same(tmp_path / "model.onnx", _reference(mode, src, tmp_path / "scratch"))


@pytest.mark.parametrize("mode", ["int4", "int8-weight-only", "dynamic", "static", "fp16"])
def test_quantize_never_loads_the_weights_as_a_whole(fp32_package, tmp_path, monkeypatch, mode):
    """What lets a package past protobuf's 2 GB limit quantize in bounded memory: onnx.load with the weights
    (what the quantizers did) is never called; the package still runs."""
    from edgelm.quantize.quantize import quantize_package

    def refuse(*args, **kwargs):
        raise AssertionError("the model's weights were loaded as a whole")

    monkeypatch.setattr(onnx, "load_external_data_for_model", refuse)
    out = tmp_path / mode
    quantize_package(
        fp32_package,
        out,
        mode=mode,
        calibration_text=CALIBRATION,
        calibration_samples=2,
        evaluate=False,
        progress=lambda _: None,
    )
    if mode != "fp16":  # fp16 is for GPUs
        assert load(out, provider="cpu").generate("ROMEO:\n", 4).token_ids


def test_static_minmax_ranges_equal_onnxruntime_calibrator(fp32_package, tmp_path):
    """Running min/max over the feeds, one at a time, gives onnxruntime's MinMaxCalibrater's ranges on the same
    feeds."""
    from onnxruntime.quantization import CalibrationDataReader
    from onnxruntime.quantization.calibrate import CalibrationMethod, create_calibrator

    from edgelm.quantize import recipes
    from edgelm.quantize.calibration import DecoderCalibrationReader, calibrated_ranges
    from edgelm.quantize.weights import SourceModel

    class Recording(DecoderCalibrationReader):
        """The feeds as calibrated_ranges made them (each decode step's cache from its own session's run)."""

        def feeds(self):
            inner, sent, self.seen = super().feeds(), None, []
            while True:
                try:
                    feed = inner.send(sent)
                except StopIteration:
                    return
                self.seen.append(feed)
                sent = yield feed

    class Replay(CalibrationDataReader):
        def __init__(self, feeds):
            self.feeds = iter(feeds)

        def get_next(self):
            return next(self.feeds, None)

    source_model = load(fp32_package, provider="cpu")
    ids = np.array(source_model.tokenizer.encode(CALIBRATION.read_text(encoding="utf-8")[:20_000]), dtype=np.int64)
    reader = Recording(source_model, ids, samples=3)
    source = SourceModel(fp32_package / "model.onnx")
    head = recipes._lm_head(source.model)
    blocks = [n for n in recipes._linear_matmuls(source.model) if n != head]
    ours = calibrated_ranges(source, reader, nodes=blocks, method="minmax")

    for name in ("model.onnx", "model.onnx.data"):
        shutil.copyfile(fp32_package / name, tmp_path / name)
    calibrator = create_calibrator(
        tmp_path / "model.onnx",
        ["MatMul"],
        augmented_model_path=str(tmp_path / "augmented.onnx"),
        calibrate_method=CalibrationMethod.MinMax,
        use_external_data_format=True,
        extra_options={"symmetric": False},
    )
    calibrator.collect_data(Replay(reader.seen))
    theirs = calibrator.compute_data()
    names = list(ours.keys())
    assert len(names) == 4 * 4  # c_attn, c_proj, c_fc, mlp.c_proj inputs of 4 blocks (two share one input)
    for name in names:
        for value, expected in zip(ours[name].range_value, theirs[name].range_value, strict=True):
            # ours runs without prepacked weights (no second copy of them): MLAS's other MatMul path, a last bit apart
            assert value.dtype == expected.dtype, name
            np.testing.assert_allclose(value, expected, rtol=1e-5, err_msg=name)


def test_static_calibration_never_loads_the_source_package(fp32_package, tmp_path, monkeypatch):
    """The recipe's one session runs the calibration feeds and gives each its cache: no runtime session of the fp32
    package is built beside it (which held a second copy of its weights), and the ranges are the same."""
    from edgelm.quantize import quantize

    loaded = []
    original = quantize.load
    monkeypatch.setattr(quantize, "load", lambda path, **kw: loaded.append(Path(path)) or original(path, **kw))
    out = tmp_path / "static"
    quantize.quantize_package(
        fp32_package, out, mode="static", calibration_text=CALIBRATION, calibration_samples=2, progress=lambda _: None
    )
    assert fp32_package not in loaded and loaded  # only the smoke test of the new package
    assert load(out, provider="cpu").generate("ROMEO:\n", 4).token_ids


# ---- eval ----------------------------------------------------------------------------------------


def _metaspace_tokenizer(text: str):
    """A SentencePiece-style tokenizer (Metaspace, first word marked) trained on text, wrapped as the runtime's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from edgelm.runtime.text import Tokenizer as RuntimeTokenizer

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tokenizer.decoder = decoders.Metaspace(prepend_scheme="first")
    tokenizer.train_from_iterator([text], trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>"]))
    wrapped = RuntimeTokenizer.__new__(RuntimeTokenizer)
    wrapped._tokenizer = tokenizer
    return wrapped


UNICODE = "naïve café — 日本語のテキスト 🙂🙂 x\n\n\n   spaced    out\t\ttabs " * 40


@pytest.mark.parametrize("kind", ["bundled", "metaspace"])
@pytest.mark.parametrize("chunk", [7, 61, 500])
def test_token_stream_equals_the_whole_texts_tokens(fp32_package, monkeypatch, kind, chunk):
    from edgelm.quantize import evaluate

    text = HELDOUT.read_text(encoding="utf-8")[:6000] + UNICODE
    tokenizer = load(fp32_package).tokenizer if kind == "bundled" else _metaspace_tokenizer(text)
    monkeypatch.setattr(evaluate, "TOKEN_MARGIN", 8)
    monkeypatch.setattr(evaluate, "CONTEXT_TOKENS", 4)
    pieces = (text[i : i + chunk] for i in range(0, len(text), chunk))
    assert list(evaluate.token_stream(tokenizer, pieces)) == tokenizer.encode(text)


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def _direct(model, ref, ids: np.ndarray, plan) -> dict:
    """Perplexity, top-1 agreement and KL from full-window logits in numpy (the computation eval streams)."""
    nll = ref_nll = kl = 0.0
    agree = count = 0
    for start, end, first in plan:
        logits = model.forward(ids[None, start:end])[0][0].astype(np.float64)
        ref_logits = ref.forward(ids[None, start:end])[0][0].astype(np.float64)
        rows, targets = slice(first - start, end - start), ids[first + 1 : end + 1]
        logp, ref_logp = _log_softmax(logits[rows]), _log_softmax(ref_logits[rows])
        nll -= logp[np.arange(len(targets)), targets].sum()
        ref_nll -= ref_logp[np.arange(len(targets)), targets].sum()
        agree += int((logp.argmax(-1) == ref_logp.argmax(-1)).sum())
        kl += float((np.exp(ref_logp) * (ref_logp - logp)).sum())
        count += len(targets)
    return {
        "tokens": count,
        "perplexity": math.exp(nll / count),
        "reference_perplexity": math.exp(ref_nll / count),
        "top1_agreement": agree / count,
        "mean_kl_nats": kl / count,
    }


@pytest.mark.parametrize(("characters", "eval_chunk", "window"), [(300, 256, None), (3000, 48, None), (3000, 256, 40)])
def test_eval_equals_a_direct_computation_on_full_logits(
    fp32_package, int4_package, tmp_path, monkeypatch, characters, eval_chunk, window
):
    """A text inside one window (one run per package, as before streaming), one over several windows fed 48
    tokens at a time through the cache (equal to float noise), and windows of 40 tokens asked for."""
    from edgelm.quantize import evaluate

    text = tmp_path / "text.txt"
    text.write_text(HELDOUT.read_text(encoding="utf-8")[:characters], encoding="utf-8")
    model, ref = load(int4_package), load(fp32_package)
    ids = np.array(model.tokenizer.encode(text.read_text(encoding="utf-8")), dtype=np.int64)
    expected = _direct(model, ref, ids, evaluate.windows(len(ids), window or model.context_length))
    monkeypatch.setattr(evaluate, "EVAL_CHUNK", eval_chunk)
    report = evaluate.evaluate_package(model, text, reference=ref, window=window)
    assert report["tokens"] == expected["tokens"] == len(ids) - 1
    assert report["bytes"] == len(text.read_bytes())
    assert report["window"] == (window or model.context_length)
    tolerance = 1e-5 if eval_chunk < model.context_length else 1e-12
    for key in ("perplexity", "reference_perplexity", "mean_kl_nats"):
        assert report[key] == pytest.approx(expected[key], rel=tolerance), key
    assert report["top1_agreement"] == expected["top1_agreement"]


def test_eval_window_defaults_to_the_context_length_at_most_eval_window(fp32_package, monkeypatch):
    from edgelm.quantize import evaluate
    from edgelm.runtime import InvalidInputError

    model = load(fp32_package)
    assert evaluate._window(model, None, None) == 128  # the bundled model's context
    monkeypatch.setattr(evaluate, "EVAL_WINDOW", 100)
    assert evaluate._window(model, model, None) == 100
    with pytest.raises(InvalidInputError, match="window must be 2 to the context length 128"):
        evaluate._window(model, None, 129)


def test_eval_holds_a_piece_of_the_text_and_logits_at_a_time(fp32_package, tmp_path, monkeypatch):
    """The tokenizer sees the text a chunk at a time and stops when max_tokens are read; the model is fed at
    most EVAL_CHUNK tokens a run (before streaming: the whole text at once, whole windows)."""
    from edgelm.quantize import evaluate

    text = tmp_path / "long.txt"
    text.write_text(HELDOUT.read_text(encoding="utf-8") * 3, encoding="utf-8")
    model = load(fp32_package)
    monkeypatch.setattr(evaluate, "TEXT_CHUNK", 2000)
    monkeypatch.setattr(evaluate, "EVAL_CHUNK", 40)
    tokenized, fed = [], []
    encode, encode_offsets, forward = model.tokenizer.encode, model.tokenizer.encode_offsets, model.forward

    def whole(text, **options):  # a few characters: the leading special ids' probe
        assert len(text) < 100, "the whole text was tokenized"
        return encode(text, **options)

    monkeypatch.setattr(model.tokenizer, "encode", whole)
    monkeypatch.setattr(model.tokenizer, "encode_offsets", lambda t: tokenized.append(len(t)) or encode_offsets(t))
    monkeypatch.setattr(model, "forward", lambda ids, past=None: fed.append(ids.shape[1]) or forward(ids, past))
    report = evaluate.evaluate_package(model, text, max_tokens=700)
    assert report["tokens"] == 700
    assert max(fed) == 40
    assert max(tokenized) < 2000 + 2000  # a chunk and what was held back
    assert sum(tokenized) < len(text.read_text(encoding="utf-8")) / 10  # it stopped after max_tokens


def test_eval_text_that_is_not_utf8_is_one_line(fp32_package, tmp_path, monkeypatch):
    from edgelm.quantize import evaluate

    bad = tmp_path / "latin1.txt"
    bad.write_bytes(("a" * 5000 + "café").encode("latin-1"))
    monkeypatch.setattr(evaluate, "TEXT_CHUNK", 1000)
    with pytest.raises(ValueError, match=r"is not UTF-8 text: bytes at offset 5003"):
        evaluate.evaluate_package(fp32_package, bad)


def test_an_8bit_head_takes_blocks_of_128_where_they_divide_its_inputs() -> None:
    from edgelm.quantize.weight_only import head_block_size

    assert head_block_size(8, 32, 2048) == 128  # Llama-3.2-1B's head: 8.5 bits a weight read, not 10
    assert head_block_size(8, 32, 576) == 32  # SmolLM2's 576 inputs are not whole blocks of 128
    assert head_block_size(4, 32, 2048) == 32  # a 4-bit head keeps the recipe's blocks
    assert head_block_size(8, 256, 2048) == 256  # as do blocks already larger
