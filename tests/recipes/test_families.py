"""Every registered family, and every attention feature a recipe claims to map, on a tiny random
model: fp32 chain and tree parity with transformers past the sliding window and the original RoPE
length, in both KV flavours; int4 running; greedy tokens from our runtime equal to transformers'
``generate``. A recipe with a feature that no tiny case exercises fails here."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import build_tiny

from dejavuu_build import schema as S
from dejavuu_build.build.references import Reference
from dejavuu_build.recipes import registered
from dejavuu_build.recipes.base import (
    STATIC_ROPE_TYPES,
    attention_features,
    config_windows,
    original_rope_length,
    rope_type,
)
from dejavuu_build.schema import REFERENCE_FILE

CASES = [(n, c) for n, cls in sorted(registered().items()) for c in cls().tiny_cases()]
_built: dict[str, object] = {}


def build_case(recipe: str, case: str, cache_dir):
    """The base case shares conftest's build (all variants); an extra case builds fp32 + int4 (and
    their static flavours) once per session."""
    if not case:
        return build_tiny(recipe, cache_dir)
    name = f"tiny-{recipe}-{case}"
    if name not in _built:
        import torch
        from tiny import tiny_tokenizer
        from transformers import AutoModelForCausalLM

        from dejavuu_build.build.config import TreeDecoderConfig
        from dejavuu_build.build.pipeline import build_tree_decoder

        cfg = registered()[recipe]().tiny_cases()[case]
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
        src = cache_dir.parent / f"src-{name}"
        model.save_pretrained(src)
        tiny_tokenizer(cfg.vocab_size).save_pretrained(src)
        _built[name] = build_tree_decoder(
            TreeDecoderConfig(model=str(src), name=name, variants=("fp32", "int4"), timing=False, reference_tokens=12)
        ).folder
    return _built[name]


def _spans(cfg) -> list[int]:
    """Lengths the parity case must run past: windows, and the original RoPE length of a static
    RoPE variant (a length-switching one, LongRoPE, is capped there instead: see below)."""
    spans = [w for w in config_windows(cfg) if w]
    if original_rope_length(cfg) and rope_type(cfg) in STATIC_ROPE_TYPES:
        spans.append(original_rope_length(cfg))
    return spans


def _rope_layers(cfg) -> int:
    tc = getattr(cfg, "text_config", None) or cfg
    nope = getattr(tc, "no_rope_layers", None)
    return sum(1 for x in nope if x) if nope else tc.num_hidden_layers


def test_every_feature_a_recipe_handles_has_a_tiny_case():
    """A recipe may only claim what some tiny case exercises (and every case must be accepted)."""
    for name, cls in registered().items():
        r = cls()
        seen: set[str] = set()
        for case, cfg in r.tiny_cases().items():
            assert not r.unmapped(cfg), (name, case)
            seen |= set(attention_features(cfg))
        assert r.handles <= seen, f"{name} claims {sorted(r.handles - seen)} without a tiny case exercising it"


@pytest.mark.parametrize("recipe,case", CASES, ids=[f"{r}-{c or 'base'}" for r, c in CASES])
def test_parity_past_window_and_rope_length(recipe, case, cache_dir):
    """fp32 chain and tree logits within 1e-4 of transformers (eager, its own masks), with the tree
    over a past longer than every window and original RoPE length, in the concat and the static
    KV flavour; RoPE stays a fused op (in the kernel for the static flavour) on exactly the layers
    that have it; int4 and int4-static run and pass the batched gate."""
    folder = build_case(recipe, case, cache_dir)
    cfg = registered()[recipe]().tiny_cases()[case]
    m = S.read_manifest(folder)
    ref = Reference.load(folder / REFERENCE_FILE)
    for span in _spans(cfg):
        assert ref.chain_split > span, (span, ref.chain_split)  # the tree's past alone crosses it
    for v in ("fp32", "fp32-static"):
        rec = m.variants[v]
        assert rec.passed, (v, rec.gates)
        par = rec.gates["parity"]
        assert par["chain_logits_maxdiff"] <= 1e-4 and par["tree_logits_maxdiff"] <= 1e-4, (v, par)
        assert par["chain_hidden_maxdiff"] <= 1e-4 and par["tree_hidden_maxdiff"] <= 1e-4, (v, par)
    for v in ("int4", "int4-static"):
        assert m.variants[v].gates["batched_vs_incremental"]["passed"], (v, m.variants[v].gates)
    rope = _rope_layers(cfg)
    assert m.export["op_counts"].get("RotaryEmbedding", 0) == 2 * rope  # q and k per RoPE layer
    g = onnx.load(str(folder / S.variant_file("fp32-static")), load_external_data=False).graph
    gqa = [n for n in g.node if n.op_type == "GroupQueryAttention"]
    rotary = [next((onnx.helper.get_attribute_value(a) for a in n.attribute if a.name == "do_rotary"), 0) for n in gqa]
    assert sum(rotary) == rope and len(gqa) == len(rotary)


def _hf_model(recipe: str, folder):
    import torch
    from transformers import AutoModelForCausalLM, SmolVLMForConditionalGeneration

    src = S.read_manifest(folder).source["path"]
    cls = SmolVLMForConditionalGeneration if getattr(registered()[recipe], "vlm", False) else AutoModelForCausalLM
    return cls.from_pretrained(src, dtype=torch.float32).eval()  # fresh: nothing of ours patched in


@pytest.mark.parametrize("recipe,case", CASES, ids=[f"{r}-{c or 'base'}" for r, c in CASES])
def test_runtime_greedy_equals_transformers_generate(recipe, case, cache_dir):
    """32 greedy tokens past the window and original RoPE length: our runtime (concat plain decoding,
    static flavour with tree speculation) gives exactly transformers' generate."""
    import torch

    from dejavuu_build.runtime import load

    folder = build_case(recipe, case, cache_dir)
    hf = _hf_model(recipe, folder)
    prompt = [int(t) for t in np.random.default_rng(7).integers(3, 200, 10)] * 2  # repeats: pld drafts
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=32,
            do_sample=False,
            num_beams=1,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        )
    want = [int(t) for t in out[0, len(prompt) :]]
    assert len(prompt) + len(want) > max(_spans(registered()[recipe]().tiny_cases()[case]) or [0])
    for variant, kw in (("fp32", {}), ("fp32-static", {"method": "pld", "tree": True})):
        got = load(folder, variant=variant, threads=1).generate(prompt, max_new_tokens=32, **kw).tokens
        assert got == want[: len(got)] and (len(got) == 32 or len(got) == len(want)), (variant, got, want)


