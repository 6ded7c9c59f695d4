"""The one export wrapper: any registered family -> (logits, hidden_states, present KV).

Graph I/O (names from ``dejavuu_build.schema``):
    inputs : input_ids [1,N] | inputs_embeds [1,N,H], position_ids [1,N],
             attention_bias [1,1,N,P+N] (additive float mask: 0 visible, very negative hidden),
             past_key_values.{i}.key|value [1,KV,P,D]
    outputs: logits [1,N,V], hidden_states [1,N,H], present.{i}.key|value [1,KV,P+N,D]

The caller's mask is used as-is (a chain or a tree). Sliding-window layers get that mask
narrowed in-graph by key/query positions: past keys sit at positions 0..P-1 (the runtime keeps
the committed sequence contiguous) and new keys at ``position_ids``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.cache_utils import DynamicCache

ATTN_IMPL = "dejavuu_gqa_sdpa"


def _gqa_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
              softcap=None, **_: Any):
    """SDPA with K/V heads left un-expanded (enable_gqa): the exporter emits one ONNX Attention
    taking the grouped K/V directly, instead of repeat_kv's Expand nodes (faster at long past)."""
    if softcap is not None:
        raise NotImplementedError("attention logit soft-capping is not supported by the fused export")
    gqa = key.shape[1] != query.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=gqa)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTN_IMPL, _gqa_sdpa)


class DecoderWrapper(nn.Module):
    def __init__(self, causal_lm: nn.Module, num_layers: int, sliding_windows: list[int | None],
                 mask_argument, hidden_layer: int = -1, primary: str = "input_ids"):
        super().__init__()
        self.lm = causal_lm
        self.num_layers = num_layers
        self.windows = sliding_windows
        self.mask_argument = mask_argument
        self.hidden_layer = hidden_layer
        self.primary = primary

    def _sliding_bias(self, bias, position_ids):
        window = next((w for w in self.windows if w), None)
        if window is None:
            return None
        # past length from the bias (P + N wide), not from the past tensors: in the static KV
        # flavour those are the whole preallocated buffer.
        past = torch.arange(bias.shape[3] - position_ids.shape[1], device=bias.device, dtype=position_ids.dtype)
        k_pos = torch.cat([past, position_ids[0]])                       # [T]
        q_pos = position_ids[0]                                          # [N]
        too_far = (q_pos[:, None] - k_pos[None, :]) >= window            # [N, T]
        neg = torch.finfo(bias.dtype).min
        return torch.where(too_far[None, None], torch.full_like(bias, neg), bias)

    def forward(self, primary, position_ids, attention_bias, *past):
        cache = DynamicCache()
        for i in range(self.num_layers):
            cache.update(past[2 * i], past[2 * i + 1], i)
        sliding = self._sliding_bias(attention_bias, position_ids)
        kw = {self.primary: primary}
        cfg = self.lm.config
        prev, cfg._attn_implementation = cfg._attn_implementation, ATTN_IMPL  # only while we run
        try:
            out = self.lm(**kw, position_ids=position_ids, attention_mask=self.mask_argument(attention_bias, sliding),
                          past_key_values=cache, use_cache=True, output_hidden_states=True, return_dict=True)
        finally:
            cfg._attn_implementation = prev
        hidden = out.hidden_states[self.hidden_layer]
        presents = []
        for i in range(self.num_layers):
            layer = cache.layers[i]
            presents += [layer.keys, layer.values]
        return (out.logits, hidden, *presents)
