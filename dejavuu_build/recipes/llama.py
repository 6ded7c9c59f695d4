"""Llama family: SmolLM2 and the SmolVLM2 text backbone."""

from .base import Recipe, register


@register
class LlamaRecipe(Recipe):
    name = "llama"
    architectures = ("LlamaForCausalLM",)
    model_types = ("llama",)
    description = "Llama-style decoders (SmolLM2, the SmolVLM2 text backbone)"

    def tiny_config(self):
        from transformers import LlamaConfig

        return LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                           tie_word_embeddings=True, rope_theta=10000.0, architectures=["LlamaForCausalLM"],
                           eos_token_id=2, bos_token_id=1)