def test_longrope_is_capped_at_its_original_length(cache_dir):
    """Phi-3.5's LongRoPE switches to its long factors once a sequence passes the original length,
    per forward: exported on the short factors, the decoder is exact up to that length and refuses
    to go past it (rather than answer differently), while transformers would switch there."""
    import torch

    from dejavuu_build.errors import GenerationError
    from dejavuu_build.runtime import load

    folder = build_case("phi3", "", cache_dir)
    cfg = registered()["phi3"]().tiny_config()
    n = original_rope_length(cfg)
    assert n == 128 and cfg.max_position_embeddings == 512
    assert S.read_contract(folder).max_positions == n
    assert S.read_manifest(folder).variants["fp32-static"].kv_capacity == n
    model = load(folder, variant="fp32", threads=1)
    with pytest.raises(GenerationError, match=str(n)):
        model.generate(list(range(3, 3 + n - 8)), max_new_tokens=16)
    # The cap is needed: past n, transformers' logits change for every position (long factors).
    hf = _hf_model("phi3", folder)
    ids = torch.tensor([[int(t) for t in np.random.default_rng(3).integers(3, 200, n + 4)]])
    with torch.no_grad():
        long_ = hf(ids).logits[0, :n]
        short = hf(ids[:, :n]).logits[0]
    assert (long_ - short).abs().max() > 1e-3


