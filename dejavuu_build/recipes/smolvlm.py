"""The text backbone of SmolVLM / Idefics3 checkpoints: a Llama decoder fed ids or embeddings."""

from .base import Recipe, register


def _text_lm(vlm):
    """Text model + lm-head of a VLM, with the CausalLM forward signature the export wrapper uses.
    Defined inside a function so importing the recipe registry never imports torch."""
    from types import SimpleNamespace

    import torch

    from ..transformers_compat import cache_of

    class TextLM(torch.nn.Module):
        def __init__(self, vlm):
            super().__init__()
            self.model = vlm.model.text_model
            self.lm_head = vlm.lm_head
            self.config = vlm.config.text_config

        def get_input_embeddings(self):
            return self.model.get_input_embeddings()

        def forward(self, input_ids=None, inputs_embeds=None, **kw):
            out = self.model(input_ids=input_ids, inputs_embeds=inputs_embeds, **kw)
            cache = cache_of(out)  # under both names: callers read the one their transformers uses
            return SimpleNamespace(
                logits=self.lm_head(out.last_hidden_state),
                hidden_states=out.hidden_states,
                cache=cache,
                past_key_values=cache,
            )

    return TextLM(vlm)


@register
class SmolVLMRecipe(Recipe):
    name = "smolvlm"
    architectures = ("SmolVLMForConditionalGeneration", "Idefics3ForConditionalGeneration")
    model_types = ("smolvlm", "idefics3")
    description = "SmolVLM / Idefics3 text backbone (input_ids or inputs_embeds)"
    vlm = True

    def text_causal_lm(self, model):
        return _text_lm(model)

    def text_config(self, config):
        return config.text_config

    def image_tokens(self) -> dict[str, str]:
        return {
            "image_token": "<image>",
            "fake_image_token": "<fake_token_around_image>",
            "global_image_token": "<global-img>",
        }

    def default_processor_config(self, dims: dict) -> dict:
        """SmolVLM's processor defaults, sized to this vision tower."""
        from transformers.models.smolvlm.image_processing_smolvlm import SmolVLMImageProcessor

        size = dims["image_size"]
        return SmolVLMImageProcessor(size={"longest_edge": 4 * size}, max_image_size={"longest_edge": size}).to_dict()

    def tiny_config(self):
        from transformers import LlamaConfig, SmolVLMConfig
        from transformers.models.smolvlm.configuration_smolvlm import SmolVLMVisionConfig

        text = LlamaConfig(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            tie_word_embeddings=False,
            eos_token_id=2,
        )
        vision = SmolVLMVisionConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=32,
            patch_size=8,
        )
        return SmolVLMConfig(
            text_config=text.to_dict(),
            vision_config=vision.to_dict(),
            scale_factor=2,
            image_token_id=250,
            architectures=["SmolVLMForConditionalGeneration"],
        )

    def tiny_model(self, seed: int = 0):
        import torch
        from transformers import SmolVLMForConditionalGeneration

        torch.manual_seed(seed)
        return SmolVLMForConditionalGeneration(self.tiny_config()).eval()
