"""`int4op` on a tiny Gemma 3 (heads of 64, a sliding window of 8, q/k/v apart: a per-head norm
sits between the projections and the rotary): its static graph's attention is our operator on
q/k/v packed by one Concat (export.passes.own_operators), computes what the concat graph computes
over a tree past the window, passes the batched gate with no floor, and every drafter reproduces
plain decoding on it, chains and trees. Its per-head norms run on the tokens-major tensor (no
Transpose) and the floor of onnxruntime's attention goes with it (no Pad, no Slice).

Its sliding windows are the operator's (``window``, proved by evaluating the graph's own mask:
export.passes.own_operators._Windows), so the graph's bias is the caller's, rows come apart from
slots as in Llama's static graph and the server batches it: requests side by side get the tokens
each gets alone. (initializer_range 0.1: random weights that keep int4's quality floors, so the
variant is the default and gets the batched graph.)"""

from __future__ import annotations

from collections import Counter

import onnx
import pytest
from parity import assert_lossless, matches_concat, runner

from dejavuu_build import schema as S
from dejavuu_build.build.config import TreeDecoderConfig
from dejavuu_build.build.pipeline import build_tree_decoder
from dejavuu_build.kernels import attn
from dejavuu_build.runtime import load
from dejavuu_build.runtime.drafters import METHODS
from dejavuu_build.runtime.session import graph_domains

pytestmark = pytest.mark.slow  # a build (~30 s on 2 cores)

PROMPTS = ["hello hello hello world", "abcabcabcabc abcabc the cat the cat the cat"]


@pytest.fixture(scope="module")
def entry(cache_dir):
    import torch
    from tiny import tiny_tokenizer
    from transformers import Gemma3ForCausalLM

    from dejavuu_build.recipes.gemma3 import Gemma3Recipe

    cfg = Gemma3Recipe().tiny_config()
    cfg.head_dim, cfg.query_pre_attn_scalar = 64, 64  # a head our operator takes (attn.HEAD_SIZES)
    cfg.initializer_range = 0.1
    torch.manual_seed(0)
    src = cache_dir.parent / "src-gemma3-int4op"
    Gemma3ForCausalLM(cfg).eval().save_pretrained(src)
    tiny_tokenizer(256).save_pretrained(src)
    cfg_build = TreeDecoderConfig(
        model=str(src),
        name="tiny-gemma3-int4op",
        variants=("fp32", "int4op"),
        timing=False,
        reference_tokens=12,
        kv_layouts=(S.KV_CONCAT, S.KV_STATIC),
    )
    return build_tree_decoder(cfg_build)


def test_its_attention_is_ours_on_packed_qkv_and_computes_the_concat_graphs_function(entry):
    static = entry.folder / entry.manifest.variants["int4op-static"].file
    assert graph_domains(static) >= {attn.DOMAIN}
    ops = Counter(n.op_type for n in onnx.load(static, load_external_data=False).graph.node)
    assert ops["GroupAttention"] == 4, ops  # one per layer
    # no floor left (its pads and its cut), and the per-head norms run tokens-major: no Transpose
    assert not {"GroupQueryAttention", "Pad", "Slice", "Transpose"} & set(ops), ops
    # each MLP's Split -> Gelu(tanh) -> Mul after its fused gate/up projection: one GeGLU (the
    # Mul left is the embedding's scale)
    assert ops["GeGLU"] == 4 and "Gelu" not in ops and ops["Mul"] == 1, ops
    # the per-head q/k norms are the operator's: it reads the fused q/k/v projection itself (no
    # Split, Reshape or packing Concat), and the norms left are the layers' four and the last
    assert (
        not {"Split", "Reshape", "Concat"} & set(ops)
        and ops["RMSNormalization"] + ops["SkipSimplifiedLayerNormalization"] == 4 * 4 + 1
    ), ops
    graph = onnx.load(static, load_external_data=False).graph
    producers = {o: n for n in graph.node for o in n.output}
    for n in (n for n in graph.node if n.op_type == "GroupAttention"):
        assert producers[n.input[attn.IN_QKV]].op_type == "Q41MatMul", n.name
        assert len(n.input) == attn.IN_K_NORM + 1 and n.input[attn.IN_Q_NORM] and n.input[attn.IN_K_NORM], n.name
    # the sliding layers (0 and 2) window in the operator: no mask is shaped in the graph, and
    # every attention reads the step's slots through slot_rows / row_slots
    ours = [n for n in graph.node if n.op_type == "GroupAttention"]
    windows = [next((a.i for a in n.attribute if a.name == "window"), 0) for n in ours]
    assert windows == [8, 0, 8, 0], windows
    assert not {"Where", "GreaterOrEqual"} & set(ops), ops
    assert all(n.input[attn.IN_BIAS] == S.ATTENTION_BIAS for n in ours)
    assert all(n.input[attn.IN_SLOT_ROWS] == S.SLOT_ROWS and n.input[attn.IN_ROW_SLOTS] == S.ROW_SLOTS for n in ours)

    # prefill 21 tokens, then a tree over them: past the window of 8, so the sliding layers' mask bites
    files = entry.manifest.variants
    matches_concat(runner(entry.folder / files["int4op"].file), runner(static), atol=1e-4)


def test_the_batched_gate_holds_with_no_floor_and_a_lone_token_is_one_row(entry):
    assert entry.manifest.default_variant == "int4op-static"
    rec = entry.manifest.variants["int4op-static"]
    batched = rec.gates["batched_vs_incremental"]
    assert batched["mismatches"] == 0 and batched["logits_maxdiff"] == 0.0 and batched["total"] > 0, batched
    assert rec.row_guard["guarded_nodes"] == 0 and rec.length_invariant, rec.row_guard


@pytest.mark.parametrize("method", METHODS)
def test_every_method_is_lossless_on_it(entry, method):
    m = load(entry.folder, variant="int4op-static")
    assert m.tree_period, "our operator verifies trees"
    assert_lossless(m, method, PROMPTS)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_the_server_batches_it_and_each_request_gets_its_tokens_alone(entry, temperature):
    """The batched serving graph of the default (export.passes.serve_batch on our operator, windows
    included), gated at build, and requests side by side through the scheduler (every method,
    chains and trees, prompts past the window) get the tokens each gets alone."""
    from scheduling import assert_batched_equal_alone

    b = entry.manifest.batched
    assert b["variant"] == "int4op-static" and b["passed"] and b["gate"]["mismatches"] == 0, b
    assert_batched_equal_alone(load(entry.folder), PROMPTS, temperature)
