"""The per-op row-invariance probe (export.exactness) and the row guard (export.passes.row_guard)
on small hand-built graphs: the probe's verdicts are what the ops do on this CPU, and a guarded
graph gives every row the same bits alone as among others."""

from __future__ import annotations

import logging

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from dejavuu_build import schema as S
from dejavuu_build.export.exactness import _session, probe
from dejavuu_build.export.passes.row_guard import guard_rows, strip_row_guard

K, N = 128, 96


def _graph(quantize: dict | None) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    w1 = (rng.standard_normal((K, N)) * 0.05).astype(np.float32)
    w2 = (rng.standard_normal((N, K)) * 0.05).astype(np.float32)
    g = helper.make_graph(
        [
            helper.make_node("MatMul", [S.INPUTS_EMBEDS, "w1"], ["h"], name="/up/MatMul"),
            helper.make_node("Relu", ["h"], ["r"], name="/act"),
            helper.make_node("MatMul", ["r", "w2"], ["y"], name="/down/MatMul"),
        ],
        "g",
        [helper.make_tensor_value_info(S.INPUTS_EMBEDS, TensorProto.FLOAT, [1, "rows", K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "rows", K])],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 23)])
    if quantize is None:
        return m
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)
    q = MatMulNBitsQuantizer(m, algo_config=DefaultWeightOnlyQuantConfig(is_symmetric=True, **quantize))
    q.process()
    return q.model.model


def _rows(model, x):
    """(rows computed among all, each row computed alone) of the graph's output."""
    s = _session(model, 2)
    name = s.get_inputs()[0].name
    among = s.run(None, {name: x})[0][0]
    alone = np.stack([s.run(None, {name: x[:, r : r + 1]})[0][0, 0] for r in range(x.shape[1])])
    return among, alone


CASES = {
    "fp32": None,
    "int4 block 32 acc 4": {"bits": 4, "block_size": 32, "accuracy_level": 4},
    "int4 block 16 acc 4": {"bits": 4, "block_size": 16, "accuracy_level": 4},
    "int8 block 32 acc 4": {"bits": 8, "block_size": 32, "accuracy_level": 4},
}


@pytest.mark.parametrize("case", list(CASES))
def test_probe_verdicts_are_what_the_ops_do_and_the_guard_makes_rows_exact(case):
    m = _graph(CASES[case])
    rep = probe(m)
    assert len(rep.probes) == 2 and all(p.rows == 35 for p in rep.probes)
    assert {p.verdict for p in rep.probes} <= {"invariant", "guardable"}, [p.to_json() for p in rep.probes]
    x = np.random.default_rng(1).standard_normal((1, 9, K)).astype(np.float32)
    for p in rep.probes:  # the verdict agrees with the op cut out by hand, fed other rows
        node = next(n for n in m.graph.node if n.name == p.nodes[0])
        width = K if p.signature.endswith(f"N={N}") else N
        one = helper.make_graph(
            [node],
            "one",
            [helper.make_tensor_value_info(node.input[0], TensorProto.FLOAT, [1, "r", width])],
            [helper.make_tensor_value_info(node.output[0], TensorProto.FLOAT, None)],
            [t for t in m.graph.initializer if t.name in node.input],
        )
        among, alone = _rows(helper.make_model(one, opset_imports=list(m.opset_import)), x[..., :width])
        assert (p.verdict == "guardable") == (not np.array_equal(among, alone)), p.to_json()
    guarded = guard_rows(
        onnx.load_from_string(m.SerializeToString()),
        rep.guard_nodes(),
        length_invariant=True,
        record={"machine": rep.machine},
    )
    among, alone = _rows(guarded, x)
    assert np.array_equal(among, alone)
    ref, _ = _rows(m, x)
    assert np.array_equal(among, ref)  # the guard changes no multi-row result
    meta = S.row_guard_info({p.key: p.value for p in guarded.metadata_props})
    assert meta["length_invariant"] is True and meta["nodes"] == len(rep.guard_nodes())


def test_guard_is_deterministic_and_strips_back_to_the_original():
    m = _graph(CASES["int4 block 32 acc 4"])
    nodes = [n.name for n in m.graph.node if n.op_type == "MatMulNBits"]
    a = guard_rows(onnx.load_from_string(m.SerializeToString()), nodes, length_invariant=True)
    b = guard_rows(onnx.load_from_string(m.SerializeToString()), nodes, length_invariant=True)
    assert a.SerializeToString() == b.SerializeToString()
    # the Relu between the two products runs on the padded rows: one Pad in, one Slice out
    assert sum(n.op_type == "Pad" for n in a.graph.node) == 1 and sum(n.op_type == "Slice" for n in a.graph.node) == 1
    assert strip_row_guard(a).SerializeToString() == m.SerializeToString()


