"""Qwen2 and Qwen3 (Qwen3 adds q/k RMSNorm; both may declare sliding-window layers)."""

from .base import Recipe, register


@register
class Qwen2Recipe(Recipe):
    name = "qwen2"
    architectures = ("Qwen2ForCausalLM",)
    model_types = ("qwen2",)
    description = "Qwen2 / Qwen2.5 decoders (sliding windows on the layers past max_window_layers)"
    handles = frozenset({"sliding_window"})

    def tiny_config(self):
        from transformers import Qwen2Config

        # Layer 1 slides (window 12, crossed by the gates), layer 0 attends to everything.
        return Qwen2Config(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            use_sliding_window=True,
            sliding_window=12,
            max_window_layers=1,
            tie_word_embeddings=False,
            architectures=["Qwen2ForCausalLM"],
            eos_token_id=2,
        )


@register
class Qwen3Recipe(Qwen2Recipe):
    name = "qwen3"
    architectures = ("Qwen3ForCausalLM",)
    model_types = ("qwen3",)
    description = "Qwen3 decoders (q/k norm)"

    def tiny_config(self):
        from transformers import Qwen3Config

        return Qwen3Config(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=512,
            tie_word_embeddings=True,
            use_sliding_window=True,
            sliding_window=12,
            max_window_layers=1,
            architectures=["Qwen3ForCausalLM"],
            eos_token_id=2,
        )
