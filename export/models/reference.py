"""What the reference models (export/models/: gpt2.py, llama.py; the hybrids lfm2.py and qwen35.py) share: one call,

    logits, present = model(input_ids, attention_mask, position_ids, past_key_values)

its inputs' defaults, the additive attention bias, and greedy generation, the reference the runtime's tokens
are checked against. Past keys/values go in and present keys/values come out as tensors, (B, kv heads,
past + T, head_dim) per layer: exactly what the ONNX graph exposes.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..lazy_weights import weights_stream

Past = list[tuple[torch.Tensor, torch.Tensor]]


def forward_inputs(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    past_key_values: Past | None,
) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(past length, attention_mask (B, past + T), position_ids (B, T)): the mask all ones and the positions
    past .. past + T - 1 where they are not given."""
    B, T = input_ids.shape
    past_length = 0 if past_key_values is None else past_key_values[0][0].shape[2]
    total = past_length + T
    if attention_mask is None:
        attention_mask = torch.ones(B, total, dtype=torch.long, device=input_ids.device)
    if position_ids is None:
        position_ids = torch.arange(past_length, total, device=input_ids.device).unsqueeze(0).expand(B, T)
    return past_length, attention_mask, position_ids


def attention_bias(
    attention_mask: torch.Tensor,
    past_length: int,
    T: int,
    window: int | None = None,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Additive bias (B, 1, T, past + T): 0 where query i (absolute position past + i) may see key j, that is
    j <= past + i and key j is not padding; a large finite negative number elsewhere (so a fully padded row
    gives a uniform softmax, not NaN). A sliding layer (window, position_ids (B, T)) also hides keys whose
    position is `window` or more before the query's: positions, not slots, as a right-padded row's cache has
    padding slots between its prompt and the tokens generated after it."""
    device = attention_mask.device
    query_pos = torch.arange(T, device=device).unsqueeze(1) + past_length  # (T, 1)
    key_pos = torch.arange(past_length + T, device=device).unsqueeze(0)  # (1, past + T)
    allowed = (key_pos <= query_pos).unsqueeze(0) & attention_mask.bool().unsqueeze(1)  # (B, T, past + T)
    if window is not None:
        key_positions = attention_mask.long().cumsum(-1) - 1  # (B, past + T): each real key's position
        allowed = allowed & (key_positions.unsqueeze(1) > position_ids.unsqueeze(-1) - window)
    bias = torch.zeros(allowed.shape, dtype=torch.float32, device=device)
    return bias.masked_fill(~allowed, torch.finfo(torch.float32).min).unsqueeze(1)


class ReferenceModel(nn.Module):
    """The base of the reference models: the parameter count and greedy generation over `forward`."""

    streaming = False  # inside lazy_weights.weights_stream

    def __call__(self, *args, **kwargs):
        """A model with lazy weights (export/lazy_weights.py) computes in float32 from its weights read module by
        module (each call reads them again: for checks on small models; export's proof streams in float64)."""
        if self.streaming or not any(p.is_meta for p in self.parameters()):
            return super().__call__(*args, **kwargs)
        with weights_stream(self, torch.float32):
            return super().__call__(*args, **kwargs)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())  # tied weights are counted once

    @torch.no_grad()
    def generate_greedy(self, input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """Greedy decoding with the KV cache; the reference the runtime's tokens are checked against."""
        logits, past = self(input_ids)
        tokens = []
        next_token = logits[:, -1, :].argmax(dim=-1, keepdim=True)  # (B, 1)
        for step in range(max_new_tokens):
            tokens.append(next_token)
            if step == max_new_tokens - 1:
                break
            logits, past = self(next_token, past_key_values=past)
            next_token = logits[:, -1, :].argmax(dim=-1, keepdim=True)
        return torch.cat(tokens, dim=1) if tokens else input_ids[:, :0]


State = list[tuple[torch.Tensor, ...]]  # per layer: (key, value) for attention, the states for the others


class StateReferenceModel(ReferenceModel):
    """The forward of the hybrid reference models (export/models/lfm2.py, qwen35.py), whose layers keep either
    keys and values or a fixed state: each defines config.layer_types, empty_state(batch), inv_freq (rotary
    frequencies), model.embed_tokens, model.layers (blocks called as block(x, bias, cos, sin, mask, past)),
    final_norm and lm_head."""

    ATTENTION = "full_attention"

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: State | None = None,
        *,
        last_token_logits: bool = False,
    ) -> tuple[torch.Tensor, State]:
        """input_ids (B, T); attention_mask (B, past + T), 1 = real token; position_ids (B, T); past_key_values:
        a tuple per layer (empty_state's shapes). Returns logits (B, T, vocab) and the new state."""
        B, T = input_ids.shape
        past = self.empty_state(B) if past_key_values is None else past_key_values
        kinds = self.config.layer_types
        past_length = next(p[0].shape[2] for p, kind in zip(past, kinds, strict=True) if kind == self.ATTENTION)
        if attention_mask is None:
            attention_mask = torch.ones(B, past_length + T, dtype=torch.long)
        if position_ids is None:
            position_ids = torch.arange(past_length, past_length + T).unsqueeze(0).expand(B, T)
        bias = attention_bias(attention_mask, past_length, T)
        angles = position_ids.unsqueeze(-1).float() * self.inv_freq
        angles = torch.cat([angles, angles], dim=-1).unsqueeze(1)  # (B, 1, T, rotary width)
        cos, sin = angles.cos(), angles.sin()
        mask = attention_mask[:, -T:]
        x = self.model.embed_tokens(input_ids)
        present: State = []
        for block, layer_past in zip(self.model.layers, past, strict=True):
            x, layer_present = block(x, bias, cos, sin, mask, layer_past)
            present.append(layer_present)
        x = self.final_norm(x)
        if last_token_logits:
            x = x[:, -1:, :]
        return self.lm_head(x), present
