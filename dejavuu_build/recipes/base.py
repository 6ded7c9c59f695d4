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
    """Every family, by name. Complete whenever it can be called: Python runs a package's
    ``__init__`` before any module in it, and the recipes package's ``__init__`` imports (so
    registers) every family, so this module needs no import of its own families."""
    return dict(_REGISTRY)


def supported_architectures() -> list[str]:
    return sorted({a for r in registered().values() for a in r.architectures})


def recipe_for(config: Any) -> "Recipe":
    """The recipe for a transformers config, by architecture name then model_type; refuse unknowns,
    and refuse a known family whose config changes attention in a way its recipe does not map."""
    archs = list(getattr(config, "architectures", None) or [])
    mtype = getattr(config, "model_type", None)
    recipes = registered()
    for a in archs:
        for r in recipes.values():
            if a in r.architectures:
                return r().checked(config)
    for r in recipes.values():
        if mtype in r.model_types:
            return r().checked(config)
    what = ", ".join(archs) or str(mtype)
    raise UnsupportedArchitecture(
        f"unsupported architecture {what}; supported recipes: "
        + "; ".join(f"{n} ({', '.join(r.architectures)})" for n, r in sorted(recipes.items()))
    )


# --- what a config says about attention, read from the config alone ----------------------------
# Static RoPE variants: a fixed frequency transform the exporter traces as constants (and the static
# KV flavour re-evaluates from the graph), exact at every position. "dynamic" and "longrope" instead
# switch their frequencies by the length of the whole sequence at run time.
STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})


FEATURE_LABELS = {
    "local_rope_base": "local-layer RoPE base",
    "nope_layers": "NoPE layers",
    "attn_softcapping": "attention softcapping",
    "partial_rotary": "partial RoPE",
    "chunked_attention": "chunked attention",
    "rope_conflict": "disagreeing RoPE bases",
}


def text_config_of(config: Any) -> Any:
    return getattr(config, "text_config", None) or config


def config_windows(config: Any) -> list[int | None]:
    """Per-layer sliding window (None = full attention) the way transformers' attention layers apply
    it, from the config itself (never from a recipe hook): ``sliding_window`` (unless
    ``use_sliding_window`` is false), on every layer, or on the ``sliding_attention`` layers of
    ``layer_types`` when the config has them."""
    tc = text_config_of(config)
    n = tc.num_hidden_layers
    window = getattr(tc, "sliding_window", None)
    if not window or getattr(tc, "use_sliding_window", True) is False:
        return [None] * n
    types = getattr(tc, "layer_types", None)
    if types is None:
        return [int(window)] * n
    return [int(window) if t == "sliding_attention" else None for t in types]


def rope_settings(config: Any) -> list[tuple[str, dict]]:
    """Every RoPE settings dict the config declares, each with where it was found. transformers 4.x
    keeps them in ``rope_scaling`` (None for plain RoPE; ``rope_theta``, ``partial_rotary_factor`` and
    Gemma 3's ``rope_local_base_freq`` beside it), 5.x in ``rope_parameters``: one dict, or one per
    layer type (Gemma 3: ``full_attention`` and ``sliding_attention``, the local base being the
    latter's ``rope_theta``). Both attributes are read whichever transformers is installed (5.x keeps
    ``rope_scaling`` as an alias of ``rope_parameters``; a config saved by one version may carry the
    other's), so that no setting goes unseen and thus unrefused."""
    tc = text_config_of(config)
    found: list[tuple[str, dict]] = []
    seen: list[int] = []
    for attr in ("rope_parameters", "rope_scaling"):
        d = getattr(tc, attr, None)
        if not isinstance(d, dict) or id(d) in seen:
            continue
        seen.append(id(d))
        nested = {k: v for k, v in d.items() if isinstance(v, dict)}
        if nested and all(isinstance(v, dict) or v is None for v in d.values()):
            found += [(f"{attr}[{k!r}]", v) for k, v in nested.items()]
        elif d:
            found.append((attr, d))
    return found


def _rope_type_of(d: dict) -> str:
    return str(d.get("rope_type", d.get("type")) or "default")


def rope_types(config: Any) -> dict[str, str]:
    """Every non-default RoPE type the config declares -> where (e.g. ``rope_parameters['full_attention']``)."""
    out: dict[str, str] = {}
    for where, d in rope_settings(config):
        t = _rope_type_of(d)
        if t != "default":
            out[t] = f"{out[t]}, {where}" if t in out else where
    return out


