"""Export parity beyond the build gates: tree masks, sliding windows, naming, contract."""

import numpy as np
import onnx
import pytest
from conftest import build_tiny

from dejavuu_build.build.runner import Runner
from dejavuu_build.runtime.session import derive_contract, make_session
from dejavuu_build.runtime.tree import causal_inputs, step_inputs
from dejavuu_build.schema import read_contract, variant_file


def _runner(folder, variant="fp32"):
    sess = make_session(folder / variant_file(variant), threads=1)
    return Runner(sess, read_contract(folder))


def test_names_are_deterministic_and_lm_head_found_by_name(tiny_llama):
    m = onnx.load(str(tiny_llama / variant_file("fp32")), load_external_data=False)
    names = [n.name for n in m.graph.node]
    assert "/lm_head/MatMul" in names and "/model/embed_tokens/Gather" in names
    assert "/model/layers.0/self_attn/q_proj/MatMul" in names
    assert len(set(names)) == len(names)
    assert not any(p.key.startswith("pkg.torch") for n in m.graph.node for p in n.metadata_props)


@pytest.mark.parametrize("recipe", ["llama", "gemma3"])
def test_tree_nodes_equal_their_paths_run_as_chains(recipe, cache_dir):
    """A wrong mask (siblings visible, wrong positions) makes some node differ from its path."""
    folder = build_tiny(recipe, cache_dir)
    r = _runner(folder)
    rng = np.random.default_rng(0)
    past_ids = rng.integers(3, 200, 20)  # past 20 > the tiny Gemma window (8)
    parents = [-1, -1, -1, 0, 0, 1, 3, 6, 6]  # 3 siblings, deep branch, best path not first child
    toks = rng.integers(3, 200, len(parents))
    for i, p in enumerate(parents):  # siblings distinct
        while any(toks[j] == toks[i] for j in range(i) if parents[j] == p):
            toks[i] = rng.integers(3, 200)
    _, _, past = r.prefill(past_ids)
    pos, bias = step_inputs(parents, len(past_ids))
    tree_logits, _, _ = r.forward(toks, pos, bias, past)
    for i in range(len(parents)):
        path, j = [], i
        while j >= 0:
            path.append(toks[j])
            j = parents[j]
        path = np.array(path[::-1])
        pos, bias = causal_inputs(len(path), len(past_ids))
        chain_logits, _, _ = r.forward(path, pos, bias, past)
        np.testing.assert_allclose(tree_logits[i], chain_logits[-1], atol=1e-4)


def test_sibling_leak_would_be_detected(tiny_llama):
    """Sanity of the check above: letting siblings see each other changes the logits."""
    r = _runner(tiny_llama)
    _, _, past = r.prefill(np.arange(5, 15))
    parents = [-1, -1]
    toks = np.array([20, 30])
    pos, bias = step_inputs(parents, 10)
    good, _, _ = r.forward(toks, pos, bias, past)
    bias_leak = bias.copy()
    bias_leak[0, 0, 1, 10] = 0.0  # node 1 sees its sibling (node 0 at past+0)
    bad, _, _ = r.forward(toks, pos, bias_leak, past)
    assert np.abs(good[1] - bad[1]).max() > 1e-3


def test_gemma3_sliding_window_is_kept_in_the_graph(cache_dir):
    """Long prompt (> window) logits equal torch's: dropping the window would break this."""
    from dejavuu_build.build.gates import gate_parity
    from dejavuu_build.build.references import Reference
    from dejavuu_build.schema import REFERENCE_FILE

    folder = build_tiny("gemma3", cache_dir)
    ref = Reference.load(folder / REFERENCE_FILE)
    assert len(ref.chain_ids) > 8 + 16
    res = gate_parity(_runner(folder), ref)
    assert res["passed"], res
    # The gate is sensitive to the window: the same model with the window removed (full attention
    # everywhere) gives logits far from the reference, while the exported graph matches it.
    import torch
    from transformers import AutoModelForCausalLM

    from dejavuu_build.schema import read_manifest

    full = AutoModelForCausalLM.from_pretrained(
        read_manifest(folder).source["path"], dtype=torch.float32, sliding_window=1 << 16
    ).eval()
    with torch.no_grad():
        no_window = full(torch.tensor(np.asarray(ref.chain_ids)[None])).logits[0].numpy()
    r = _runner(folder)
    n = len(ref.chain_ids)
    pos, bias = causal_inputs(n, 0)
    lg, _, _ = r.forward(ref.chain_ids, pos, bias, r.dec.driver.empty_past())
    assert np.abs(lg - ref.chain_logits).max() < 1e-3  # the graph keeps the window
    assert np.abs(no_window - ref.chain_logits).max() > 1e-2  # dropping it would fail the gate
    assert np.abs(lg - no_window).max() > 1e-2
    assert read_contract(folder).sliding_window == [8, None, 8, None]


def test_contract_is_derived_from_the_graph(tiny_llama):
    c = derive_contract(make_session(tiny_llama / variant_file("int4"), threads=1))
    assert c.primary_input == "input_ids" and c.mask_kind == "additive_4d" and c.tree_capable
    assert c.hidden_output == "hidden_states" and c.num_layers == 2 and c.num_kv_heads == 2 and c.head_dim == 16
    assert c.vocab_size == 256
    declared = read_contract(tiny_llama)
    assert declared.num_heads == 4 and declared.eos_token_ids == [2] and declared.max_positions == 512


def test_inputs_embeds_build(cache_dir):
    folder = build_tiny("smolvlm", cache_dir, primary_input="inputs_embeds", variants=("fp32", "int4"))
    c = read_contract(folder)
    assert c.primary_input == "inputs_embeds"
    from dejavuu_build.schema import read_manifest

    m = read_manifest(folder)
    assert m.variants["fp32"].passed and m.variants["fp32"].gates["parity"]["tree_logits_maxdiff"] < 1e-3


def test_rope_cos_and_sin_are_computed_once_per_input(tiny_llama):
    """The exporter writes cos/sin per q and k of every layer from one position tensor; the export
    keeps one of each (dedupe_unary), so no file carries work onnxruntime's CSE would drop."""
    from dejavuu_build.export.exporter import dedupe_unary

    m = onnx.load(str(tiny_llama / variant_file("fp32")), load_external_data=False)
    trig = [(n.op_type, n.input[0]) for n in m.graph.node if n.op_type in ("Cos", "Sin")]
    assert trig and len(trig) == len(set(trig))
    # and the pass does remove repeats, rewiring their readers
    from onnx import TensorProto, helper

    g = helper.make_graph(
        [
            helper.make_node("Cos", ["x"], ["c1"]),
            helper.make_node("Cos", ["x"], ["c2"]),
            helper.make_node("Add", ["c1", "c2"], ["y"]),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
    )
    assert dedupe_unary(g) == 1
    assert [n.op_type for n in g.node] == ["Cos", "Add"] and list(g.node[1].input) == ["c1", "c1"]