def test_gate_chain_crosses_the_config_window_even_if_the_recipe_misses_it():
    """compute_reference takes its chain length from the config, not from the recipe's hook."""
    import torch
    from transformers import AutoModelForCausalLM

    from dejavuu_build.build.references import compute_reference
    from dejavuu_build.recipes.mistral import MistralRecipe

    class Blind(MistralRecipe):
        def sliding_windows(self, config):
            return [None] * config.num_hidden_layers

    cfg = MistralRecipe().tiny_config()
    cfg.sliding_window, cfg.num_hidden_layers = 70, 1
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    ref = compute_reference(model, Blind(), None, new_tokens=1, min_chain=0)
    assert ref.chain_split > 70


def test_gate_chain_ignores_a_window_longer_than_the_context():
    """Phi-3.5 declares sliding_window=262144 over a (capped) 4096-position context: the window
    can never narrow anything, and the gate must not try to run a 262k-token reference."""
    import torch
    from transformers import AutoModelForCausalLM

    from dejavuu_build.build.references import compute_reference
    from dejavuu_build.recipes.phi3 import Phi3Recipe

    cfg = Phi3Recipe().tiny_config()
    cfg.sliding_window, cfg.num_hidden_layers = 262144, 1
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    r = Phi3Recipe()
    r.text_causal_lm(model)
    ref = compute_reference(model, r, None, new_tokens=1, min_chain=0)
    assert len(ref.chain_ids) < original_rope_length(cfg)


def _without(feature: str, cfg) -> dict | None:
    """from_pretrained overrides that turn one attention feature off (None: not separable)."""
    tc = getattr(cfg, "text_config", None) or cfg
    if feature == "sliding_window":
        return {"sliding_window": 1 << 16}
    params = getattr(tc, "rope_parameters", None)  # transformers 5.x: RoPE lives there, not in rope_scaling
    if feature.startswith("rope:"):
        if params is None:
            return {"rope_scaling": None}
        plain = {"rope_type": "default", "rope_theta": params["rope_theta"]}
        return {"rope_parameters": plain | {"partial_rotary_factor": params.get("partial_rotary_factor", 1.0)}}
    if feature == "nope_layers":
        return {"no_rope_layers": [1] * tc.num_hidden_layers}
    if feature == "local_rope_base":
        if params is None:
            return {"rope_local_base_freq": tc.rope_theta}
        glob = params["full_attention"]["rope_theta"]
        return {"rope_parameters": {**params, "sliding_attention": {**params["sliding_attention"], "rope_theta": glob}}}
    return None


FEATURE_CASES = [(r, c, f) for r, c in CASES for f in attention_features(registered()[r]().tiny_cases()[c])]


@pytest.mark.parametrize(
    "recipe,case,feature", FEATURE_CASES, ids=[f"{r}-{c or 'base'}-{f}" for r, c, f in FEATURE_CASES]
)
def test_each_feature_matters_at_the_parity_length(recipe, case, feature, cache_dir):
    """The parity cases are sensitive to what they claim to test: transformers without the
    feature (window, RoPE variant, NoPE, local RoPE base) is far from the reference the export
    matched to 1e-4."""
    import torch

    folder = build_case(recipe, case, cache_dir)
    kw = _without(feature, registered()[recipe]().tiny_cases()[case])
    assert kw is not None, f"no way to switch {feature} off: add one to _without"
    from transformers import AutoModelForCausalLM

    src = S.read_manifest(folder).source["path"]
    m = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, **kw).eval()
    ref = Reference.load(folder / REFERENCE_FILE)
    with torch.no_grad():
        lg = m(torch.tensor(np.asarray(ref.chain_ids)[None])).logits[0].numpy()
    assert np.abs(lg - ref.chain_logits).max() > 1e-3, feature
