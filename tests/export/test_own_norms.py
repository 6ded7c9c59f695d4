"""Per-head q/k RMS norms (Gemma 3's q_norm / k_norm) move into our attention operator
(export.passes.own_operators._norms_into_operator): the operator reads the fused projection itself,
computes what the graph's Reshape -> RMSNormalization -> Reshape -> Concat computed (within float32
rounding; the operator's own bits are the ctypes kernel's), and a norm it cannot take stays."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from dejavuu_build import kernels
from dejavuu_build.export.passes.own_operators import _norms_into_operator
from dejavuu_build.kernels import attn

H, KV, D, CAP = 2, 1, 64, 32


def norm_model(q_eps: float = 1e-6, k_eps: float = 1e-6, k_axis: int | None = -1) -> onnx.ModelProto:
    """A fused q/k/v projection's output split, q and k normed per head, packed by a Concat into
    our operator, as own_operators leaves Gemma 3's attention before this pass (``k_axis`` None:
    k's norm without an axis attribute, ONNX's default -1)."""
    rng = np.random.default_rng(0)
    c = lambda name, v: numpy_helper.from_array(np.asarray(v), name)  # noqa: E731
    inits = [
        c("sizes", np.array([H * D, KV * D, KV * D], np.int64)),
        c("q_heads", np.array([1, -1, H, D], np.int64)),  # the exporter's view and flattening
        c("k_heads", np.array([1, -1, KV, D], np.int64)),
        c("flat", np.array([0, 0, -1], np.int64)),
        c("q_scale", (1 + rng.standard_normal(D) * 0.2).astype(np.float32)),
        c("k_scale", (1 + rng.standard_normal(D) * 0.2).astype(np.float32)),
    ]
    nodes = [
        helper.make_node("Split", ["x", "sizes"], ["q", "k", "v"], axis=-1, name="/proj/Split"),
        helper.make_node("Reshape", ["q", "q_heads"], ["qh"], name="/q_view"),
        helper.make_node("RMSNormalization", ["qh", "q_scale"], ["qn"], axis=-1, epsilon=q_eps, name="/q_norm"),
        helper.make_node("Reshape", ["qn", "flat"], ["qf"], name="/q_flat"),
        helper.make_node("Reshape", ["k", "k_heads"], ["kh"], name="/k_view"),
        helper.make_node(
            "RMSNormalization",
            ["kh", "k_scale"],
            ["kn"],
            epsilon=k_eps,
            name="/k_norm",
            **({} if k_axis is None else {"axis": k_axis}),
        ),
        helper.make_node("Reshape", ["kn", "flat"], ["kf"], name="/k_flat"),
        helper.make_node("Concat", ["qf", "kf", "v"], ["qkv"], axis=-1, name="/own_attn/pack_qkv"),
        helper.make_node(
            attn.OP,
            ["qkv", "past_key", "past_value", "cos", "sin", "position_ids", "bias"],
            ["out", "present_key", "present_value"],
            domain=attn.DOMAIN,
            num_heads=H,
            kv_num_heads=KV,
            scale=0.125,
            name="/GroupAttention",
        ),
    ]
    f = TensorProto.FLOAT
    ins = [
        helper.make_tensor_value_info("x", f, [1, "n", (H + 2 * KV) * D]),
        helper.make_tensor_value_info("past_key", f, [1, KV, CAP, D]),
        helper.make_tensor_value_info("past_value", f, [1, KV, CAP, D]),
        helper.make_tensor_value_info("cos", f, [CAP, D // 2]),
        helper.make_tensor_value_info("sin", f, [CAP, D // 2]),
        helper.make_tensor_value_info("position_ids", TensorProto.INT64, [1, "n"]),
        helper.make_tensor_value_info("bias", f, [1, 1, "n", "t"]),
    ]
    outs = [helper.make_tensor_value_info(n, f, None) for n in ("out", "present_key", "present_value")]
    model = helper.make_model(
        helper.make_graph(nodes, "norms", ins, outs, inits),
        opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid(attn.DOMAIN, attn.OPSET)],
    )
    return onnx.shape_inference.infer_shapes(model)


def passed(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    from onnx_ir.passes.common import RemoveUnusedNodesPass

    m = ir.from_proto(model)
    n = _norms_into_operator(m.graph)
    RemoveUnusedNodesPass()(m)
    return ir.to_proto(m), n


def feeds(rows: int = 3, past: int = 5):
    rng = np.random.default_rng(1)
    ang = np.arange(CAP)[:, None] / (10000 ** (np.arange(D // 2) / (D // 2)))
    bias = np.zeros((1, 1, rows, past + rows), np.float32)
    for r in range(rows):
        bias[0, 0, r, past + r + 1 :] = np.float32(-3.4e38)
    return {
        "x": (rng.standard_normal((1, rows, (H + 2 * KV) * D)) * 3).astype(np.float32),
        "past_key": rng.standard_normal((1, KV, CAP, D)).astype(np.float32),
        "past_value": rng.standard_normal((1, KV, CAP, D)).astype(np.float32),
        "cos": np.cos(ang).astype(np.float32),
        "sin": np.sin(ang).astype(np.float32),
        "position_ids": np.arange(past, past + rows)[None],
        "bias": bias,
    }


def run(model: onnx.ModelProto, f: dict) -> list[np.ndarray]:
    so = ort.SessionOptions()
    kernels.register(so, {attn.DOMAIN})
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, f)


@pytest.mark.parametrize("k_axis", [-1, None], ids=["axis-1", "no-axis"])
def test_the_norms_go_into_the_operator_which_reads_the_projection_itself(k_axis):
    before = norm_model(k_axis=k_axis)
    after, n = passed(before)
    assert n == 1
    ops = [nd.op_type for nd in after.graph.node]
    assert ops == [attn.OP], ops  # no Split, Reshape, RMSNormalization or Concat left
    op = after.graph.node[0]
    assert op.input[attn.IN_QKV] == "x"
    assert (op.input[attn.IN_Q_NORM], op.input[attn.IN_K_NORM]) == ("q_scale", "k_scale")
    eps = next(a.f for a in op.attribute if a.name == attn.NORM_EPSILON)
    assert np.float32(eps) == np.float32(1e-6)
    f = feeds()
    want, got = run(before, f), run(after, f)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=0)
    inits = {t.name: numpy_helper.to_array(t) for t in after.graph.initializer}
    kb, vb = f["past_key"][0].copy(), f["past_value"][0].copy()
    direct = attn.attend(
        f["x"][0],
        kb,
        vb,
        f["cos"],
        f["sin"],
        f["position_ids"][0],
        f["bias"][0, 0],
        heads=H,
        kv_heads=KV,
        scale=0.125,
        q_norm=inits["q_scale"],
        k_norm=inits["k_scale"],
        norm_eps=1e-6,
    )
    assert np.array_equal(got[0][0].view(np.uint32), direct.view(np.uint32))  # the kernel's bits
    assert np.array_equal(got[1][0], kb)


@pytest.mark.parametrize("kwargs", [{"k_eps": 1e-5}, {"k_axis": -2}])
def test_a_norm_the_operator_cannot_take_stays(kwargs):
    """q and k normed with other epsilons, or k over more than a head: the graph as it was."""
    before = norm_model(**kwargs)
    after, n = passed(before)
    assert n == 0
    assert [nd.op_type for nd in after.graph.node] == [nd.op_type for nd in before.graph.node]
