"""The block of a re-rounded body weight where a plan asks for blocks wider than the GGUF's 32,
measured on the machine that quantizes (``choose_body_block``): the largest block up to the plan's
whose MatMulNBits keeps rows exact here, so a body streams fewer scales per weight without giving up
a row's bits. The registered int8 keeps 32 (the activations' int8 rounding is per block too:
precisions.py); a registered precision may ask for more (WIDE)."""

from dataclasses import replace

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from dejavuu_build.quantize import nbits
from dejavuu_build.quantize.nbits import (
    PLANS,
    _quantize_rows,
    choose_body_block,
    nbits_rows,
    quantize_model,
    rows_verdict,
)
from dejavuu_build.schema import DEFAULT_THREADS, INT4, INT8

WIDE = replace(PLANS[INT8], body_block=128, symmetric=False)
K, H, F = 128, 96, 256  # the residual stream 128 wide: q, k, up read it; down reads the 256-wide MLP


def _fake_rows(verdicts: dict[int, str]):
    counts = {"invariant": (35, 35, 35), "guardable": (35, 0, 35), "variant": (35, 3, 32)}
    return lambda bits, block, k, n, acc, threads, **kw: counts[verdicts[block]]


@pytest.mark.parametrize(
    "verdicts, block, tier",
    [
        ({128: "variant", 64: "invariant", 32: "invariant", 16: "invariant"}, 64, "invariant"),
        ({128: "invariant", 64: "invariant", 32: "invariant", 16: "invariant"}, 128, "invariant"),
        ({128: "guardable", 64: "variant", 32: "guardable", 16: "invariant"}, 16, "invariant"),
        ({128: "guardable", 64: "variant", 32: "variant", 16: "variant"}, 128, "guardable"),
    ],
)
def test_the_largest_block_in_the_best_tier_is_taken(monkeypatch, verdicts, block, tier):
    monkeypatch.setattr(nbits, "nbits_rows", _fake_rows(verdicts))
    got, why = choose_body_block(8, 1536, 576, 128, 4)
    assert got == block and f"blocks of {block}, {tier} here" in why


def test_no_exact_block_falls_back_to_the_smallest_and_says_so(monkeypatch):
    monkeypatch.setattr(nbits, "nbits_rows", _fake_rows(dict.fromkeys((128, 64, 32, 16), "variant")))
    got, why = choose_body_block(8, 512, 64, 128, 4)
    assert got == 16 and "no block keeps rows exact here" in why and "the batched gate decides" in why


def test_only_blocks_dividing_k_are_candidates(monkeypatch):
    seen: list[int] = []

    def rows(bits, block, k, n, acc, threads, **kw):
        seen.append(block)
        return (35, 35, 35)

    monkeypatch.setattr(nbits, "nbits_rows", rows)
    assert choose_body_block(8, 576, 960, 128, 4)[0] == 64  # 576 = 9 x 64: 128 does not divide it
    assert set(seen) == {64}
    assert choose_body_block(8, 40, 8, 128, 4) == (None, "no block of 16..128 divides K = 40")


def _model(tmp_path):
    rng = np.random.default_rng(0)
    V = 48
    w = {n: (rng.standard_normal(s) * 0.05).astype(np.float32) for n, s in
         (("q", (K, H)), ("k", (K, H)), ("up", (K, F)), ("down", (F, K)))}  # fmt: skip
    emb = rng.standard_normal((V, K)).astype(np.float32)
    head = rng.standard_normal((K, V)).astype(np.float32)
    nodes = [
        helper.make_node("Gather", ["E", "input_ids"], ["x"], name="/model/embed_tokens/Gather"),
        helper.make_node("MatMul", ["x", "Wq"], ["q"], name="/model/layers.0/self_attn/q_proj/MatMul"),
        helper.make_node("MatMul", ["x", "Wk"], ["k"], name="/model/layers.0/self_attn/k_proj/MatMul"),
        helper.make_node("MatMul", ["x", "Wup"], ["u"], name="/model/layers.0/mlp/up_proj/MatMul"),
        helper.make_node("MatMul", ["u", "Wdown"], ["d"], name="/model/layers.0/mlp/down_proj/MatMul"),
        helper.make_node("MatMul", ["d", "Hd"], ["logits"], name="/lm_head/MatMul"),
    ]
    inits = [numpy_helper.from_array(emb, "E"), numpy_helper.from_array(head, "Hd")]
    inits += [numpy_helper.from_array(a, "W" + n) for n, a in w.items()]
    outs = [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in ("logits", "q", "k", "d")]
    g = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, None])], outs, inits
    )
    src = tmp_path / "fp32.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 23)]), str(src))
    return src, w, emb


