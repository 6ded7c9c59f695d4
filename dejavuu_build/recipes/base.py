"""A recipe says how one model family becomes a tree-capable decoder: its hooks, nothing generic.

Recipes import torch/transformers lazily, so `dejavuu-build recipes` and the runtime stay light.
"""

from __future__ import annotations

from typing import Any, ClassVar

from ..errors import UnsupportedArchitecture

_REGISTRY: dict[str, type["Recipe"]] = {}


def register(cls: type["Recipe"]) -> type["Recipe"]:
    """Class decorator: register a recipe under its ``name``."""
    if cls.name in _REGISTRY:
        raise ValueError(f"recipe {cls.name!r} registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def registered() -> dict[str, type["Recipe"]]:
    from . import _load_all  # noqa: F401 - importing the package registers every family

    return dict(_REGISTRY)


def supported_architectures() -> list[str]:
    return sorted({a for r in registered().values() for a in r.architectures})


def recipe_for(config: Any) -> "Recipe":
    """The recipe for a transformers config, by architecture name then model_type; refuse unknowns."""
    archs = list(getattr(config, "architectures", None) or [])
    mtype = getattr(config, "model_type", None)
    recipes = registered()
    for a in archs:
        for r in recipes.values():
            if a in r.architectures:
                return r()
    for r in recipes.values():
        if mtype in r.model_types:
            return r()
    what = ", ".join(archs) or str(mtype)
    raise UnsupportedArchitecture(
        f"unsupported architecture {what}; supported recipes: "
        + "; ".join(f"{n} ({', '.join(r.architectures)})" for n, r in sorted(recipes.items()))
    )


class Recipe:
    """Hooks a family overrides. Defaults fit Llama-like decoders."""

    name: ClassVar[str] = ""
    architectures: ClassVar[tuple[str, ...]] = ()
    model_types: ClassVar[tuple[str, ...]] = ()
    description: ClassVar[str] = ""

    # --- model -------------------------------------------------------------------------
    def text_causal_lm(self, model: Any) -> Any:
        """The causal LM whose forward gives logits (for VLMs: the text backbone + lm-head)."""
        return model

    def text_config(self, config: Any) -> Any:
        return config

    def sliding_windows(self, config: Any) -> list[int | None]:
        """Per-layer sliding window (None = full attention)."""
        tc = self.text_config(config)
        window = getattr(tc, "sliding_window", None)
        types = getattr(tc, "layer_types", None)
        n = tc.num_hidden_layers
        if not window or not types:
            return [None] * n
        return [int(window) if t == "sliding_attention" else None for t in types]

    def mask_argument(self, bias: Any, sliding: Any | None) -> Any:
        """What to pass as ``attention_mask`` so the family uses our masks unchanged."""
        if sliding is None:
            return bias
        return {"full_attention": bias, "sliding_attention": sliding}

    def eos_token_ids(self, config: Any, generation_config: Any | None) -> list[int]:
        ids: list[int] = []
        for src in (generation_config, self.text_config(config)):
            e = getattr(src, "eos_token_id", None) if src is not None else None
            if e is None:
                continue
            for t in (e if isinstance(e, (list, tuple)) else [e]):
                if int(t) not in ids:
                    ids.append(int(t))
        return ids

    # --- tests -------------------------------------------------------------------------
    def tiny_config(self) -> Any:
        """A tiny random config of this family, for in-process tests."""
        raise NotImplementedError

    def tiny_model(self, seed: int = 0) -> Any:
        import torch
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        cfg = self.tiny_config()
        return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
