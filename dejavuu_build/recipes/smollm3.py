"""SmolLM3: a Llama-like decoder where every 4th layer has no RoPE (NoPE), optionally with sliding
windows on those layers (``use_sliding_window``)."""

from .base import Recipe, register


@register
class SmolLM3Recipe(Recipe):
    name = "smollm3"
    architectures = ("SmolLM3ForCausalLM",)
    model_types = ("smollm3",)
    description = "SmolLM3 (NoPE layers without rotary embedding; optional sliding windows)"
    handles = frozenset({"nope_layers", "sliding_window", "rope:yarn"})

    def tiny_config(self):
        # (the package root does not list it for type checkers; this is where it lives)
        from transformers.models.smollm3 import SmolLM3Config

        # Layer 1 without RoPE (SmolLM3-3B: every 4th; every 2nd keeps the test small), a window of 12
        # on that layer and YaRN over an original length of 32 (SmolLM3's long-context setting), all
        # crossed by the gates.
        return SmolLM3Config(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            no_rope_layer_interval=2,
            use_sliding_window=True,
            sliding_window=12,
            rope_scaling={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 32},
            tie_word_embeddings=True,
            architectures=["SmolLM3ForCausalLM"],
            eos_token_id=2,
            bos_token_id=1,
            pad_token_id=0,
        )