def test_int8_body_takes_the_block_measured_here_and_computes_its_rounding(tmp_path):
    """The real kernel: the projections reading the residual stream take the measured choice at
    their siblings' summed width, recorded in the report; the down projection, reading the wider
    MLP vector, keeps blocks of 32; the outputs are those roundings' (numeric parity); the untied
    embedding keeps blocks of 32 (a gather reads rows whole); int4's plan keeps the GGUF's 32."""
    src, w, emb = _model(tmp_path)
    plan = WIDE
    assert PLANS[INT8].body_block == 32 and PLANS[INT8].symmetric  # the registered int8: unchanged
    acc = plan.accuracy_level

    def choose(k: int, n: int) -> int:
        return choose_body_block(8, k, n, plan.body_block, acc, zero_points=True)[0]

    group, want_down = choose(K, 2 * H + F), 32
    per = [nbits_rows(8, group, K, 2 * H + F, acc, t, zero_points=True) for t in sorted({1, DEFAULT_THREADS})]
    assert all(rows_verdict(*p) in ("invariant", "guardable") for p in per)  # what was chosen keeps rows exact
    dst = tmp_path / "int8.onnx"
    rep = quantize_model(src, dst, plan)
    recs = rep["body_blocks"]
    sig = f"MatMulNBits bits=8 acc={acc} K={K} N={2 * H + F}"  # q, k, up: one input, one group
    assert list(recs) == [sig] and recs[sig]["block"] == group and f"blocks of {group}" in recs[sig]["why"]
    m = onnx.load(str(dst))
    blocks = {
        n.name: next(a.i for a in n.attribute if a.name == "block_size")
        for n in m.graph.node
        if n.op_type in ("MatMulNBits", "GatherBlockQuantized")
    }
    assert blocks["/model/layers.0/self_attn/q_proj/MatMulNBits"] == group
    assert blocks["/model/layers.0/mlp/up_proj/MatMulNBits"] == group
    assert blocks["/model/layers.0/mlp/down_proj/MatMulNBits"] == want_down
    assert blocks["/model/embed_tokens/GatherBlockQuantized"] == 32
    body = [n for n in m.graph.node if n.op_type == "MatMulNBits" and "/layers." in n.name]
    assert len(body) == 4 and all(len(n.input) == 4 and n.input[3] for n in body)  # zero points
    ids = np.array([[3, 7, 11]])
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    _, q, _, d = sess.run(None, {"input_ids": ids})
    x = _quantize_rows(emb, 8, 32).dequantize()[ids[0]]
    wq = _quantize_rows(w["q"].T, 8, group, symmetric=False).dequantize().T
    np.testing.assert_allclose(q[0], x @ wq, rtol=2e-2, atol=2e-2)  # int8 activations (accuracy_level 4)
    u = x @ _quantize_rows(w["up"].T, 8, group, symmetric=False).dequantize().T
    down = _quantize_rows(w["down"].T, 8, want_down, symmetric=False).dequantize().T
    np.testing.assert_allclose(d[0], u @ down, rtol=5e-2, atol=5e-2)
    for name in (INT8, INT4):  # the registered plans: the GGUF's blocks of 32, nothing measured
        rep_ = quantize_model(src, tmp_path / f"{name}.onnx", PLANS[name])
        assert PLANS[name].body_block == 32 and "body_blocks" not in rep_
    rep4 = rep_
    assert all(n.endswith("bs32") or "bs32 " in n for k_, n in rep4["nodes"].items() if "/layers." in k_)
