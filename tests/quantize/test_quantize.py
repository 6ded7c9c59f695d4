"""The quantizer: int4 body, int8 lm-head, quantized (and correctly tied) embeddings."""

import numpy as np
import onnx
from conftest import build_tiny
from onnx import numpy_helper

from dejavuu_build.quantize.nbits import PLANS, QuantPlan, _quantize_rows, fit_block, quantize_model
from dejavuu_build.schema import read_manifest, variant_file


def _nodes(path):
    m = onnx.load(str(path))
    return m, {n.name: n for n in m.graph.node}


def _attr(node, name):
    return next(onnx.helper.get_attribute_value(a) for a in node.attribute if a.name == name)


def test_int4_body_int8_head_tied_table_shared(tiny_llama):
    m, nodes = _nodes(tiny_llama / variant_file("int4"))
    head = nodes["/lm_head/MatMulNBits"]
    emb = nodes["/model/embed_tokens/GatherBlockQuantized"]
    assert _attr(head, "bits") == 8 and _attr(emb, "bits") == 8
    body = [n for n in m.graph.node if n.op_type == "MatMulNBits" and n is not head]
    assert body and all(_attr(n, "bits") == 4 for n in body)
    assert not any(n.op_type == "MatMul" and n.input[1].endswith("weight_T") for n in m.graph.node)
    # Tied: the head reads the embedding's table through a Reshape view, no second copy.
    view = nodes["/lm_head/MatMul_ViewTied"]
    assert view.input[0] == emb.input[0] and head.input[2] == emb.input[2]
    big_float = [
        i for i in m.graph.initializer if i.data_type == onnx.TensorProto.FLOAT and np.prod(i.dims) >= 256 * 64
    ]
    assert not big_float, "no fp32 embedding table may remain"
    assert not any(n.op_type.startswith("Q") and n.op_type != "QuickGelu" for n in m.graph.node)
    assert sum(n.op_type == "Attention" for n in m.graph.node) == 2
    man = read_manifest(tiny_llama)
    assert man.variants["int4"].quant["tied_embeddings"] is True
    assert man.variants["int4"].bytes < man.variants["int8"].bytes < man.variants["fp32"].bytes


def test_untied_model_keeps_two_tables(cache_dir):
    folder = build_tiny("qwen2", cache_dir)  # tie_word_embeddings=False
    m, nodes = _nodes(folder / variant_file("int4"))
    head, emb = nodes["/lm_head/MatMulNBits"], nodes["/model/embed_tokens/GatherBlockQuantized"]
    assert head.input[1] != emb.input[0]
    assert read_manifest(folder).variants["int4"].quant["tied_embeddings"] is False


