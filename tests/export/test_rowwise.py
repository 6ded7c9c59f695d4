"""The rowwise in-place KV flavour (export/passes/rowwise_kv.py): the concat graph's function,
every query row on onnxruntime's one-row kernels, so a single token is one graph row and still
bit-identical to the same token verified among others."""

import collections

import numpy as np
import onnx
import pytest
from conftest import build_tiny
from parity import matches_concat, runner

from dejavuu_build import schema as S
from dejavuu_build.errors import ExportError, GenerationError
from dejavuu_build.export.passes.rowwise_kv import to_rowwise_kv
from dejavuu_build.layouts.rowwise import TILE as ROWWISE_TILE
from dejavuu_build.runtime import load
from dejavuu_build.runtime.session import derive_contract, make_session


def test_rowwise_graph_computes_what_the_concat_graph_computes(tiny_llama):
    """Prefill, then a tree (as one row per node) over it: logits, hidden states and the K/V
    written match the concat graph (fp32, prescaled q: within float rounding)."""
    concat = runner(tiny_llama / S.variant_file("fp32"))
    rowwise = runner(tiny_llama / S.variant_file("fp32-rowwise"))
    assert rowwise.c.kv_layout == "rowwise" and rowwise.c.kv_capacity == 512
    pr = matches_concat(concat, rowwise)
    assert all(v.shape[2] == 21 for v in pr.values())


def test_rowwise_graph_shape(tiny_llama):
    """One ONNX Attention per layer over the bound buffer, K/V written by TensorScatter, q/k/v cut
    from one transpose, the scale folded into the q projection (alpha 1), nothing left of the
    concat cache or of GroupQueryAttention, and the buffer length left to the runtime."""
    src = onnx.load(str(tiny_llama / S.variant_file("int4")))
    g = to_rowwise_kv(src, 96)
    ops = collections.Counter(n.op_type for n in g.graph.node)
    layers = sum(1 for i in src.graph.input if i.name.endswith(".key"))
    assert ops["Attention"] == layers and ops["TensorScatter"] == 2 * layers
    assert "GroupQueryAttention" not in ops and "Concat" not in ops
    before = collections.Counter(n.op_type for n in src.graph.node)
    assert ops["Transpose"] == before["Transpose"] - 2 * layers  # one for q/k/v and one out (of four)
    att = next(n for n in g.graph.node if n.op_type == "Attention")
    assert {a.name: onnx.helper.get_attribute_value(a) for a in att.attribute}["scale"] == 1.0
    assert not [n for n in g.graph.node if n.name.endswith("kv_rowwise/q_scale")]  # folded into the weights
    meta = {p.key: p.value for p in g.metadata_props}
    assert meta["dejavuu.kv_layout"] == "rowwise" and meta["dejavuu.kv_capacity"] == "96"
    names = {i.name for i in g.graph.input}
    assert S.KV_WRITE_INDEX in names and S.SLOT_ROWS not in names  # chains only: no slot layout
    past = next(i for i in g.graph.input if i.name == "past_key_values.0.key")
    assert past.type.tensor_type.shape.dim[2].dim_param == "kv_len"
    used = {x for n in g.graph.node for x in n.input}
    assert all(i.name in used for i in g.graph.initializer)
    # the fused norms' per-row statistics have no reader: left unnamed, so nothing computes them
    skip = [n for n in g.graph.node if n.op_type == "SkipSimplifiedLayerNormalization"]
    assert skip and all(n.output[1] == n.output[2] == "" and n.output[0] and n.output[3] for n in skip)


def test_rowwise_variants_recorded_and_gated(tiny_llama):
    m = S.read_manifest(tiny_llama)
    for prec in ("fp32", "int8", "int4"):
        rec = m.variants[S.variant_name(prec, "rowwise")]
        assert rec.kv_layout == "rowwise" and rec.kv_capacity == 512 and rec.passed
        gate = rec.gates["batched_vs_incremental"]
        assert gate["logits_maxdiff"] == 0.0 and gate["mismatches"] == 0 and 250 in gate["pasts"]
        assert gate["raw_single_row_maxdiff"] == 0.0  # the one-row path IS the runtime's path
        declared = S.variant_contract(S.read_contract(tiny_llama), rec)
        assert derive_contract(make_session(tiny_llama / rec.file, threads=1)).kv_capacity == declared.kv_capacity


