"""The fused graph's mechanisms, one module per kind of token mixer or layer part: its config part (a dataclass a
Layer or Decoder holds, export/decoder.py), its graph step (a function given the builder, export/graph.py) and,
where the traced graph needs one, its placeholder (export/traced.py).

    attention.py        GroupQueryAttention on the packed Q/K/V product: per-head norms, an output gate, rotary
                        positions, sliding windows, KV sharing (a layer reading an earlier layer's cache)
    short_conv.py       a short gated convolution (com.microsoft CausalConvWithState), its state past.%d.conv
    delta_net.py        Gated DeltaNet (CausalConvWithState and com.microsoft GatedDeltaNet), its conv and
                        recurrent states, and the traced graph's placeholder for the rule
    per_layer_input.py  per-layer input embeddings: the table's rows for every layer, and each layer's step
"""
