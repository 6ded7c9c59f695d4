"""The torch-free runtime: onnxruntime, numpy and tokenizers only.

from dejavuu_build.runtime import load
model = load("smollm2-135m")
out = model.generate("def add(a, b):", method="pld", tree=True, max_new_tokens=128)
"""

from .model import GenerationResult, Model, load

__all__ = ["load", "Model", "GenerationResult"]
