"""The export wrapper never drops a window silently: each layer's ``sliding_window`` argument is
checked against the mask it got; and RoPE attention scaling (YaRN, LongRoPE) moved into the
softmax scale computes what transformers computes."""

import pytest
import torch

from dejavuu_build.errors import ExportError
from dejavuu_build.export.wrapper import DecoderWrapper
from dejavuu_build.recipes import registered


def _model(recipe, **attrs):
    from transformers import AutoModelForCausalLM

    cfg = registered()[recipe]().tiny_config()
    for k, v in attrs.items():
        setattr(cfg, k, v)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def _run(model, windows, mask_argument, n=20):
    L = model.config.num_hidden_layers
    kv, d = model.config.num_key_value_heads, model.config.hidden_size // model.config.num_attention_heads
    w = DecoderWrapper(model, L, windows, mask_argument)
    ids = torch.randint(3, 200, (1, n))
    pos = torch.arange(n)[None]
    bias = torch.triu(torch.full((n, n), torch.finfo(torch.float32).min), 1)[None, None]
    with torch.no_grad():
        return w(ids, pos, bias, *[torch.zeros(1, kv, 0, d) for _ in range(2 * L)])[0], ids


def test_a_layer_window_the_recipe_does_not_map_fails_the_export():
    """Mistral with its window left out of the recipe's windows: the layer's sliding_window=12
    meets an unnarrowed mask -> ExportError naming it (it used to be swallowed)."""
    m = _model("mistral")
    r = registered()["mistral"]()
    with pytest.raises(ExportError, match="sliding_window=12"):
        _run(m, [None, None], r.mask_argument)


def test_a_full_attention_layer_given_the_window_fails_the_export():
    """Qwen2 (layer 0 full, layer 1 sliding) with one narrowed mask for every layer."""
    m = _model("qwen2")
    with pytest.raises(ExportError, match="layer 0 has full attention"):
        _run(m, [None, 12], lambda bias, sliding: sliding if sliding is not None else bias)


@pytest.mark.parametrize("recipe", ["mistral", "qwen2", "phi3", "smollm3", "gemma3"])
def test_mapped_windows_match_transformers(recipe):
    from transformers.masking_utils import create_causal_mask  # noqa: F401 - transformers' own masks below

    m = _model(recipe)
    r = registered()[recipe]()
    logits, ids = _run(m, r.sliding_windows(m.config), r.mask_argument, n=30)
    with torch.no_grad():
        want = m(ids).logits
    assert (logits - want).abs().max() < 1e-4


def test_rope_attention_scaling_moved_into_the_softmax_scale():
    """SmolLM3 with YaRN (attention factor ~1.28 on cos/sin) and a NoPE layer: the wrapper's
    logits (factor squared into the RoPE layers' softmax scale, none on the NoPE layer) equal
    transformers', and the factor is restored on the module afterwards."""
    m = _model("smollm3")
    rot = m.model.rotary_emb
    assert rot.attention_scaling > 1.2
    before = rot.attention_scaling
    r = registered()["smollm3"]()
    logits, ids = _run(m, r.sliding_windows(m.config), r.mask_argument, n=40)
    assert rot.attention_scaling == before
    with torch.no_grad():
        want = m(ids).logits
    assert (logits - want).abs().max() < 1e-4
