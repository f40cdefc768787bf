"""export_package's defaults that the CLI states in its help, defined once and importable without torch or onnx
(a runtime-only install still prints `edgelm export --help`)."""

PARITY_TOLERANCE = 1e-4  # max |logit difference| of a float package against PyTorch (float64 reference)
# Kept GGUF blocks with float activations: ONNX Runtime's 4-bit kernel sums in its own order, a few times
# further from float64 than a float MatMul (1.1e-4 on SmolLM2-135M).
KEPT_FLOAT_TOLERANCE = 1e-3
# MatMulNBits at accuracy_level 4 quantizes each block of activations to int8 at run time, which PyTorch does not.
# No bound on logits separates that rounding from a wrong graph (it moves Gemma 3 270M's logits by 11, SmolLM2's by
# 2), so such a graph is proved in two parts (export/parity.py Int8Proof): its float twin (accuracy level 0)
# within KEPT_FLOAT_TOLERANCE, and the graph as shipped within these bounds on KL(reference || graph), in nats,
# over the compared positions. Measured: docs/export.md, "The proof".
INT8_MEAN_KL = 0.25
# The float twin's tolerance is KEPT_FLOAT_TOLERANCE for logits of up to this size, and in proportion past it.
LOGIT_PEAK = 32.0
# The proof past a sliding window (a prompt of window + 8 tokens) allows this many times the float tolerance: its
# float32 sums run over hundreds of positions. Gemma 3 270M: 8.9e-4 correct, 0.156 with the window one too wide.
WINDOW_SLACK = 4.0
INT8_MAX_KL = 2.0
# export --quantize fp16: float16 weights and activations throughout (about 3 significant digits), against the
# float64 reference on the checkpoint's own weights: like the int8 one, a guard against a wrong graph.
FP16_TOLERANCE = 1.0
DEFAULT_OPSET = 17
# "fused": ONNX Runtime's GroupQueryAttention and a shared KV buffer (export/graph.py), the fast graph;
# "standard": the traced graph of standard ONNX ops only, for runtimes other than ONNX Runtime.
ATTENTION_KINDS = ("fused", "standard")
