"""Model-family recipes, registered by name. ``recipe_for(config)`` refuses unknown architectures."""

from .base import Recipe, recipe_for, register, registered, supported_architectures

# Importing a family module registers it.
from . import llama, qwen, gemma3, smolvlm, mistral, phi3, smollm3  # noqa: E402,F401

_load_all = True

__all__ = ["Recipe", "recipe_for", "register", "registered", "supported_architectures"]
