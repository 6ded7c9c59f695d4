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

from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.cache_utils import DynamicCache

from ..errors import ExportError
from ..transformers_compat import cache_argument

if TYPE_CHECKING:
    from transformers import PreTrainedModel

ATTN_IMPL = "dejavuu_gqa_sdpa"


class _Masks:
    """The masks the running DecoderWrapper handed to the model, so the attention function can
    check each layer got the one its own ``sliding_window`` argument calls for."""

    bias: Any = None
    sliding: Any = None
    window: int | None = None
    active: bool = False
    qk_scale: float = 1.0  # RoPE attention scaling moved from cos/sin into the softmax scale


_MASKS = _Masks()


def _check_window(module, attention_mask, sliding_window) -> None:
    """A layer that declares a window must get the mask narrowed to exactly that window, and a
    full-attention layer must not get the narrowed one: otherwise the export would silently
    attend differently from the model past the window (the recipe does not map it)."""
    if not _MASKS.active:
        return
    layer = getattr(module, "layer_idx", "?")
    if sliding_window:
        if _MASKS.sliding is None or attention_mask is not _MASKS.sliding or int(sliding_window) != _MASKS.window:
            raise ExportError(
                f"layer {layer} attends within sliding_window={sliding_window} but got "
                + ("an unnarrowed mask" if _MASKS.window is None else f"the mask for window {_MASKS.window}")
                + ": the recipe does not map this model's window"
            )
    elif _MASKS.sliding is not None and attention_mask is _MASKS.sliding:
        raise ExportError(
            f"layer {layer} has full attention but got the sliding-window mask: the recipe's "
            f"mask_argument gives windowed masks to full-attention layers"
        )


def _gqa_sdpa(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout=0.0,
    scaling=None,
    is_causal=None,
    softcap=None,
    sliding_window=None,
    **_: Any,
):
    """SDPA with K/V heads left un-expanded (enable_gqa): the exporter emits one ONNX Attention
    taking the grouped K/V directly, instead of repeat_kv's Expand nodes (faster at long past).
    The window itself is in the mask (``DecoderWrapper._sliding_bias``); ``sliding_window`` is
    only checked against it."""
    if softcap is not None:
        raise NotImplementedError("attention logit soft-capping is not supported by the fused export")
    _check_window(module, attention_mask, sliding_window)
    if _MASKS.active and _MASKS.qk_scale != 1.0 and getattr(module, "use_rope", True):  # not NoPE layers
        scaling = (scaling if scaling is not None else query.shape[-1] ** -0.5) * _MASKS.qk_scale
    gqa = key.shape[1] != query.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=gqa
    )
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTN_IMPL, _gqa_sdpa)


class DecoderWrapper(nn.Module):
    def __init__(
        self,
        causal_lm: PreTrainedModel,
        num_layers: int,
        sliding_windows: list[int | None],
        mask_argument,
        hidden_layer: int = -1,
        primary: str = "input_ids",
    ):
        super().__init__()
        self.lm = causal_lm
        self.num_layers = num_layers
        self.windows = sliding_windows
        self.mask_argument = mask_argument
        self.hidden_layer = hidden_layer
        self.primary = primary
        self.cache_arg = cache_argument(causal_lm)  # "cache" on transformers 5.x, "past_key_values" on 4.x

    def _window(self) -> int | None:
        ws = {int(w) for w in self.windows if w}
        if len(ws) > 1:
            raise ExportError(f"several sliding-window lengths {sorted(ws)} in one model are not supported")
        return ws.pop() if ws else None

    def _sliding_bias(self, bias, position_ids):
        window = self._window()
        if window is None:
            return None
        # past length from the bias (P + N wide), not from the past tensors: in the static KV
        # flavour those are the whole preallocated buffer.
        past = torch.arange(bias.shape[3] - position_ids.shape[1], device=bias.device, dtype=position_ids.dtype)
        k_pos = torch.cat([past, position_ids[0]])  # [T]
        q_pos = position_ids[0]  # [N]
        too_far = (q_pos[:, None] - k_pos[None, :]) >= window  # [N, T]
        neg = torch.finfo(bias.dtype).min
        return torch.where(too_far[None, None], torch.full_like(bias, neg), bias)

    def _unscaled_rope(self) -> list:
        """Rotary modules whose cos/sin carry an attention scaling (YaRN, LongRoPE): q and k are
        both rotated by them, so the factor s moves exactly into the softmax scale as s². Then
        the exporter's fused ``RotaryEmbedding`` pattern (plain cos/sin) matches and the static
        flavour keeps RoPE in its kernel. Only when every rotary module shares one factor."""
        rots = [m for m in self.lm.modules() if hasattr(m, "attention_scaling") and hasattr(m, "inv_freq")]
        # torch types an unknown Module attribute as Tensor | Module; attention_scaling is a float
        scales = {float(m.attention_scaling) for m in rots}  # type: ignore[arg-type]
        if len(scales) != 1 or scales == {1.0}:
            return []
        nope = getattr(self.lm.config, "no_rope_layers", None)
        if nope and not all(nope) and not any(hasattr(m, "use_rope") for m in self.lm.modules()):
            return []  # NoPE layers we could not tell apart: leave the scaling on cos/sin
        return rots

    def forward(self, primary, position_ids, attention_bias, *past):
        cache = DynamicCache()
        for i in range(self.num_layers):
            cache.update(past[2 * i], past[2 * i + 1], i)
        sliding = self._sliding_bias(attention_bias, position_ids)
        kw = {self.primary: primary, self.cache_arg: cache}
        cfg = self.lm.config
        prev, cfg._attn_implementation = cfg._attn_implementation, ATTN_IMPL  # only while we run
        _MASKS.bias, _MASKS.sliding, _MASKS.window, _MASKS.active = attention_bias, sliding, self._window(), True
        rots = self._unscaled_rope()
        saved = [r.attention_scaling for r in rots]
        if rots:
            _MASKS.qk_scale = float(saved[0]) ** 2
            for r in rots:
                r.attention_scaling = 1.0
        try:
            out = self.lm(
                **kw,
                position_ids=position_ids,
                attention_mask=self.mask_argument(attention_bias, sliding),
                use_cache=True,
                output_hidden_states=True,
                return_dict=True,
            )
        finally:
            cfg._attn_implementation = prev
            _MASKS.bias = _MASKS.sliding = _MASKS.window = None
            _MASKS.active, _MASKS.qk_scale = False, 1.0
            for r, a in zip(rots, saved):
                r.attention_scaling = a
        hidden = out.hidden_states[self.hidden_layer]
        presents = []
        for i in range(self.num_layers):
            layer = cache.layers[i]
            presents += [layer.keys, layer.values]
        return (out.logits, hidden, *presents)
