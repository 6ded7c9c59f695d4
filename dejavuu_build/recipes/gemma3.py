"""Gemma 3 text decoders: interleaved sliding-window layers that must keep their window in tree mode."""

from .base import Recipe, register


@register
class Gemma3Recipe(Recipe):
    name = "gemma3"
    architectures = ("Gemma3ForCausalLM",)
    model_types = ("gemma3_text", "gemma3")
    description = "Gemma 3 text (sliding-window + global layers, local RoPE base, scaled embeddings)"
    handles = frozenset({"sliding_window", "local_rope_base"})

    def text_config(self, config):
        return getattr(config, "text_config", None) or config

    def tiny_config(self):
        from transformers import Gemma3TextConfig

        # A window of 8 so tests cross it with short prompts; every other layer slides.
        return Gemma3TextConfig(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=16,
            max_position_embeddings=512,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"] * 2,
            query_pre_attn_scalar=16,
            tie_word_embeddings=True,
            architectures=["Gemma3ForCausalLM"],
            eos_token_id=[1, 106],
            bos_token_id=2,
        )
