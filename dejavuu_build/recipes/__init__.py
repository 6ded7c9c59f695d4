"""Model-family recipes, registered by name. ``recipe_for(config)`` refuses unknown architectures."""

# Importing a family module registers it (base.registered() relies on this package importing them all).
from . import gemma3, llama, mistral, phi3, qwen, smollm3, smolvlm  # noqa: F401
from .base import Recipe, recipe_for, register, registered, supported_architectures

__all__ = ["Recipe", "recipe_for", "register", "registered", "supported_architectures"]
