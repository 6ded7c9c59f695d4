"""Phi-3 / Phi-3.5: fused qkv and gate_up projections, a sliding window on every layer when the
config sets one (Phi-3-mini-4k: 2047), LongRoPE on the 128k variants.

LongRoPE switches from its short to its long factors when the whole sequence passes
``original_max_position_embeddings`` (transformers picks by ``max(position_ids)`` per forward), which
one static graph with a KV cache cannot reproduce. So a LongRoPE model is exported with its short
factors, which is exact up to that length, and its context (the contract's ``max_positions``, which
the runtime enforces) is capped there: longer prompts are refused, never answered differently.
"""

import copy

from ..log import logger
from .base import Recipe, original_rope_length, register, rope_type


@register
class Phi3Recipe(Recipe):
    name = "phi3"
    architectures = ("Phi3ForCausalLM",)
    model_types = ("phi3",)
    description = "Phi-3 / Phi-3.5 mini (fused qkv, sliding window; LongRoPE capped at its original length)"
    handles = frozenset({"sliding_window", "rope:longrope"})

    def text_config(self, config):
        if rope_type(config) != "longrope":
            return config
        capped = copy.copy(config)  # a shallow copy: only the length limit differs
        capped.max_position_embeddings = original_rope_length(config) or config.max_position_embeddings
        return capped

    def supports(self):
        s = super().supports()
        s["rope"] = s["rope"].replace("longrope", "longrope (context capped at its original length)")
        return s

    def mask_argument(self, bias, sliding):
        return bias if sliding is None else sliding  # one mask for all layers, as in Mistral

    def text_causal_lm(self, model):
        """The model with its rotary module held on the short LongRoPE factors: transformers'
        switch tests ``max(position_ids)`` on the data, which the exporter cannot trace, and within
        the capped context the short factors are what transformers itself uses."""
        rot = getattr(getattr(model, "model", model), "rotary_emb", None)
        if rot is not None and getattr(rot, "rope_type", None) == "longrope":
            logger.warning(
                "LongRoPE: exported with its short factors, exact up to %d positions; the decoder's "
                "context is capped there (the long-factor switch is not exportable)",
                original_rope_length(model.config),
            )
            rot.rope_type = "longrope-short"  # dynamic_rope_update only acts on "longrope"
            rot.inv_freq = rot.original_inv_freq
        return model

    def tiny_config(self):
        """Phi-3.5-mini-like: fused projections, a window of 12 and LongRoPE over an original length
        of 128 (so the tiny model tests the window, the short factors and the cap at once)."""
        from transformers import Phi3Config

        half = 64 // 4 // 2
        return Phi3Config(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            original_max_position_embeddings=128,
            sliding_window=12,
            tie_word_embeddings=False,
            rope_scaling={
                "type": "longrope",
                "short_factor": [1.0 + 0.05 * i for i in range(half)],
                "long_factor": [2.0 + 0.5 * i for i in range(half)],
            },
            architectures=["Phi3ForCausalLM"],
            eos_token_id=2,
            bos_token_id=1,
            pad_token_id=0,
        )