def rope_type(config: Any) -> str:
    """The config's RoPE type: "default", the one scaling type it declares, or several joined by "+"
    (then no recipe's single-type check matches it)."""
    return "+".join(sorted(rope_types(config))) or "default"


def original_rope_length(config: Any) -> int | None:
    """The pretraining context a scaled RoPE extends (``original_max_position_embeddings``), if any."""
    if rope_type(config) == "default":
        return None
    tc = text_config_of(config)
    n = next(
        (
            d["original_max_position_embeddings"]
            for _, d in rope_settings(config)
            if d.get("original_max_position_embeddings")
        ),
        None,
    )
    n = n or getattr(tc, "original_max_position_embeddings", None)
    return int(n) if n else None


def _partial_rotary(config: Any) -> str | None:
    """``partial_rotary_factor`` != 1 wherever it is set: an attribute (4.x) or a RoPE dict (5.x)."""
    tc = text_config_of(config)
    prf = getattr(tc, "partial_rotary_factor", None)
    if prf is not None and float(prf) != 1.0:
        return f"partial_rotary_factor={prf}"
    for where, d in rope_settings(config):
        prf = d.get("partial_rotary_factor")
        if prf is not None and float(prf) != 1.0:
            return f"{where}.partial_rotary_factor={prf}"
    return None


def _local_rope_base(config: Any) -> str | None:
    """A RoPE base of its own on the sliding-window layers: 4.x's ``rope_local_base_freq``, 5.x's
    per-layer-type ``rope_parameters`` whose ``rope_theta`` differ."""
    tc = text_config_of(config)
    if getattr(tc, "rope_local_base_freq", None):
        return f"rope_local_base_freq={tc.rope_local_base_freq}"
    thetas = {w: d.get("rope_theta") for w, d in rope_settings(config) if "[" in w}
    if len({v for v in thetas.values()}) > 1:
        return "; ".join(f"{w}.rope_theta={v}" for w, v in thetas.items())
    return None


def _rope_conflict(config: Any) -> str | None:
    """Two RoPE bases that disagree: a ``rope_theta`` (or Gemma 3's ``rope_local_base_freq``) attribute
    beside a RoPE dict with another ``rope_theta``. One of them is ignored by the installed
    transformers (5.x reads only the dict, 4.x only the attribute), e.g. a config saved by the other
    version, or an attribute set after the config was built on 5.x."""
    tc = text_config_of(config)
    pairs = {"rope_parameters": "rope_theta", "rope_parameters['full_attention']": "rope_theta"}
    pairs["rope_parameters['sliding_attention']"] = "rope_local_base_freq"
    for where, d in rope_settings(config):
        attr = pairs.get(where)
        mine = getattr(tc, attr, None) if attr else None
        if mine is not None and "rope_theta" in d and d["rope_theta"] != mine:
            return f"{attr}={mine} but {where}.rope_theta={d['rope_theta']}"
    return None


def attention_features(config: Any) -> dict[str, str]:
    """Every config attribute that changes what attention computes: feature -> the attribute as
    found. A recipe maps some of them (``Recipe.handles``); any other one is refused at build time."""
    tc = text_config_of(config)
    f: dict[str, str] = {}
    ws = config_windows(config)
    if any(ws):
        f["sliding_window"] = f"sliding_window={max(w for w in ws if w)}"
    for t in sorted(set(getattr(tc, "layer_types", None) or ()) - {"full_attention", "sliding_attention"}):
        f[f"layer_type:{t}"] = f"layer_types contains {t!r}"
    if getattr(tc, "attention_chunk_size", None):
        f["chunked_attention"] = f"attention_chunk_size={tc.attention_chunk_size}"
    for rt, where in sorted(rope_types(config).items()):
        f[f"rope:{rt}"] = f"{where}.rope_type={rt!r}"
    if getattr(tc, "attn_logit_softcapping", None):
        f["attn_softcapping"] = f"attn_logit_softcapping={tc.attn_logit_softcapping}"
    nope = getattr(tc, "no_rope_layers", None)
    if nope and not all(nope):
        f["nope_layers"] = f"no_rope_layers (RoPE off on {sum(1 for x in nope if not x)} of {len(nope)} layers)"
    if prf := _partial_rotary(config):
        f["partial_rotary"] = prf
    if local := _local_rope_base(config):
        f["local_rope_base"] = local
    if clash := _rope_conflict(config):
        f["rope_conflict"] = clash
    return f