def test_one_token_is_one_row_and_bit_identical_to_a_batched_verify(tiny_llama):
    """A single token runs as ONE graph row (no pad), and tokens decoded one by one have logits
    bit-identical to the same tokens verified in one forward, also when the buffer grows in
    between (the steps cross a tile)."""
    m = load(tiny_llama, variant="int4-rowwise")
    dec = m.decoder
    assert dec.rowwise and not dec.pad_single
    rng = np.random.default_rng(3)
    ids = [int(x) for x in rng.integers(3, 200, ROWWISE_TILE - 3)]
    toks = [int(x) for x in rng.integers(3, 200, 9)]
    kv = dec.new_cache()
    try:
        _, _, pres = dec.forward(ids, None, kv)
        kv.commit(pres, len(ids), list(range(len(ids))))
        assert kv.size == ROWWISE_TILE
        fed = []
        feeds = dec.driver.row_feeds
        dec.driver.row_feeds = lambda n, size, start=0: fed.append(feeds(n, size, start)) or fed[-1]
        singles = []
        for t in toks:
            lg, _, pres = dec.forward([t], None, kv)
            kv.commit(pres, 1, [0])
            singles.append(lg[0])
        del dec.driver.row_feeds
        assert [f.ids.shape for f in fed] == [(1, 1)] * len(toks)  # the graph's input_ids: one row
        assert kv.size == 2 * ROWWISE_TILE  # grew on the way
        kv.truncate(len(ids))
        batched, _, _ = dec.forward(toks, None, kv)
        np.testing.assert_array_equal(batched, np.stack(singles))
    finally:
        kv.release()


def test_growth_keeps_the_cache_and_capacity_bounds_positions(tiny_llama, tmp_path):
    from dejavuu_build.layouts.rowwise import GrowingKV

    m = load(tiny_llama, variant="int4-rowwise")
    kv = m.decoder.new_cache()
    assert isinstance(kv, GrowingKV) and kv.size == 0
    kv.ensure(10)
    kv.buf[:, :, :, :10] = 7.0
    kv.length = 10
    kv.ensure(ROWWISE_TILE + 1)
    assert kv.size % ROWWISE_TILE == 0 and kv.size <= kv.capacity
    assert (kv.buf[:, :, :, :10] == 7.0).all()
    kv.release()
    onnx.save(to_rowwise_kv(onnx.load(str(tiny_llama / S.variant_file("int4"))), 64), str(tmp_path / "d.onnx"))
    small = load(tmp_path / "d.onnx")
    assert small.contract.kv_layout == "rowwise" and small.contract.kv_capacity == 64
    with pytest.raises(GenerationError, match="max-context"):
        small.generate(list(range(3, 60)), max_new_tokens=8)  # 57 + 8 > 64
    assert len(small.generate(list(range(3, 57)), max_new_tokens=8).tokens) == 8  # 56 + 8 = 64


def test_a_graph_that_shapes_its_own_mask_has_no_rowwise_flavour(cache_dir):
    """Gemma 3 narrows the caller's mask in-graph for its sliding windows: the pass refuses it by
    name and the build goes on without the flavour (its static variant keeps trees and windows)."""
    folder = build_tiny("gemma3", cache_dir)
    with pytest.raises(ExportError, match="mask of its own"):
        to_rowwise_kv(onnx.load(str(folder / S.variant_file("int4"))), 64)
    m = S.read_manifest(folder)
    assert "int4-static" in m.variants and not [v for v in m.variants if v.endswith("-rowwise")]


def test_a_new_request_does_not_inherit_a_long_requests_buffer(tiny_llama):
    """Attention reads the whole bound buffer: after a long generation, a short one starts small."""
    m = load(tiny_llama, variant="int4-rowwise")
    dec = m.decoder
    kv = dec.new_cache()
    kv.ensure(400)
    big = kv.size
    kv.release()
    kv = dec.new_cache()
    kv.ensure(10)
    assert big >= 400 and kv.size == ROWWISE_TILE
    kv.release()


def test_tree_requests_verify_chains_with_one_warning(tiny_llama, caplog):
    import logging

    m = load(tiny_llama, variant="int4-rowwise")
    base = m.generate("abcabcabcabc", max_new_tokens=20)
    with caplog.at_level(logging.WARNING, logger="dejavuu"):
        r1 = m.generate("abcabcabcabc", method="pld", tree=True, max_new_tokens=20)
        r2 = m.generate("abcabcabcabc", method="suffix_decoding", tree=True, max_new_tokens=20)
    assert r1.tokens == base.tokens == r2.tokens and not r1.tree and not r2.tree and r1.stats.accepted > 0
    assert sum("rowwise variant verifies chains only" in rec.message for rec in caplog.records) == 1
    with pytest.raises(GenerationError, match="chains only"):
        m.decoder.forward([1, 2], [-1, 0], m.decoder.new_cache(), slots=[0, 1])
