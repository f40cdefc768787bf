"""The rotary cos and sin tables as the fused graph computes them (export/graph.py `_rotary_tables`, folded by ONNX
Runtime at session start) against the tables export stored before (export/models/llama.py `rope_cos_sin`), in float32
and through the float16 conversion; and a long-context package that holds no table of its positions."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from edgelm.export.decoder import Rotary
from edgelm.export.families.llama import decoder
from edgelm.export.graph import _GraphBuilder, _rotary_tables, build_fused_graph
from edgelm.export.models.llama import PRESETS, Llama, LlamaConfig, rope_cos_sin, rope_inv_freq, rotary_factor
from edgelm.runtime.contract import LOGITS_TO_KEEP, IONames
from edgelm.writers.float16 import half_graph
from edgelm.writers.onnxfile import save_model

CONTEXT = 1 << 17  # Llama 3's 131072 positions: angles up to 131071 radians
LLAMA3 = dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=8192)  # fmt: skip
LONGROPE = dict(rope_type="longrope", short_factor=[1.0, 1.1, 1.3, 1.6], long_factor=[2.0, 3.0, 5.0, 8.0],
                original_max_position_embeddings=4096, attention_factor=1.19)  # fmt: skip


def _config(**overrides) -> LlamaConfig:
    return LlamaConfig(**PRESETS["tiny"] | dict(n_positions=CONTEXT) | overrides)


def _tables(rotary: Rotary, positions: int, tmp_path, *, half: bool = False) -> list[np.ndarray]:
    """The graph's cos and sin tables, run by ONNX Runtime (its float16 conversion first where `half`)."""
    g = _GraphBuilder(accuracy_level=4, compact=True)
    names = _rotary_tables(g, rotary, positions, "rotary")
    dtype = TensorProto.FLOAT16 if half else TensorProto.FLOAT
    outputs = [helper.make_tensor_value_info(name, dtype, None) for name in names]
    graph = helper.make_graph(g.weight_nodes + g.nodes, "tables", [], outputs, g.initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    if half:
        model, converted = half_graph(model)
        assert converted == [], "the frequencies stay float32"
    save_model(model, tmp_path / "tables.onnx", weights=g.weights)
    return ort.InferenceSession(str(tmp_path / "tables.onnx"), providers=["CPUExecutionProvider"]).run(None, {})


@pytest.mark.parametrize(
    "config, kwargs",
    [
        (_config(n_embd=128, n_head=1, n_kv_head=1, rope_theta=5e5, rope_scaling=LLAMA3), {}),
        (_config(n_positions=1 << 15, n_embd=256, n_head=1, n_kv_head=1), {"local": True}),  # Gemma 3's head
    ],
    ids=["llama3-131072", "gemma3-local-32768"],
)  # fmt: skip
def test_graph_tables_match_the_stored_ones_within_one_ulp(config, kwargs, tmp_path):
    factor = 1.0 if kwargs else rotary_factor(config)
    cos, sin = _tables(Rotary(rope_inv_freq(config, **kwargs).numpy(), factor=factor), config.n_positions, tmp_path)
    reference = [t.numpy() for t in rope_cos_sin(config, config.n_positions, **kwargs)]
    # measured: 1.19e-07 at most (ONNX Runtime's float32 Cos/Sin against torch's); 80-87% of the values identical
    for ours, theirs in zip((cos, sin), reference, strict=True):
        assert ours.shape == theirs.shape == (config.n_positions, config.rotary_dim // 2)
        assert np.abs(ours - theirs).max() <= 2.4e-7


def test_longrope_tables_stack_long_after_short_times_the_factor(tmp_path):
    config = _config(n_positions=1 << 13, rope_scaling=LONGROPE)
    rotary = Rotary(rope_inv_freq(config).numpy(), factor=rotary_factor(config),
                    long_inv_freq=rope_inv_freq(config, long=True).numpy(), long_after=4096)  # fmt: skip
    cos, sin = _tables(rotary, config.n_positions, tmp_path)
    short, long = rope_cos_sin(config, config.n_positions), rope_cos_sin(config, config.n_positions, long=True)
    assert cos.shape == (2 * config.n_positions, config.rotary_dim // 2)
    assert np.abs(cos - np.concatenate([short[0], long[0]])).max() <= 2.4e-7
    assert np.abs(sin - np.concatenate([short[1], long[1]])).max() <= 2.4e-7


def test_float16_tables_are_computed_in_float32(tmp_path):
    """Positions past 65504 are not finite in float16 and past 2048 not exact: the conversion keeps the table nodes
    float32 and only the tables become float16, as the float32 tables rounded."""
    config = _config(rope_scaling=LLAMA3)
    cos, sin = _tables(Rotary(rope_inv_freq(config).numpy()), CONTEXT, tmp_path, half=True)
    assert cos.dtype == np.float16
    for ours, theirs in zip((cos, sin), rope_cos_sin(config, CONTEXT), strict=True):
        assert np.abs(ours.astype(np.float32) - theirs.numpy()).max() <= 2.0**-11  # float16's rounding near 1


def test_a_long_context_package_holds_no_table_of_its_positions():
    model = Llama(_config(rope_scaling=LLAMA3))
    graph, weights = build_fused_graph(decoder(model), IONames(position_ids=None, logits_to_keep=LOGITS_TO_KEEP))
    assert not [name for name, array in weights.items() if CONTEXT in np.shape(array)]
    assert sum(np.asarray(array).nbytes for array in weights.values()) < 1 << 20  # 0.05M parameters
    assert {"Cos", "Sin", "Range"} <= {node.op_type for node in graph.graph.node}
