"""Llama family: SmolLM2, Llama 3.x (its "llama3" RoPE scaling) and the SmolVLM2 text backbone."""

from .base import Recipe, register


@register
class LlamaRecipe(Recipe):
    name = "llama"
    architectures = ("LlamaForCausalLM",)
    model_types = ("llama",)
    description = "Llama-style decoders (SmolLM2, Llama 3.x with llama3 RoPE scaling, the SmolVLM2 text backbone)"
    # llama3 scaling is a fixed transform of the RoPE frequencies: traced as constants, exact at any position.
    handles = frozenset({"rope:llama3"})

    def tiny_config(self, **rope):
        """``rope``: RoPE settings as constructor arguments (``rope_theta``, ``rope_scaling``), which
        every transformers version maps where its models read them (5.x: into ``rope_parameters``;
        setting them on a built 5.x config is ignored or deprecated)."""
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            tie_word_embeddings=True,
            architectures=["LlamaForCausalLM"],
            eos_token_id=2,
            bos_token_id=1,
            **({"rope_theta": 10000.0} | rope),
        )

    def tiny_cases(self):
        # Llama 3.2-like RoPE scaling over an original length of 32, so tests run past it.
        l3 = self.tiny_config(
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        )
        return {"": self.tiny_config(), "llama3": l3}
