"""RoPE settings are read, and what a recipe does not map refused, on every supported transformers:
4.x keeps them in ``rope_scaling`` (with ``rope_theta``, ``partial_rotary_factor`` and Gemma 3's
``rope_local_base_freq`` beside it), 5.x in ``rope_parameters`` (one dict per layer type for
Gemma 3). Each case arrives the three ways a build can meet it: built by the installed
transformers' constructor, and loaded from a config.json written in either version's format. CI
runs these on one transformers; `.ci/run-transformers5` on the other (README, Tests)."""

from __future__ import annotations

import json

import pytest
import transformers

from dejavuu_build.errors import UnsupportedArchitecture
from dejavuu_build.recipes import recipe_for, registered
from dejavuu_build.recipes.base import attention_features

V5 = int(transformers.__version__.split(".")[0]) >= 5
HOW = ["constructor", "config.json 4.x", "config.json 5.x"]

GEMMA = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "sliding_window": 8,
    "layer_types": ["sliding_attention", "full_attention"],
    "query_pre_attn_scalar": 16,
    "architectures": ["Gemma3ForCausalLM"],
}
LLAMA = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "architectures": ["LlamaForCausalLM"],
}


def _gemma(how: str, tmp_path, full: dict | None = None):
    """A Gemma 3 text config whose full-attention layers use ``full`` RoPE scaling (None: plain)."""
    from transformers import Gemma3TextConfig

    glob, local = 1_000_000.0, 10_000.0
    if how == "constructor" and not V5:
        return Gemma3TextConfig(**GEMMA, rope_theta=glob, rope_local_base_freq=local, rope_scaling=full)
    nested = {
        "full_attention": {"rope_type": "default", "rope_theta": glob, **(full or {})},
        "sliding_attention": {"rope_type": "default", "rope_theta": local},
    }
    if how == "constructor":
        return Gemma3TextConfig(**GEMMA, rope_parameters=nested)
    if how == "config.json 4.x":
        keys = {"rope_theta": glob, "rope_local_base_freq": local, "rope_scaling": full}
    else:
        keys = {"rope_parameters": nested}
    return _load(tmp_path, {"model_type": "gemma3_text", **GEMMA, **keys})


def _llama(how: str, tmp_path, partial: float | None = None):
    from transformers import LlamaConfig

    extra = {} if partial is None else {"partial_rotary_factor": partial}
    if how == "constructor":
        return LlamaConfig(**LLAMA, rope_theta=10_000.0, **extra)
    if how == "config.json 4.x":
        return _load(tmp_path, {"model_type": "llama", **LLAMA, "rope_theta": 10_000.0, "rope_scaling": None, **extra})
    params = {"rope_type": "default", "rope_theta": 10_000.0, **extra}
    return _load(tmp_path, {"model_type": "llama", **LLAMA, "rope_parameters": params})


def _load(tmp_path, d: dict):
    from transformers import AutoConfig

    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(d))
    return AutoConfig.from_pretrained(tmp_path)  # what a build does with a model folder


def _inv_freqs(cfg) -> list:
    """Every rotary inverse-frequency buffer of the model the installed transformers builds."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    return [b.tolist() for n, b in model.named_buffers() if n.endswith("inv_freq")]


@pytest.mark.parametrize("how", HOW)
def test_gemma3_with_linear_rope_is_refused(how, tmp_path):
    """Gemma 3 4B+ scale their global layers' RoPE linearly (factor 8); the gemma3 recipe maps only
    the local-layer base, so such a config is refused naming the setting, however it arrives."""
    assert recipe_for(_gemma(how, tmp_path)).name == "gemma3"  # plain Gemma 3 is fine
    cfg = _gemma(how, tmp_path / "linear", {"rope_type": "linear", "factor": 8.0})
    with pytest.raises(UnsupportedArchitecture) as e:
        recipe_for(cfg)
    msg = str(e.value)
    assert "gemma3 recipe" in msg and "rope_type='linear'" in msg and "\n" not in msg


def test_linear_rope_really_changes_the_installed_gemma3(tmp_path):
    """The refusal above is not vacuous: the installed transformers applies the setting built its way."""
    plain = _inv_freqs(_gemma("constructor", tmp_path))
    assert _inv_freqs(_gemma("constructor", tmp_path, {"rope_type": "linear", "factor": 8.0})) != plain


@pytest.mark.parametrize("how", HOW)
def test_partial_rope_llama_is_refused(how, tmp_path):
    """``partial_rotary_factor`` (a top-level attribute on 4.x, inside ``rope_parameters`` on 5.x)
    is mapped by no recipe: refused by name."""
    assert recipe_for(_llama(how, tmp_path)).name == "llama"
    cfg = _llama(how, tmp_path / "partial", partial=0.5)
    with pytest.raises(UnsupportedArchitecture) as e:
        recipe_for(cfg)
    msg = str(e.value)
    assert "llama recipe" in msg and "partial_rotary_factor=0.5" in msg and "\n" not in msg


@pytest.mark.parametrize("how", HOW)
def test_local_rope_base_is_seen_either_way(how, tmp_path):
    """Gemma 3's own base on its sliding layers is a feature the gemma3 recipe maps; the same per-
    layer-type settings on any other family would be refused (see test_contract)."""
    assert "local_rope_base" in attention_features(_gemma(how, tmp_path))


def test_rope_theta_set_on_a_built_config_is_accepted_only_where_it_is_applied():
    """4.x models read ``config.rope_theta``; 5.x's read ``rope_parameters`` only, so an attribute
    set after construction is dropped there. Accepted where the model applies it, refused (two
    disagreeing bases) where it would be silently ignored."""
    cfg = registered()["llama"]().tiny_config()
    plain = _inv_freqs(cfg)
    cfg.rope_theta = 500_000.0
    applied = _inv_freqs(cfg) != plain
    assert applied != V5
    if applied:
        assert recipe_for(cfg).name == "llama"
    else:
        with pytest.raises(UnsupportedArchitecture, match="rope_theta=500000.0"):
            recipe_for(cfg)


def test_the_llama3_tiny_case_gets_its_rope_base_on_every_version():
    """The recipe's own llama3 case builds its config through the constructor, so its base of
    500000 reaches the model (5.x drops a ``rope_theta`` set afterwards)."""
    r = registered()["llama"]()
    l3 = r.tiny_cases()["llama3"]
    assert "rope_conflict" not in attention_features(l3)
    params = getattr(l3, "rope_parameters", None) or {}
    assert params.get("rope_theta", getattr(l3, "rope_theta", None)) == 500_000.0
    scaling = {k: v for k, v in (params or l3.rope_scaling).items() if k != "rope_theta"}
    assert _inv_freqs(l3) != _inv_freqs(r.tiny_config(rope_scaling=scaling))  # the same, on base 10000
