"""The static, in-place KV flavour (export/passes/static_kv.py): the same function as the concat graph it is
made from, on one GroupQueryAttention per layer over a buffer bound in place."""

import collections

import onnx
import pytest
from conftest import build_tiny
from parity import matches_concat, runner

from dejavuu_build import schema as S
from dejavuu_build.export.passes.static_kv import to_static_kv
from dejavuu_build.runtime.session import derive_contract, make_session


@pytest.mark.parametrize("recipe", ["llama", "gemma3"])
def test_static_graph_computes_what_the_concat_graph_computes(recipe, cache_dir):
    """Chain prefill, then a tree over a past longer than Gemma's tiny window (8): logits, hidden
    states and the K/V rows written into the buffer match the concat graph. Gemma's per-head
    norms run tokens-major there: no norm reads a Transpose (static_kv._norm_before_heads_major)."""
    folder = build_tiny(recipe, cache_dir)
    g = onnx.load(folder / S.variant_file("fp32-static"), load_external_data=False).graph
    made_by = {o: n.op_type for n in g.node for o in n.output}
    norms = [n for n in g.node if n.op_type == "RMSNormalization"]
    assert norms and not [n.name for n in norms if made_by.get(n.input[0]) == "Transpose"]
    concat = runner(folder / S.variant_file("fp32"))
    static = runner(folder / S.variant_file("fp32-static"))
    assert static.c.kv_layout == "static" and static.c.kv_capacity > 0 and concat.c.kv_layout == "concat"
    ps = matches_concat(concat, static)
    for v in ps.values():
        assert v.shape[2] == static.c.kv_capacity
        assert not v[:, :, 21:].any()  # nothing written past the new rows


def test_static_graph_shape(tiny_llama):
    """One GQA per layer with RoPE inside, q/k/v and gate/up fused, no Concat/Attention left,
    unused weights dropped, and the buffer's length declared by the graph."""
    src = onnx.load(str(tiny_llama / S.variant_file("int4")))
    g = to_static_kv(src, 96)
    ops = collections.Counter(n.op_type for n in g.graph.node)
    layers = sum(1 for i in src.graph.input if i.name.endswith(".key"))
    assert ops["GroupQueryAttention"] == layers and "Attention" not in ops and "Concat" not in ops
    assert "RotaryEmbedding" not in ops  # in the kernel (do_rotary)
    assert ops["MatMulNBits"] == 4 * layers + 1  # qkv, o, gate_up, down per layer + lm-head
    gqa = next(n for n in g.graph.node if n.op_type == "GroupQueryAttention")
    assert {a.name: onnx.helper.get_attribute_value(a) for a in gqa.attribute}["do_rotary"] == 1
    used = {x for n in g.graph.node for x in n.input}
    assert all(i.name in used for i in g.graph.initializer)
    assert g.ByteSize() < 1.2 * src.ByteSize()
    meta = {p.key: p.value for p in g.metadata_props}
    assert meta["dejavuu.kv_layout"] == "static" and meta["dejavuu.kv_capacity"] == "96"
    past = next(i for i in g.graph.input if i.name == "past_key_values.0.key")
    assert past.type.tensor_type.shape.dim[2].dim_value == 96
    # the attention floor (two query rows at least) folded into the slot index: one Pad of
    # slot_rows, the positions' and the bias's, and no per-layer Pad or Slice
    floor = [n for n in g.graph.node if "/kv_static/row_floor/" in n.name]
    assert sorted(n.op_type for n in floor if n.op_type in ("Pad", "Slice")) == ["Pad"] * 4, floor
    pad = next(n for n in floor if n.name.endswith("/slot_rows"))
    assert pad.input[0] == S.SLOT_ROWS and all(
        n.input[1] == pad.output[0] for n in g.graph.node if n.op_type == "Gather" and "to_slots" in n.name
    )


def test_static_variant_recorded_in_manifest_and_contract(tiny_llama):
    m = S.read_manifest(tiny_llama)
    for prec in ("fp32", "int8", "int4"):
        rec = m.variants[S.variant_name(prec, "static")]
        assert rec.kv_layout == "static" and rec.kv_capacity == 512 and rec.passed
        assert rec.sha256 == S.sha256_file(tiny_llama / rec.file)
        gate = rec.gates["batched_vs_incremental"]
        assert gate["logits_maxdiff"] == 0.0 and gate["rows"] == [2, 17] and 250 in gate["pasts"]
        sess = make_session(tiny_llama / rec.file, threads=1)
        declared = S.variant_contract(S.read_contract(tiny_llama), rec)
        assert derive_contract(sess).kv_capacity == declared.kv_capacity == 512
    assert m.variants["int4"].kv_layout == "concat"


def test_capacity_bounds_positions(tiny_llama, tmp_path):
    """A context that does not fit the buffer is refused with what to do, before any forward;
    one that fits exactly (plus the pad row) runs."""
    from dejavuu_build.errors import GenerationError
    from dejavuu_build.runtime import load

    onnx.save(to_static_kv(onnx.load(str(tiny_llama / S.variant_file("int4"))), 64), str(tmp_path / "d.onnx"))
    m = load(tmp_path / "d.onnx")
    assert m.contract.kv_capacity == 64 and m.decoder.static
    with pytest.raises(GenerationError, match="max-context"):
        m.generate(list(range(3, 60)), max_new_tokens=8)  # 57 + 8 + 1 > 64
    r = m.generate(list(range(3, 58)), max_new_tokens=8)  # 55 + 8 + 1 = 64
    assert len(r.tokens) == 8