def test_guard_refuses_an_unknown_node():
    from dejavuu_build.errors import ExportError

    with pytest.raises(ExportError, match="no node"):
        guard_rows(_graph(None), ["/nope"], length_invariant=True)


def test_padded_rows_flow_through_row_local_ops_and_are_cut_where_an_op_needs_the_forwards_rows():
    """Pad once, keep the pad row through row-local ops (elementwise, a residual Add), cut it before
    an op that is not row-local (Reshape) and before a large product that is not guarded (a second
    row of an lm-head costs time): the graph's rows stay exact and equal to the unguarded graph's."""
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    from dejavuu_build.export.passes.row_guard import SMALL_PRODUCT

    rng = np.random.default_rng(2)
    big = SMALL_PRODUCT // K + 1
    w = {
        "wa": rng.standard_normal((K, K)) * 0.05,
        "wb": rng.standard_normal((K, K)) * 0.05,
        "wbig": rng.standard_normal((K, big)) * 0.05,
        "bias": rng.standard_normal(K),
    }
    g = helper.make_graph(
        [
            helper.make_node("MatMul", [S.INPUTS_EMBEDS, "wa"], ["a"], name="/a/MatMul"),
            helper.make_node("Add", ["a", "bias"], ["ab"], name="/a/Add"),
            helper.make_node("Relu", ["ab"], ["r"], name="/act"),
            helper.make_node("Reshape", ["r", "shape"], ["rs"], name="/reshape"),
            helper.make_node("MatMul", ["rs", "wb"], ["b"], name="/b/MatMul"),
            helper.make_node("Add", ["b", S.INPUTS_EMBEDS], ["h"], name="/residual"),
            helper.make_node("MatMul", ["h", "wbig"], ["y"], name="/big/MatMul"),
        ],
        "g",
        [helper.make_tensor_value_info(S.INPUTS_EMBEDS, TensorProto.FLOAT, [1, "rows", K])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "rows", big]),
            helper.make_tensor_value_info("h", TensorProto.FLOAT, [1, "rows", K]),
        ],
        [numpy_helper.from_array(v.astype(np.float32), k) for k, v in w.items()]
        + [numpy_helper.from_array(np.array([1, -1, K], np.int64), "shape")],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 23)])
    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)
    q = MatMulNBitsQuantizer(
        m, algo_config=DefaultWeightOnlyQuantConfig(is_symmetric=True, bits=4, block_size=32, accuracy_level=4)
    )
    q.process()
    m = q.model.model
    products = {n.name: n for n in m.graph.node if n.op_type == "MatMulNBits"}
    small = sorted(n for n in products if not n.startswith("/big"))
    assert len(small) == 2 and len(products) == 3
    guarded = guard_rows(onnx.load_from_string(m.SerializeToString()), small, length_invariant=True)
    ops = [n.op_type for n in guarded.graph.node]
    # a Pad of the input (shared by the first product and the residual Add) and one after the
    # Reshape; a Slice before the Reshape and one giving back `h` (read by the big product and
    # the graph's output)
    assert ops.count("Pad") == 2 and ops.count("Slice") == 2, ops
    big_node = next(n for n in guarded.graph.node if n.op_type == "MatMulNBits" and n.name.startswith("/big"))
    assert big_node.input[0] == "h"  # the large product reads the forward's rows, not the padded ones
    x = np.random.default_rng(3).standard_normal((1, 7, K)).astype(np.float32)
    s_ref, s_g = _session(m, 2), _session(guarded, 2)
    ref = s_ref.run(None, {S.INPUTS_EMBEDS: x})
    among = s_g.run(None, {S.INPUTS_EMBEDS: x})
    for a, b in zip(ref, among):
        assert np.array_equal(a, b)  # the guard changes no multi-row result
    for r in range(x.shape[1]):  # `h` is computed by guarded products and row-local ops only
        alone = s_g.run(None, {S.INPUTS_EMBEDS: x[:, r : r + 1]})
        assert alone[1].shape == (1, 1, K) and alone[0].shape == (1, 1, big)
        assert np.array_equal(among[1][:, r], alone[1][:, 0])
    assert strip_row_guard(guarded).SerializeToString() == m.SerializeToString()
