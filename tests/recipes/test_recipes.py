"""Every registered recipe builds from a tiny random model and passes every gate."""

import pytest
from conftest import build_tiny

from dejavuu_build.errors import UnsupportedArchitecture
from dejavuu_build.recipes import recipe_for, registered
from dejavuu_build.schema import read_manifest


def test_every_recipe_has_a_tiny_config():
    """A recipe without a tiny random model cannot be tested: fail loudly when one is added."""
    for name, cls in registered().items():
        try:
            cfg = cls().tiny_config()
        except NotImplementedError:
            pytest.fail(f"recipe {name} has no tiny_config(): add one and a test")
        assert recipe_for(cfg).name == name


@pytest.mark.parametrize("name", sorted(registered()))
def test_recipe_builds_and_passes_gates(name, cache_dir):
    folder = build_tiny(name, cache_dir)
    m = read_manifest(folder)
    assert m.recipe == name
    fp32 = m.variants["fp32"]
    assert fp32.passed, fp32.gates
    par = fp32.gates["parity"]
    assert par["chain_logits_maxdiff"] < 1e-3 and par["tree_logits_maxdiff"] < 1e-3
    assert par["chain_hidden_maxdiff"] < 1e-3 and par["tree_hidden_maxdiff"] < 1e-3
    assert fp32.gates["teacher_forced"]["rate"] >= 0.98
    for v in ("int8", "int4"):
        assert m.variants[v].gates["batched_vs_incremental"]["passed"], (v, m.variants[v].gates)
    assert m.export["opset"] >= 23
    ops = m.export["op_counts"]
    assert ops.get("Attention", 0) >= 1
    assert ops.get("RotaryEmbedding", 0) >= 1 and ops.get("RMSNormalization", 0) >= 1
    import onnx

    from dejavuu_build.schema import variant_file

    g = onnx.load(str(folder / variant_file("fp32")), load_external_data=False).graph
    attn_expand = [n.name for n in g.node if n.op_type == "Expand" and "self_attn" in n.name]
    assert not attn_expand, f"K/V heads must enter Attention un-expanded: {attn_expand}"


def test_unknown_architecture_is_refused_with_the_list():
    from transformers import GPT2Config

    with pytest.raises(UnsupportedArchitecture) as e:
        recipe_for(GPT2Config(architectures=["GPT2LMHeadModel"]))
    msg = str(e.value)
    assert "GPT2LMHeadModel" in msg and "llama" in msg and "gemma3" in msg and "\n" not in msg