def test_quantized_matmul_equals_its_dequantized_weights(tmp_path):
    """MatMulNBits with accuracy_level 0 computes x @ dequant(W) exactly: the packing is right."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    rng = np.random.default_rng(0)
    k, n = 64, 48
    w = rng.standard_normal((k, n)).astype(np.float32)
    emb_w = rng.standard_normal((10, k)).astype(np.float32)
    head_w = rng.standard_normal((n, 7)).astype(np.float32)
    g = helper.make_graph(
        [
            helper.make_node("Gather", ["E", "input_ids"], ["e"], name="/model/embed_tokens/Gather"),
            helper.make_node("MatMul", ["e", "W"], ["h"], name="/model/layers.0/mlp/MatMul"),
            helper.make_node("MatMul", ["h", "H"], ["logits"], name="/lm_head/MatMul"),
        ],
        "g",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, None])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(emb_w, "E"), numpy_helper.from_array(w, "W"), numpy_helper.from_array(head_w, "H")],
    )
    src = tmp_path / "m.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 23)]), str(src))
    for bits in (4, 8):
        for sym in (True, False):
            plan = QuantPlan(
                body_bits=bits, body_block=32, lm_head_bits=8, lm_head_block=16, accuracy_level=0, symmetric=sym
            )
            out = tmp_path / f"q{bits}{sym}.onnx"
            rep = quantize_model(src, out, plan)
            assert rep["tied_embeddings"] is False and rep["quantized_nodes"] == 3
            deq_w = _quantize_rows(w.T, bits, 32, symmetric=sym).dequantize().T
            deq_e = _quantize_rows(emb_w, 8, 32).dequantize()
            deq_h = _quantize_rows(head_w.T, 8, 16).dequantize().T  # the lm-head: 8 bits, block 16
            ids = np.array([[1, 4, 9]])
            h_ref = deq_e[ids[0]] @ deq_w
            # Compare the body output through an extra output: run a graph cut at "h".
            mq = onnx.load(str(out))
            mq.graph.output.append(helper.make_tensor_value_info("h", TensorProto.FLOAT, None))
            body = next(n for n in mq.graph.node if n.name == "/model/layers.0/mlp/MatMulNBits")
            assert (len(body.input) == 4) == (not sym)  # a zero point per block when asymmetric (4 or 8 bits)
            sess = ort.InferenceSession(mq.SerializeToString())
            logits, h = sess.run(None, {"input_ids": ids})
            np.testing.assert_allclose(h[0], h_ref, rtol=1e-4, atol=1e-4)
            np.testing.assert_allclose(logits[0], h[0] @ deq_h, rtol=1e-4, atol=1e-4)
            assert np.abs(deq_h - head_w).max() <= np.abs(head_w).max() / 127
            assert np.abs(deq_w - w).max() <= np.abs(w).max() / (2 ** (bits - 1) - 1)


def test_asymmetric_rounding_beats_symmetric_on_shifted_weights():
    """Weights whose blocks are not centred on zero (what a zero point is for)."""
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((64, 128)) * 0.1 + rng.uniform(-0.3, 0.3, (64, 4)).repeat(32, axis=1)).astype(np.float32)
    err = {
        sym: float(np.square(_quantize_rows(w, 4, 32, symmetric=sym).dequantize() - w).mean()) for sym in (True, False)
    }
    assert err[False] < 0.7 * err[True]


def test_block_fitting():
    assert fit_block(576, 128) == 64 and fit_block(1536, 32) == 32 and fit_block(24, 32) is None
    assert PLANS["int4"].lm_head_bits == 8 and PLANS["int4"].body_bits == 4


def test_quantizing_twice_gives_the_same_bytes(tiny_llama, tmp_path):
    from dejavuu_build.schema import sha256_file

    a, b = tmp_path / "a.onnx", tmp_path / "b.onnx"
    for out in (a, b):
        quantize_model(tiny_llama / variant_file("fp32"), out, PLANS["int4"], tied=True)
    assert sha256_file(a) == sha256_file(b)
    rec = read_manifest(tiny_llama).variants["int4"]
    if not getattr(rec, "row_guard", None):  # a row-guarded variant is rewritten after quantizing
        assert sha256_file(a) == rec.sha256


def test_int4_rerounds_with_zero_points_where_rows_stay_exact(tiny_llama):
    """A non-GGUF source's int4 blocks get a zero point per block (closer to the weights) because
    this machine's kernel keeps every row exact with them, measured; the build records why."""
    from dejavuu_build.quantize.nbits import zero_points_row_exact

    exact, why = zero_points_row_exact(PLANS["int4"].accuracy_level)
    m, nodes = _nodes(tiny_llama / variant_file("int4"))
    head = nodes["/lm_head/MatMulNBits"]
    body = [n for n in m.graph.node if n.op_type == "MatMulNBits" and n is not head]
    assert body and all((len(n.input) == 4) == exact for n in body)
    assert len(head.input) == 3  # the 8-bit table stays symmetric
    rec = read_manifest(tiny_llama).variants["int4"]
    assert rec.quant["rounding"] == {"zero_points": exact, "why": why}
    assert rec.passed  # its batched = incremental gate held with whatever the probe chose


def test_int4_falls_back_to_symmetric_where_zero_points_break_rows(tiny_llama, tmp_path, monkeypatch):
    """Where the probe finds a row that zero points change, re-rounded blocks are symmetric."""
    import dejavuu_build.quantize.nbits as nbits

    monkeypatch.setattr(nbits, "zero_points_row_exact", lambda *a, **k: (False, "row 3 of 17 differs"))
    rep = quantize_model(tiny_llama / variant_file("fp32"), tmp_path / "q.onnx", PLANS["int4"])
    assert rep["rounding"] == {"zero_points": False, "why": "row 3 of 17 differs"}
    m, nodes = _nodes(tmp_path / "q.onnx")
    body = [n for n in m.graph.node if n.op_type == "MatMulNBits" and n.name != "/lm_head/MatMulNBits"]
    assert body and all(len(n.input) == 3 for n in body)
