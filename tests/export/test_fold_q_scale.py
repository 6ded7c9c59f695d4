"""The rowwise pass folds attention's 1/sqrt(D) into q's projection, also through a GGUF carry's
offset term (MatMulNBits + blocksums @ C): the folded graph's q is bit-identical to scaling after."""

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from dejavuu_build.export.passes.rowwise_kv import _fold_q_scale
from dejavuu_build.quantize.nbits import block_sum_matrix

K, N, NQ, BLOCK = 128, 96, 64, 32


def _graph(scale_after: float | None):
    rng = np.random.default_rng(0)
    nb = K // BLOCK
    inits = {
        "w": rng.integers(0, 256, size=(N, nb, BLOCK // 2), dtype=np.uint8),
        "s": (rng.random(N * nb, dtype=np.float32) * 0.02 + 0.001).astype(np.float32),
        "E": block_sum_matrix(K, BLOCK),
        "C": rng.standard_normal((nb, N)).astype(np.float32),
        "sizes": np.array([NQ, N - NQ], np.int64),
    }
    nodes = [
        helper.make_node(
            "MatMulNBits", ["x", "w", "s"], ["y0"], domain="com.microsoft", K=K, N=N, bits=4, block_size=BLOCK,
            accuracy_level=4, name="/proj/MatMulNBits",
        ),
        helper.make_node("MatMul", ["x", "E"], ["bs"], name="/proj_blocksums/MatMul"),
        helper.make_node("MatMul", ["bs", "C"], ["off"], name="/proj_offset/MatMul"),
        helper.make_node("Add", ["y0", "off"], ["y"], name="/proj/MatMul_AddOffset"),
        helper.make_node("Split", ["y", "sizes"], ["q", "kv"], axis=-1, name="/proj/Split"),
    ]  # fmt: skip
    out = "q"
    if scale_after is not None:
        inits["scale"] = np.array(scale_after, np.float32)
        nodes.append(helper.make_node("Mul", ["q", "scale"], ["q_scaled"], name="/q_scale"))
        out = "q_scaled"
    g = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", K])],
        [helper.make_tensor_value_info(out, TensorProto.FLOAT, None)],
        [numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])


def _run(model, x):
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, {"x": x})[
        0
    ]


def test_scale_folds_through_the_offset_term_bit_exactly():
    m = ir.from_proto(_graph(None))
    split = next(n for n in m.graph if n.op_type == "Split")
    assert _fold_q_scale(m.graph, split, NQ, 0.125, "/layer")
    folded = ir.to_proto(m)
    reference = _graph(0.125)
    rng = np.random.default_rng(1)
    for rows in (1, 2, 3, 5):
        x = rng.standard_normal((rows, K)).astype(np.float32)
        np.testing.assert_array_equal(_run(folded, x), _run(reference, x))


def test_scale_that_is_not_a_power_of_two_is_not_folded():
    m = ir.from_proto(_graph(None))
    split = next(n for n in m.graph if n.op_type == "Split")
    assert not _fold_q_scale(m.graph, split, NQ, 0.1, "/layer")
