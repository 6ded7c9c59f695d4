"""What differs between the transformers versions the build supports (4.57 and 5.x), in one place.

Imports nothing heavy at module level: callers pass the objects they already hold.

* The KV cache argument and output field: ``past_key_values`` on 4.x, ``cache`` on 5.x (the old
  name is a deprecated alias there, removed later). Picked from the model's own ``forward``
  signature, so a model class follows its own version.
* The PIL (torchvision-free) SmolVLM image processor: ``SmolVLMImageProcessor`` on 4.x,
  ``SmolVLMImageProcessorPil`` on 5.x (where the plain name needs torchvision).
"""

from __future__ import annotations

import inspect
from typing import Any

CACHE_NAMES = ("cache", "past_key_values")


def cache_argument(model: Any) -> str:
    """The keyword ``model``'s forward takes its KV cache under: ``cache`` (transformers 5.x) or
    ``past_key_values`` (4.x). A wrapper that only passes ``**kwargs`` through is looked through to
    the module it wraps (``.model``, then ``.language_model`` / ``.text_model``)."""
    seen = 0
    m = model
    while m is not None and seen < 8:
        params = inspect.signature(type(m).forward).parameters
        for name in CACHE_NAMES:
            if name in params:
                return name
        m = next((getattr(m, a) for a in ("model", "language_model", "text_model") if hasattr(m, a)), None)
        seen += 1
    import transformers

    return "cache" if int(transformers.__version__.split(".")[0]) >= 5 else "past_key_values"


def cache_of(output: Any) -> Any:
    """The KV cache a forward returned, under whichever name its transformers gives it (reading
    ``past_key_values`` on 5.x would log a deprecation warning)."""
    c = getattr(output, "cache", None)
    return c if c is not None else getattr(output, "past_key_values", None)


def pil_image_processor_class() -> Any:
    """transformers' PIL-based SmolVLM image processor class (what ``runtime/image.py`` ports)."""
    try:  # transformers 5.x: the plain class is the torchvision backend
        from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil

        return SmolVLMImageProcessorPil
    except ImportError:
        from transformers.models.smolvlm.image_processing_smolvlm import SmolVLMImageProcessor

        return SmolVLMImageProcessor
