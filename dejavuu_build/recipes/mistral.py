"""Mistral: a Llama-like decoder whose every layer may attend within ``sliding_window`` keys."""

from .base import Recipe, register


@register
class MistralRecipe(Recipe):
    name = "mistral"
    architectures = ("MistralForCausalLM",)
    model_types = ("mistral",)
    description = "Mistral decoders (sliding window on every layer when the config sets one)"
    handles = frozenset({"sliding_window"})

    def mask_argument(self, bias, sliding):
        # MistralModel takes one 4D mask for all layers (no per-layer-type dict): the narrowed one
        # when the config has a window, since then every layer slides.
        return bias if sliding is None else sliding

    def tiny_config(self):
        from transformers import MistralConfig

        # A window of 12 so the gates' 48+ token chain and trees cross it.
        return MistralConfig(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=512,
            sliding_window=12,
            tie_word_embeddings=False,
            architectures=["MistralForCausalLM"],
            eos_token_id=2,
            bos_token_id=1,
        )
