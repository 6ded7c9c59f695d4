"""Gemma-3-270M's shapes at reduced depth, built as the default build makes it, on the machine the
suite runs on: its default variant and every int4 flavour must be exact here (batched = incremental,
a lone token one row where the layout allows), whatever the instruction set.

Why shapes and not the file: on an Intel AMX Xeon the real model's int4 failed its batched gate
because its 8-bit lm-head in blocks of 128 (K = 640) gives a row other bits alone than among rows
(docs/exactness.md); the SmolLM2 build (K = 576, blocks of 64) never met that kernel. What decides it
is the hidden size, the head size and the 8-bit table's block, so the model here has Gemma-3-270M's
hidden size (640), heads (4 query, 1 key/value, head size 256), MLP (2048), sliding window (512)
and RoPE bases, two layers (one sliding, one global) and a vocabulary of 16384 instead of 262144
(the row variance is along K: measured the same at N = 2048 and 262144; the full table would make a
700 MB fp32 export and minutes of gates). Random weights, no GGUF: the table is re-rounded at the
block the build measures."""

from __future__ import annotations

import numpy as np
import pytest

from dejavuu_build import schema as S
from dejavuu_build.errors import ValidationFailed

pytestmark = pytest.mark.slow  # minutes on a shared 2-core machine (export, references, gates)
VOCAB = 16384
HEADS, KV_HEADS, HEAD = 4, 1, 256


def attention_variant_near_64_keys() -> str | None:
    """Why Gemma-3's attention is not row-exact on this machine, or None: ONNX Attention at its
    head size (256, 4 query heads over 1 key/value head), concat semantics, at pasts whose rows
    cross 64 keys. On the Intel AMX Xeon (onnxruntime 1.32.0) a row among 2-17 rows differs from
    it beside a pad row there (variant: no row guard helps), while pasts 40, 120 and 1000 are
    guardable; SmolLM2's head size 64 is guardable at all of them (docs/exactness.md)."""
    from onnx import TensorProto, helper

    from dejavuu_build.export import exactness as E

    ins = [
        helper.make_tensor_value_info("q", TensorProto.FLOAT, [1, HEADS, "R", HEAD]),
        helper.make_tensor_value_info("k", TensorProto.FLOAT, [1, KV_HEADS, "T", HEAD]),
        helper.make_tensor_value_info("v", TensorProto.FLOAT, [1, KV_HEADS, "T", HEAD]),
        helper.make_tensor_value_info("mask", TensorProto.FLOAT, [1, 1, "R", "T"]),
    ]
    node = helper.make_node("Attention", ["q", "k", "v", "mask"], ["y"], name="attn")
    out = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    model = helper.make_model(helper.make_graph([node], "a", ins, out), opset_imports=[helper.make_opsetid("", 23)])
    for past in (56, 60):
        p = E.OpProbe("Attention", "Attention", ["attn"], 0)
        fns, why = E._attention(model, node, S.DEFAULT_THREADS, np.random.default_rng(0), S.KV_CONCAT, HEADS, past)
        assert fns is not None, why
        E._compare(p, *fns)
        if p.verdict == "variant":
            return (
                f"ONNX Attention, head size {HEAD}, past {past}: {p.equal_padded}/{p.rows} rows equal beside a "
                f"pad row (variant here; the build's per-op probe, at pasts 40 and 1000, does not see it)"
            )
    return None


@pytest.fixture(scope="module")
def gemma_shapes(cache_dir):
    import torch
    from tiny import tiny_tokenizer
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from dejavuu_build.build.config import TreeDecoderConfig
    from dejavuu_build.build.pipeline import build_tree_decoder

    cfg = Gemma3TextConfig(
        vocab_size=VOCAB,
        hidden_size=640,
        intermediate_size=2048,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        query_pre_attn_scalar=256,
        max_position_embeddings=32768,
        sliding_window=512,
        layer_types=["sliding_attention", "full_attention"],
        rope_theta=1_000_000.0,
        rope_local_base_freq=10_000.0,
        tie_word_embeddings=True,
        architectures=["Gemma3ForCausalLM"],
        bos_token_id=2,
        eos_token_id=[1, 106],
    )
    torch.manual_seed(0)
    src = cache_dir.parent / "src-gemma3-270m-shapes"
    Gemma3ForCausalLM(cfg).eval().save_pretrained(src)
    tiny_tokenizer(VOCAB).save_pretrained(src)
    try:
        res = build_tree_decoder(
            TreeDecoderConfig(
                model=str(src), name="gemma3-270m-shapes", timing=False, reference_tokens=12, max_context=2048
            )
        )
    except ValidationFailed as e:
        why = attention_variant_near_64_keys()
        if why is not None and "batched_vs_incremental" in str(e):
            pytest.xfail(f"not exact on this machine, outside the quantizer: {why}; the build said: {str(e)[:200]}")
        raise
    return res.folder


def test_the_default_and_every_int4_are_exact_on_this_machine(gemma_shapes):
    m = S.read_manifest(gemma_shapes)
    int4 = [v for v in m.variants if S.split_variant(v)[0] == S.INT4]
    assert int4, sorted(m.variants)
    for v in [*int4, m.default_variant]:
        rec = m.variants[v]
        batched = rec.gates["batched_vs_incremental"]
        assert batched["mismatches"] == 0 and batched["logits_maxdiff"] == 0.0, (v, batched, rec.row_guard)
        assert rec.gates["batched_vs_incremental"]["passed"], (v, rec.gates)
        if rec.kv_layout != S.KV_STATIC:  # the static layout keeps its runtime pad row by design
            assert rec.length_invariant, (v, rec.row_guard)
    assert m.default_variant is not None and m.variants[m.default_variant].passed
    # the lm-head table's block was measured here and is not row-variant
    choice = m.variants[S.INT4].quant["lm_head_block"]
    assert choice["signature"] == f"MatMulNBits bits=8 acc=4 K=640 N={VOCAB}"
    assert choice["verdict"] in ("invariant", "guardable") and choice["block"] in choice["candidates"]
    assert 128 in choice["candidates"]  # the plan's block was a candidate, measured before any smaller one
    assert "128" in choice["measured"]
