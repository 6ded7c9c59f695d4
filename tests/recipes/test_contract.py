"""The base-recipe contract: a config attribute that changes attention and that the recipe does not
map is refused at build time (before weights load) with the attribute named; so is a recipe whose
window hook disagrees with the config."""

import copy
import warnings

import pytest

from dejavuu_build.errors import UnsupportedArchitecture
from dejavuu_build.recipes import recipe_for, registered
from dejavuu_build.recipes.base import config_windows, rope_type


def _with(recipe, **attrs):
    """The recipe's tiny config with ``attrs`` as a config.json written by transformers 4.x carries
    them, loaded by the installed transformers the way a build loads one (5.x moves RoPE settings into
    ``rope_parameters``; setting them on a built config would be deprecated there, or ignored)."""
    cfg = registered()[recipe]().tiny_config()
    d = cfg.to_dict()
    if {"rope_scaling", "partial_rotary_factor"} & set(attrs):
        d.pop("rope_parameters", None)  # rebuilt from the 4.x-style keys
    try:
        loaded = type(cfg).from_dict({**d, **copy.deepcopy(attrs)})  # transformers edits the dicts it gets
        if "rope_scaling" not in attrs or rope_type(loaded) == attrs["rope_scaling"]["rope_type"]:
            return loaded
    except (ValueError, KeyError):
        pass
    # transformers' own validation rejects the combination (Phi-3 on 4.x takes LongRoPE only) or
    # rewrites it (5.x turns Phi-3's "yarn" into "longrope"): the attributes set on a built config
    # instead, as remote code or a hand-edited config may
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # 5.x: rope_scaling is deprecated
        for k, v in attrs.items():
            setattr(cfg, k, copy.deepcopy(v))
    return cfg


REFUSED = [
    ("llama", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type='dynamic'"),
    (
        "llama",
        {
            "rope_scaling": {
                "rope_type": "longrope",
                "short_factor": [1.0] * 8,
                "long_factor": [2.0] * 8,
                "original_max_position_embeddings": 64,
            }
        },
        "rope_type='longrope'",
    ),
    ("llama", {"sliding_window": 16}, "sliding_window=16"),
    ("llama", {"no_rope_layers": [1, 0]}, "no_rope_layers"),
    ("mistral", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0"),
    (
        "mistral",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            }
        },
        "rope_type='llama3'",
    ),
    ("phi3", {"partial_rotary_factor": 0.75}, "partial_rotary_factor=0.75"),
    ("llama", {"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    ("phi3", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type='yarn'"),
    ("qwen2", {"layer_types": ["full_attention", "chunked_attention"]}, "chunked_attention"),
    ("qwen3", {"attention_chunk_size": 64}, "attention_chunk_size=64"),
    ("gemma3", {"attn_logit_softcapping": 30.0}, "attn_logit_softcapping=30.0"),
    ("smollm3", {"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
]


@pytest.mark.parametrize("recipe,attrs,named", REFUSED, ids=[f"{r}-{n}" for r, _, n in REFUSED])
def test_unmapped_attention_attribute_is_refused_by_name(recipe, attrs, named):
    assert recipe_for(registered()[recipe]().tiny_config()).name == recipe  # the plain config is fine
    with pytest.raises(UnsupportedArchitecture) as e:
        recipe_for(_with(recipe, **attrs))
    msg = str(e.value)
    assert named in msg and recipe in msg and "\n" not in msg


def test_every_recipe_refuses_something():
    """No recipe accepts everything: each one is exercised by a refusal case above."""
    assert {r for r, _, _ in REFUSED} >= set(registered()) - {"smolvlm"}
    # smolvlm: its Llama text config follows llama's rules
    from transformers import LlamaConfig

    vlm = registered()["smolvlm"]().tiny_config()
    d = vlm.to_dict()
    d["text_config"].pop("rope_parameters", None)
    d["text_config"]["rope_scaling"] = {"rope_type": "dynamic", "factor": 2.0}
    vlm = type(vlm).from_dict(d)
    with pytest.raises(UnsupportedArchitecture, match="dynamic"):
        recipe_for(vlm)
    assert LlamaConfig  # imported for the config class the text config is


def test_recipe_whose_window_hook_disagrees_with_the_config_is_refused():
    from dejavuu_build.recipes.mistral import MistralRecipe

    class Blind(MistralRecipe):
        def sliding_windows(self, config):
            return [None] * config.num_hidden_layers

    cfg = MistralRecipe().tiny_config()
    assert config_windows(cfg) == [12, 12]
    with pytest.raises(UnsupportedArchitecture, match=r"sliding windows \[None, None\] differ"):
        Blind().checked(cfg)


def test_config_windows_follow_transformers_rules():
    """Windows as the attention layers apply them: use_sliding_window=False turns them off
    (Qwen2, SmolLM3), layer_types picks the sliding layers, otherwise every layer slides."""
    from transformers import MistralConfig, Qwen2Config, SmolLM3Config

    assert config_windows(MistralConfig(num_hidden_layers=3, sliding_window=7)) == [7, 7, 7]
    assert config_windows(MistralConfig(num_hidden_layers=2, sliding_window=None)) == [None, None]
    assert config_windows(Qwen2Config(num_hidden_layers=2, sliding_window=7, use_sliding_window=False)) == [None] * 2
    assert config_windows(
        Qwen2Config(num_hidden_layers=3, sliding_window=7, use_sliding_window=True, max_window_layers=1)
    ) == [None, 7, 7]
    s = SmolLM3Config(
        num_hidden_layers=4, sliding_window=7, use_sliding_window=False, layer_types=["sliding_attention"] * 4
    )
    assert config_windows(s) == [None] * 4
    # what the model itself does with that config: no window on any layer
    from transformers.models.smollm3.modeling_smollm3 import SmolLM3Attention

    assert all(SmolLM3Attention(s, i).sliding_window is None for i in range(4))


def test_cli_recipes_and_readme_table_list_what_each_family_supports():
    from pathlib import Path

    from click.testing import CliRunner

    from dejavuu_build.cli import main

    out = CliRunner().invoke(main, ["recipes"], catch_exceptions=False).output
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    for name, cls in registered().items():
        s = cls().supports()
        row = (
            f"| {name} | {', '.join(cls.architectures)} | {s['tree']} | {s['sliding_window']} | {s['rope']} | "
            f"{s['other']} | {s['vlm']} |"
        )
        assert row in readme, f"README model table out of date for {name}: {row}"
        line = next(x for x in out.splitlines() if x.startswith(name + " "))
        assert all(v in line for v in s.values()), (line, s)
    assert "llama3" in out and "longrope" in out and "NoPE layers" in out
