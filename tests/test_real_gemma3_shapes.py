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
block the build measures.

Its attention (head size 256) was the other break on that machine: onnxruntime's SGEMM reduces a
head of 256 in one pass when a call has at most 64 keys and in two above, so a row whose lone step
and verify step fall on either side of 64 keys got other bits; the build now feeds attention at
least 65 keys (export.passes.key_floor) and its per-op probe crosses 64 keys (docs/exactness.md)."""

from __future__ import annotations

import pytest

from dejavuu_build import schema as S

pytestmark = pytest.mark.slow  # minutes on a shared 2-core machine (export, references, gates)
VOCAB = 16384


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
    res = build_tree_decoder(
        TreeDecoderConfig(
            model=str(src), name="gemma3-270m-shapes", timing=False, reference_tokens=12, max_context=2048
        )
    )
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
    # what the runtime measures before speculating (runtime.calibration, pasts 9, 13, 60, 250, 1020):
    # verify steps of 2-8 rows bit-identical to single steps, so drafts are verified, not decoded plainly
    assert m.variants[m.default_variant].calibration["chain_exact"] is True, m.variants[m.default_variant].calibration


def test_attention_has_its_key_floor_and_the_probe_crossed_64_keys(gemma_shapes):
    """Head size 256: every concat variant feeds its attention at least 65 keys (a call over 64 keys
    or fewer reduces the head in one pass, above in two: export.passes.key_floor), and the build's
    per-op probe measured it at pasts whose rows cross 64 keys; the static twin's GQA has its floor."""
    import onnx

    from dejavuu_build.export.exactness import ATTENTION_PASTS
    from dejavuu_build.export.passes.key_floor import KEY_FLOOR

    m = S.read_manifest(gemma_shapes)
    concat = [v for v in m.variants if S.split_variant(v)[1] == S.KV_CONCAT]
    assert concat, sorted(m.variants)
    assert {56, 60} <= set(ATTENTION_PASTS)
    for v in concat:
        rec = m.variants[v]
        assert rec.row_guard["key_floor"] == KEY_FLOOR, (v, rec.row_guard)
        attn = [p for p in rec.row_guard["probes"] if p["op"] == "Attention"]
        assert len(attn) == 1 and attn[0]["rows"] == 35 * len(ATTENTION_PASTS), attn
        assert attn[0]["verdict"] in ("invariant", "guardable") and attn[0]["equal_padded"] == attn[0]["rows"], attn
        g = onnx.load(str(gemma_shapes / rec.file), load_external_data=False).graph
        assert sum(n.op_type == "Attention" for n in g.node) == 2
        assert sum("/row_guard/key_floor/row_guard/Pad_" in n.name for n in g.node) == 3 * 2
    static = [v for v in m.variants if S.split_variant(v)[1] == S.KV_STATIC]
    assert static, sorted(m.variants)
    g = onnx.load(str(gemma_shapes / m.variants[static[0]].file), load_external_data=False).graph
    assert any("/kv_static/key_floor/" in n.name for n in g.node)
    # the lm-head table's block was measured here and is not row-variant
    choice = m.variants[S.INT4].quant["lm_head_block"]
    assert choice["signature"] == f"MatMulNBits bits=8 acc=4 K=640 N={VOCAB}"
    assert choice["verdict"] in ("invariant", "guardable") and choice["block"] in choice["candidates"]
    assert 128 in choice["candidates"]  # the plan's block was a candidate, measured before any smaller one
    assert "128" in choice["measured"]