class Recipe:
    """Hooks a family overrides. Defaults fit Llama-like decoders."""

    name: ClassVar[str] = ""
    architectures: ClassVar[tuple[str, ...]] = ()
    model_types: ClassVar[tuple[str, ...]] = ()
    description: ClassVar[str] = ""
    # Attention features (see ``attention_features``) this recipe maps into the export; a config
    # with any other one is refused by name. Plain causal attention with default RoPE needs none.
    handles: ClassVar[frozenset[str]] = frozenset()
    vlm: ClassVar[bool] = False

    # --- contract ----------------------------------------------------------------------
    def unmapped(self, config: Any) -> dict[str, str]:
        return {k: v for k, v in attention_features(config).items() if k not in self.handles}

    def checked(self, config: Any) -> "Recipe":
        """Refuse, naming the attribute, a config that changes attention in a way this recipe does
        not map (the build would pass its gates at short lengths and answer differently past them),
        and a recipe whose window hook disagrees with the config."""
        bad = self.unmapped(config)
        if bad:
            raise UnsupportedArchitecture(
                f"{self.name} recipe: the config sets {'; '.join(bad.values())}, which changes attention and "
                f"which this recipe does not map; refusing rather than exporting a model that answers "
                f"differently (supported here: {', '.join(sorted(self.handles)) or 'plain causal attention'})"
            )
        mine, cfg = self.sliding_windows(config), config_windows(config)
        if list(mine) != list(cfg):
            raise UnsupportedArchitecture(
                f"{self.name} recipe: its sliding windows {mine} differ from the config's {cfg}; refusing"
            )
        if len({w for w in cfg if w}) > 1:
            raise UnsupportedArchitecture(
                f"{self.name} recipe: several sliding-window lengths "
                f"{sorted({w for w in cfg if w})} in one model are not supported"
            )
        return self

    def supports(self) -> dict[str, str]:
        """What ``dejavuu-build recipes`` and the README list for this family."""
        ropes = sorted(h.split(":", 1)[1] for h in self.handles if h.startswith("rope:"))
        return {
            "tree": "yes",
            "sliding_window": "yes" if "sliding_window" in self.handles else "-",
            "rope": ", ".join(["default"] + ropes),
            "other": ", ".join(
                sorted(
                    FEATURE_LABELS.get(h, h)
                    for h in self.handles
                    if h != "sliding_window" and not h.startswith("rope:")
                )
            )
            or "-",
            "vlm": "yes" if self.vlm else "-",
        }

    # --- model -------------------------------------------------------------------------
    def text_causal_lm(self, model: Any) -> Any:
        """The causal LM whose forward gives logits (for VLMs: the text backbone + lm-head)."""
        return model

    def text_config(self, config: Any) -> Any:
        return config

    def sliding_windows(self, config: Any) -> list[int | None]:
        """Per-layer sliding window (None = full attention), as the config declares it."""
        return config_windows(self.text_config(config))

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
            for t in e if isinstance(e, (list, tuple)) else [e]:
                if int(t) not in ids:
                    ids.append(int(t))
        return ids

    # --- vision (a VLM recipe: vlm = True) ----------------------------------------------
    def image_tokens(self) -> dict[str, str]:
        """The image-token strings the runtime's prompt builder writes (vlm.json: image_token,
        fake_image_token, global_image_token)."""
        raise NotImplementedError(f"the {self.name} recipe is not a VLM recipe: it has no image tokens")

    def default_processor_config(self, dims: dict) -> dict:
        """The image processor's settings for a checkpoint that ships no preprocessor_config.json,
        sized to its vision tower (``dims``: export.vision.vision_dims)."""
        raise NotImplementedError(f"the {self.name} recipe is not a VLM recipe: it has no image processor")

    # --- tests -------------------------------------------------------------------------
    def tiny_config(self) -> Any:
        """A tiny random config of this family, for in-process tests."""
        raise NotImplementedError

    def tiny_cases(self) -> dict[str, Any]:
        """Tiny configs that together exercise every feature this recipe ``handles``: the base one
        under "", plus one per extra feature (a RoPE variant, a window) the base one lacks."""
        return {"": self.tiny_config()}

    def tiny_model(self, seed: int = 0) -> Any:
        import torch
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        cfg = self.tiny_config()
        return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
