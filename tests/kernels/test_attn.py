"""GroupAttention (dejavuu_build/kernels/attn.py, attn.cpp): a query row's bits alone and among
any number of rows, keys a row does not see contributing nothing, every ISA path this CPU runs
giving the same bits, float64 parity, the KV rows written in place, and the operator through
onnxruntime both with its buffers bound in place and without. Compiled once per session into a
temporary cache root, never into ~/.cache."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from dejavuu_build import kernels
from dejavuu_build.kernels import attn, q41
from dejavuu_build.machine import cpu

H, KV = 6, 2  # 3 query heads per kv head

FLAGS = set(cpu()[1])  # this CPU's vector flags
RUNNABLE: list[str | None] = [None, *(["avx2"] if {"avx2", "fma"} <= FLAGS else []), "scalar"]


@pytest.fixture(scope="module", autouse=True)
def kernel_cache(tmp_path_factory):
    root = tmp_path_factory.mktemp("attn-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DEJAVUU_CACHE", str(root))
        yield root


def tables(cap: int, d: int):
    ang = np.arange(cap)[:, None] / (10000 ** (np.arange(d // 2) / (d // 2)))
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def case(rng, rows: int, past: int, d: int = 64, cap: int = 400):
    kb = rng.standard_normal((KV, cap, d)).astype(np.float32)
    vb = rng.standard_normal((KV, cap, d)).astype(np.float32)
    qkv = rng.standard_normal((rows, (H + 2 * KV) * d)).astype(np.float32)
    return qkv, kb, vb


def causal(rows: int, past: int) -> np.ndarray:
    b = np.zeros((rows, past + rows), np.float32)
    for r in range(rows):
        b[r, past + r + 1 :] = np.float32(-3.4e38)
    return b


def run(qkv, kb, vb, cos, sin, pos, bias, isa=None, window=0, **norms):
    """The operator on copies of the buffers: (out, k buffer, v buffer); ``norms``: q_norm, k_norm, norm_eps."""
    kb, vb = kb.copy(), vb.copy()
    out = attn.attend(
        qkv, kb, vb, cos, sin, pos, bias, heads=H, kv_heads=KV, scale=0.125, isa=isa, window=window, **norms
    )
    return out, kb, vb


def bits(a):
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("past", [0, 5, 300])
def test_a_row_alone_is_the_same_row_among_others(isa, past):
    rng = np.random.default_rng(past)
    cos, sin = tables(400, 64)
    qkv, kb, vb = case(rng, 9, past)
    full, fk, fv = run(qkv, kb, vb, cos, sin, np.arange(past, past + 9), causal(9, past), isa)
    for rows in (1, 2, 3, 5, 8):
        part, pk, pv = run(qkv[:rows], kb, vb, cos, sin, np.arange(past, past + rows), causal(rows, past), isa)
        assert np.array_equal(bits(part), bits(full[:rows])), (isa, past, rows)
        assert np.array_equal(pk[:, : past + rows], fk[:, : past + rows])
        assert np.array_equal(pv[:, : past + rows], fv[:, : past + rows])


@pytest.mark.parametrize("isa", RUNNABLE)
def test_keys_a_row_does_not_see_contribute_nothing(isa):
    """A tree row's bits depend on the keys its bias lets it see, never on the others' contents
    (a sibling branch's K/V): what makes verifying a tree of drafts exact."""
    rng = np.random.default_rng(3)
    cos, sin = tables(400, 64)
    past, rows = 37, 6
    qkv, kb, vb = case(rng, rows, past)
    bias = causal(rows, past)
    bias[4, past + 1 : past + 4] = np.float32(-3.4e38)  # row 4's parent is row 0: rows 1-3 are another branch
    out, _, _ = run(qkv, kb, vb, cos, sin, np.arange(past, past + rows), bias, isa)
    other = qkv.copy()
    other[1:4] = rng.standard_normal(other[1:4].shape).astype(np.float32) * 7
    kb2 = kb.copy()
    kb2[:, past + rows :] = np.nan  # beyond every row's keys: read at most into discarded lanes
    out2, _, _ = run(other, kb2, vb, cos, sin, np.arange(past, past + rows), bias, isa)
    assert np.array_equal(bits(out[[0, 4, 5]][:2]), bits(out2[[0, 4]]))


@pytest.mark.parametrize("isa", RUNNABLE)
def test_the_buffers_last_keys_and_hidden_keys_inside_the_range(isa):
    """A context that ends at the buffer's end (capacity not a multiple of 8: the last 8-key group
    is read from a zeroed copy), keys hidden in the middle of a row's range, weights that are
    exactly zero (scores more than 87 below the row's maximum), one kv head (one head a block):
    the paths agree bit for bit, and a row alone is the row among others."""
    rng = np.random.default_rng(21)
    global H, KV
    saved = H, KV
    try:
        for H, KV in ((6, 2), (4, 1)):
            cap, rows = 301, 4
            past = cap - rows
            cos, sin = tables(cap, 64)
            qkv, kb, vb = case(rng, rows, past, 64, cap)
            qkv[:, :64] *= 40  # head 0's scores spread far: some weights are exact zeros
            bias = causal(rows, past)
            bias[:, 100:140] = np.float32(-3.4e38)
            pos = np.arange(past, past + rows)
            want = run(qkv, kb, vb, cos, sin, pos, bias, "scalar")
            got = run(qkv, kb, vb, cos, sin, pos, bias, isa)
            for a, b in zip(got, want):
                assert np.array_equal(bits(a), bits(b)), (isa, H, KV)
            ref = attn.reference(qkv, kb, vb, cos, sin, pos, bias, heads=H, kv_heads=KV, scale=0.125)
            assert np.abs(got[0] - ref).max() < 2e-5 * max(1.0, np.abs(ref).max())
            alone = run(qkv[:1], kb, vb, cos, sin, pos[:1], bias[:1, : past + 1], isa)[0]
            assert np.array_equal(bits(alone), bits(got[0][:1]))
    finally:
        H, KV = saved


@pytest.mark.parametrize("isa", RUNNABLE)
def test_a_sliding_windows_rows_read_their_window_only_with_the_same_bits(isa):
    """Keys a row's bias hides before its window, in whole groups of 8, are not read at all (NaN
    there changes nothing) and the row gets the bits it gets over a buffer that starts where its
    window's group does (the keys before it moved out): the operator's work follows the window, not
    the context, and stays exact. Rows in one block start at different groups."""
    rng = np.random.default_rng(5)
    cos, sin = tables(400, 64)
    past, rows, window = 300, 9, 100
    qkv, kb, vb = case(rng, rows, past)
    pos = np.arange(past, past + rows)
    bias = causal(rows, past)
    for r in range(rows):  # key k unseen where (past + r) - k >= window: the first seen is 201 + r
        bias[r, : past + r - window + 1] = np.float32(-3.4e38)
    out, ok, ov = run(qkv, kb, vb, cos, sin, pos, bias, isa)
    hidden = kb.copy(), vb.copy()
    for b in hidden:
        b[:, :200] = np.nan  # every row's first group of 8 starts at 200 or 208
    got, _, _ = run(qkv, *hidden, cos, sin, pos, bias, isa)
    assert np.array_equal(bits(got), bits(out))
    moved, mk, mv = run(qkv, kb[:, 200:], vb[:, 200:], cos, sin, pos, bias[:, 200:], isa)
    assert np.array_equal(bits(moved), bits(out))
    assert np.array_equal(mk[:, : past - 200 + rows], ok[:, 200 : past + rows])
    for r in (0, 7):  # a row alone: the same bits
        alone = run(qkv[r : r + 1], ok, ov, cos, sin, pos[r : r + 1], bias[r : r + 1, : past + r + 1], isa)[0]
        assert np.array_equal(bits(alone), bits(out[r : r + 1])), r
    ref = attn.reference(qkv, kb, vb, cos, sin, pos, bias, heads=H, kv_heads=KV, scale=0.125)
    assert np.abs(out - ref).max() < 2e-5 * max(1.0, np.abs(ref).max())


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("tree", [False, True])
def test_a_window_attribute_gives_the_bits_of_the_windowed_bias(isa, tree):
    """``window`` W: the operator masks what Gemma 3's exported graph masks with a Where over its
    bias (a key at position k hidden from a query at q where q - k >= W; past keys at their
    index, the slots' keys at their positions, a tree's included), with the same fill: the same
    bits as that bias given whole, K/V written the same, close to float64."""
    rng = np.random.default_rng(8)
    cos, sin = tables(400, 64)
    past, window = 300, 100
    parents = [-1, 0, 1, 1, 0, 4, 2] if tree else list(range(-1, 6))
    rows = len(parents)
    depth = [0] * rows
    for r, p in enumerate(parents):
        depth[r] = 0 if p < 0 else depth[p] + 1
    pos = past + np.array(depth)
    bias = np.full((rows, past + rows), np.float32(-3.4e38))
    bias[:, :past] = 0
    for r in range(rows):
        a = r
        while a >= 0:
            bias[r, past + a] = 0
            a = parents[a]
    key_pos = np.concatenate([np.arange(past), pos])
    windowed = np.where(pos[:, None] - key_pos[None, :] >= window, np.finfo(np.float32).min, bias).astype(np.float32)
    qkv, kb, vb = case(rng, rows, past)
    want = run(qkv, kb, vb, cos, sin, pos, windowed, isa)
    got = run(qkv, kb, vb, cos, sin, pos, bias, isa, window=window)
    for a, b in zip(got, want):
        assert np.array_equal(bits(a), bits(b)), (isa, tree)
    ref = attn.reference(qkv, kb, vb, cos, sin, pos, bias, heads=H, kv_heads=KV, scale=0.125, window=window)
    assert np.abs(got[0] - ref).max() < 2e-5 * max(1.0, np.abs(ref).max())
    assert (
        np.abs(got[0] - attn.reference(qkv, kb, vb, cos, sin, pos, bias, heads=H, kv_heads=KV, scale=0.125)).max()
        > 1e-3
    )


@pytest.mark.parametrize("isa", RUNNABLE)
def test_per_head_norms_in_the_operator(isa):
    """q_norm / k_norm (Gemma 3's per-head RMS norms, before the rotary) in the operator: the
    contract's arithmetic exactly (K written as the normed, rotated key: the same bits as the
    operator fed heads normed by the contract's float32 formula), close to float64, the same bits
    on every path, and a row alone the same row among others."""
    rng = np.random.default_rng(12)
    cos, sin = tables(400, 64)
    past, rows, eps = 40, 6, 1e-6
    qkv, kb, vb = case(rng, rows, past)
    qkv *= 3
    qn = (1 + rng.standard_normal(64) * 0.2).astype(np.float32)
    kn = (1 + rng.standard_normal(64) * 0.2).astype(np.float32)
    pos, bias = np.arange(past, past + rows), causal(rows, past)

    def normed(x: np.ndarray) -> np.ndarray:  # the contract's order, in float32
        y = x.copy()
        for h in range(H + KV):
            t = y[:, h * 64 : (h + 1) * 64]
            ss = np.zeros(len(t), np.float32)
            for i in range(64):
                ss = (ss + t[:, i] * t[:, i]).astype(np.float32)
            r = (np.float32(1) / np.sqrt(ss / np.float32(64) + np.float32(eps))).astype(np.float32)
            y[:, h * 64 : (h + 1) * 64] = ((t * r[:, None]).astype(np.float32) * (qn if h < H else kn)).astype(
                np.float32
            )
        return y

    def go(x, k, v, p, b, norms=True, isa=isa):
        extra = {"q_norm": qn, "k_norm": kn, "norm_eps": eps} if norms else {}
        return run(x, k, v, cos, sin, p, b, isa, **extra)

    got = go(qkv, kb, vb, pos, bias)
    want = go(normed(qkv), kb, vb, pos, bias, norms=False)
    for a, b in zip(got, want):
        assert np.array_equal(bits(a), bits(b)), isa
    ref = attn.reference(qkv, kb, vb, cos, sin, pos, bias, heads=H, kv_heads=KV, scale=0.125, q_norm=qn, k_norm=kn)
    assert np.abs(got[0] - ref).max() < 2e-5 * max(1.0, np.abs(ref).max())
    assert np.array_equal(bits(got[0]), bits(go(qkv, kb, vb, pos, bias)[0]))
    scalar = go(qkv, kb, vb, pos, bias, isa="scalar")[0]
    assert np.array_equal(bits(got[0]), bits(scalar))
    alone = go(qkv[:1], kb, vb, pos[:1], bias[:1, : past + 1])[0]
    assert np.array_equal(bits(alone), bits(got[0][:1]))
    with pytest.raises(ValueError, match="come together"):
        attn.attend(qkv, kb.copy(), vb.copy(), cos, sin, pos, bias, heads=H, kv_heads=KV, scale=0.125, q_norm=qn)


def test_every_path_gives_the_same_bits():
    rng = np.random.default_rng(11)
    for d in attn.HEAD_SIZES:
        cos, sin = tables(300, d)
        for rows, past in ((1, 0), (1, 257), (8, 100), (13, 3)):
            qkv, kb, vb = case(rng, rows, past, d, cap=300)
            want = run(qkv, kb, vb, cos, sin, np.arange(past, past + rows), causal(rows, past), "scalar")
            for isa in RUNNABLE:
                got = run(qkv, kb, vb, cos, sin, np.arange(past, past + rows), causal(rows, past), isa)
                for a, b in zip(got, want):
                    assert np.array_equal(bits(a), bits(b)), (isa, d, rows, past)


@pytest.mark.parametrize("d", attn.HEAD_SIZES)
def test_close_to_float64_and_writes_the_rotated_keys(d):
    rng = np.random.default_rng(d)
    cos, sin = tables(300, d)
    past, rows = 45, 4
    qkv, kb, vb = case(rng, rows, past, d, cap=300)
    bias = causal(rows, past)
    bias[:, :10] += rng.standard_normal((rows, 10)).astype(np.float32)  # a bias that is not only a mask
    pos = np.array([45, 46, 46, 47])  # two slots at one position: a tree's siblings
    out, k2, v2 = run(qkv, kb, vb, cos, sin, pos, bias)
    ref = attn.reference(qkv, kb, vb, cos, sin, pos, bias, heads=H, kv_heads=KV, scale=0.125)
    assert np.abs(out - ref).max() < 2e-5 * max(1.0, np.abs(ref).max())
    new_v = qkv[:, (H + KV) * d :].reshape(rows, KV, d).transpose(1, 0, 2)
    assert np.array_equal(v2[:, past : past + rows], new_v)
    assert np.array_equal(k2[:, :past], kb[:, :past]) and np.array_equal(k2[:, past + rows :], kb[:, past + rows :])
    k = qkv[:, H * d : (H + KV) * d].reshape(rows, KV, d).astype(np.float64)
    c, s = cos[pos].astype(np.float64)[:, None], sin[pos].astype(np.float64)[:, None]
    rot = np.concatenate([k[..., : d // 2] * c - k[..., d // 2 :] * s, k[..., d // 2 :] * c + k[..., : d // 2] * s], -1)
    assert np.abs(k2[:, past : past + rows] - rot.transpose(1, 0, 2)).max() < 1e-5


def model(d: int, cap: int, slots: bool = False) -> bytes:
    extra = ["slot_rows", "row_slots"] if slots else []
    node = helper.make_node(
        attn.OP,
        ["qkv", "past_k", "past_v", "cos", "sin", "pos", "bias", *extra],
        ["out", "present_k", "present_v"],
        domain=attn.DOMAIN,
        num_heads=H,
        kv_num_heads=KV,
        scale=0.125,
    )
    cos, sin = tables(cap, d)
    f = TensorProto.FLOAT
    graph = helper.make_graph(
        [node],
        "attn",
        [
            helper.make_tensor_value_info("qkv", f, [1, None, (H + 2 * KV) * d]),
            helper.make_tensor_value_info("past_k", f, [1, KV, cap, d]),
            helper.make_tensor_value_info("past_v", f, [1, KV, cap, d]),
            helper.make_tensor_value_info("pos", TensorProto.INT64, [1, None]),
            helper.make_tensor_value_info("bias", f, [1, 1, None, None]),
            *[helper.make_tensor_value_info(n, TensorProto.INT64, [None]) for n in extra],
        ],
        [
            helper.make_tensor_value_info("out", f, None),
            helper.make_tensor_value_info("present_k", f, [1, KV, cap, d]),
            helper.make_tensor_value_info("present_v", f, [1, KV, cap, d]),
        ],
        initializer=[numpy_helper.from_array(cos, "cos"), numpy_helper.from_array(sin, "sin")],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(attn.DOMAIN, attn.OPSET)]
    return helper.make_model(graph, opset_imports=opsets).SerializeToString()


def session(m: bytes, threads: int = 2) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    kernels.register(so, {attn.DOMAIN})  # what the runtime does for a graph importing it
    return ort.InferenceSession(m, so, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("rows", [1, 2, 8])
def test_through_onnxruntime_in_place_and_not(rows):
    rng = np.random.default_rng(rows)
    d, cap, past = 64, 200, 77
    cos, sin = tables(cap, d)
    qkv, kb, vb = case(rng, rows, past, d, cap)
    pos = np.arange(past, past + rows)
    want, wk, wv = run(qkv, kb, vb, cos, sin, pos, causal(rows, past))
    s = session(model(d, cap))
    feeds = {
        "qkv": qkv[None],
        "past_k": kb[None],
        "past_v": vb[None],
        "pos": pos[None],
        "bias": causal(rows, past)[None, None],
    }
    out, pk, pv = s.run(None, feeds)  # presents not bound: the past is carried over
    assert np.array_equal(bits(out[0]), bits(want))
    assert np.array_equal(pk[0, :, : past + rows], wk[:, : past + rows])
    assert np.array_equal(pv[0, :, : past + rows], wv[:, : past + rows])
    k, v = kb[None].copy(), vb[None].copy()  # bound in place, as the runtime binds them
    io = s.io_binding()
    io.bind_output("out")
    for name, arr in (("qkv", feeds["qkv"]), ("pos", feeds["pos"]), ("bias", feeds["bias"])):
        io.bind_cpu_input(name, arr)
    for name, arr in (("past_k", k), ("present_k", k), ("past_v", v), ("present_v", v)):
        (io.bind_input if name.startswith("past") else io.bind_output)(
            name, "cpu", 0, np.float32, list(arr.shape), arr.ctypes.data
        )
    s.run_with_iobinding(io)
    assert np.array_equal(bits(io.copy_outputs_to_cpu()[0][0]), bits(want))
    assert np.array_equal(k[0], wk) and np.array_equal(v[0], wv)


@pytest.mark.parametrize("isa", RUNNABLE)
def test_rows_decoupled_from_slots_are_the_gathered_rows(isa):
    """``slot_rows``/``row_slots`` (a tree in its aligned slot layout: pad slots between branches)
    give each row the bits of the same graph with its q/k/v gathered into slots and its output
    gathered back -- the two Gathers the operator replaces -- and pad slots still write keys."""
    rng = np.random.default_rng(5)
    cos, sin = tables(400, 64)
    past, rows = 40, 4
    qkv, kb, vb = case(rng, rows, past)
    slot_rows = np.array([0, 1, 1, 2, 3, 0])  # slots 2 and 5: pads (they read a row again)
    row_slots = np.array([0, 1, 3, 4])
    bias = causal(6, past)
    bias[:, past + 2] = np.float32(-3.4e38)  # nobody sees the pads' keys
    bias[:, past + 5] = np.float32(-3.4e38)
    pos = past + np.array([0, 1, 1, 2, 3, 3])
    gk, gv = kb.copy(), vb.copy()
    got = attn.attend(
        qkv,
        gk,
        gv,
        cos,
        sin,
        pos,
        bias,
        heads=H,
        kv_heads=KV,
        scale=0.125,
        slot_rows=slot_rows,
        row_slots=row_slots,
        isa=isa,
    )
    full, fk, fv = run(qkv[slot_rows], kb, vb, cos, sin, pos, bias, isa)
    assert np.array_equal(bits(got), bits(full[row_slots]))
    assert np.array_equal(gk, fk) and np.array_equal(gv, fv)


def batched_model(d: int, cap: int, batch: int) -> bytes:
    """The operator over a batch of requests (the serving graph's form: export.passes.serve_batch)."""
    names = ["qkv", "past_k", "past_v", "cos", "sin", "pos", "bias", "slot_rows", "row_slots", "seqlens_k", "qlens"]
    node = helper.make_node(
        attn.OP, names, ["out", "present_k", "present_v"], domain=attn.DOMAIN, num_heads=H, kv_num_heads=KV, scale=0.125
    )
    cos, sin = tables(cap, d)
    f, i64, i32 = TensorProto.FLOAT, TensorProto.INT64, TensorProto.INT32
    graph = helper.make_graph(
        [node],
        "attn_batch",
        [
            helper.make_tensor_value_info("qkv", f, [1, None, (H + 2 * KV) * d]),
            helper.make_tensor_value_info("past_k", f, [batch, KV, cap, d]),
            helper.make_tensor_value_info("past_v", f, [batch, KV, cap, d]),
            helper.make_tensor_value_info("pos", i64, [batch, None]),
            helper.make_tensor_value_info("bias", f, [batch, 1, None, None]),
            helper.make_tensor_value_info("slot_rows", i64, [batch, None]),
            helper.make_tensor_value_info("row_slots", i64, [None]),
            helper.make_tensor_value_info("seqlens_k", i32, [batch]),
            helper.make_tensor_value_info("qlens", i32, [batch]),
        ],
        [
            helper.make_tensor_value_info("out", f, None),
            helper.make_tensor_value_info("present_k", f, [batch, KV, cap, d]),
            helper.make_tensor_value_info("present_v", f, [batch, KV, cap, d]),
        ],
        initializer=[numpy_helper.from_array(cos, "cos"), numpy_helper.from_array(sin, "sin")],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(attn.DOMAIN, attn.OPSET)]
    return helper.make_model(graph, opset_imports=opsets).SerializeToString()


def test_a_batch_gives_each_request_the_bits_it_gets_alone():
    """The serving graph's form: requests side by side (a lone token with its pad slot, an idle
    entry, a chain, a tree with pad slots between its branches, at different pasts) get the bits
    each gets alone, and each writes its own buffer only (the idle one none)."""
    rng = np.random.default_rng(11)
    d, cap = 64, 200
    cos, sin = tables(cap, d)
    # (past, rows, slot_rows, row_slots, pad slots) of each request alone; None: idle
    reqs = [
        (10, 1, [0, 0], [0], [1]),
        None,
        (77, 3, [0, 1, 2], [0, 1, 2], []),
        (0, 4, [0, 1, 1, 2, 3, 0], [0, 1, 3, 4], [2, 5]),
    ]
    B, S = len(reqs), 6
    kb = rng.standard_normal((B, KV, cap, d)).astype(np.float32)
    vb = rng.standard_normal((B, KV, cap, d)).astype(np.float32)
    T = max(r[0] + len(r[2]) for r in reqs if r)
    bias = np.full((B, 1, S, T), np.float32(-3.4e38))
    pos = np.zeros((B, S), np.int64)
    slot_rows = np.zeros((B, S), np.int64)
    seqlens, qlens = np.zeros(B, np.int32), np.zeros(B, np.int32)
    qkvs, row_slots, want, wk, wv = [], [], [], kb.copy(), vb.copy()
    o = 0
    for b, r in enumerate(reqs):
        if r is None:
            continue
        past, rows, sr, rs, pads = r
        w = len(sr)
        qkv = rng.standard_normal((rows, (H + 2 * KV) * d)).astype(np.float32)
        bb = causal(w, past)
        for p in pads:  # nobody sees a pad slot's key
            bb[:, past + p] = np.float32(-3.4e38)
        p = past + np.arange(w)
        alone = attn.attend(
            qkv, wk[b], wv[b], cos, sin, p, bb, heads=H, kv_heads=KV, scale=0.125, slot_rows=sr, row_slots=rs
        )
        want.append(alone)
        qkvs.append(qkv)
        bias[b, 0, :w, : past + w] = bb
        pos[b, :w] = p
        slot_rows[b, :w] = o + np.asarray(sr)
        row_slots += [b * S + s for s in rs]
        seqlens[b], qlens[b] = past + w - 1, w
        o += rows
    s = session(batched_model(d, cap, B))
    feeds = {
        "qkv": np.concatenate(qkvs)[None],
        "past_k": kb,
        "past_v": vb,
        "pos": pos,
        "bias": bias,
        "slot_rows": slot_rows,
        "row_slots": np.array(row_slots),
        "seqlens_k": seqlens,
        "qlens": qlens,
    }
    out, pk, pv = s.run(None, feeds)
    assert np.array_equal(bits(out[0]), bits(np.concatenate(want)))
    assert np.array_equal(pk, wk) and np.array_equal(pv, wv)
    assert np.array_equal(pk[1], kb[1]) and np.array_equal(pv[1], vb[1])  # the idle entry: untouched
    for change, match in (
        ({"qlens": np.array([2, 0, 3, 7], np.int32)}, "query_seqlens must be"),  # more slots than the bias has
        ({"row_slots": np.array(row_slots[::-1])}, "grouped by request"),
        ({"row_slots": np.array([*row_slots[:-1], 1 * S])}, "outside the written ones"),  # the idle entry's slot
    ):
        with pytest.raises(Exception, match=match):
            s.run(None, {**feeds, **change})


@pytest.mark.parametrize("isa", RUNNABLE)
def test_swiglu_is_silu_times_up_the_same_bits_on_every_path(isa):
    rng = np.random.default_rng(9)
    x = (rng.standard_normal((5, 2 * 100)) * 6).astype(np.float32)  # F = 100: a tail past the 8-lane loop
    x[0, :4] = [0.0, -120.0, 120.0, -0.0]
    y = attn.swiglu(x, isa=isa)
    g, u = x[:, :100].astype(np.float64), x[:, 100:].astype(np.float64)
    want = g / (1 + np.exp(np.minimum(-g, 88.0))) * u
    assert np.abs(y - want).max() <= 2e-6 * np.abs(want).max()
    assert np.array_equal(bits(y), bits(attn.swiglu(x, isa="scalar")))
    assert np.array_equal(bits(y[2:3]), bits(attn.swiglu(x[2:3], isa=isa)))  # a row alone


@pytest.mark.parametrize("isa", RUNNABLE)
def test_geglu_is_tanh_gelu_times_up_the_same_bits_on_every_path(isa):
    """GeGLU = gelu_tanh(gate) * up (Gemma's MLP: onnx Gelu with approximate="tanh"), within
    float32 rounding of float64, saturating where tanh does; the same bits on every path and for
    a row alone."""
    rng = np.random.default_rng(10)
    x = (rng.standard_normal((5, 2 * 100)) * 4).astype(np.float32)  # F = 100: a tail past the 8-lane loop
    x[0, :6] = [0.0, -60.0, 60.0, -0.0, 1e-3, -1e-3]
    y = attn.geglu(x, isa=isa)
    g, u = x[:, :100].astype(np.float64), x[:, 100:].astype(np.float64)
    want = 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g**3))) * u
    assert np.abs(y - want).max() <= 4e-6 * np.abs(want).max()
    assert y[0, 1] == 0.0 and y[0, 2] == np.float32(60.0) * x[0, 102]  # tanh saturated: 0 and g * up
    assert np.array_equal(bits(y), bits(attn.geglu(x, isa="scalar")))
    assert np.array_equal(bits(y[2:3]), bits(attn.geglu(x[2:3], isa=isa)))  # a row alone


def test_geglu_through_onnxruntime_is_the_kernel_and_close_to_onnx_gelu():
    """The registered GeGLU gives the kernel's bits and stays within float32 rounding of the graph
    it replaces (onnx Split, Gelu(approximate="tanh"), Mul)."""
    so = ort.SessionOptions()
    kernels.register(so, {q41.DOMAIN})
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 64])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    ours = helper.make_model(
        helper.make_graph([helper.make_node(q41.GEGLU_OP, ["x"], ["y"], domain=q41.DOMAIN)], "g", [x], [y]),
        opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid(q41.DOMAIN, q41.OPSET)],
    )
    split = helper.make_node("Split", ["x"], ["g", "u"], axis=-1, num_outputs=2)
    gelu = helper.make_node("Gelu", ["g"], ["a"], approximate="tanh")
    theirs = helper.make_model(
        helper.make_graph([split, gelu, helper.make_node("Mul", ["a", "u"], ["y"])], "o", [x], [y]),
        opset_imports=[helper.make_opsetid("", 20)],
    )
    xv = (np.random.default_rng(11).standard_normal((7, 64)) * 3).astype(np.float32)
    got = ort.InferenceSession(ours.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, {"x": xv})[0]
    ref = ort.InferenceSession(theirs.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": xv})[0]
    assert np.array_equal(bits(got), bits(attn.geglu(xv)))
    assert np.abs(got - ref).max() <= 4e-6 * np.abs(ref).max()


def test_refusals_say_what_is_wrong():
    rng = np.random.default_rng(0)
    cos, sin = tables(64, 32)
    qkv, kb, vb = case(rng, 1, 3, 32, 64)
    with pytest.raises(ValueError, match="head size 32"):
        attn.attend(qkv, kb, vb, cos, sin, [3], causal(1, 3), heads=H, kv_heads=KV, scale=0.1)
    with pytest.raises(ValueError, match="positive multiple of kv_heads"):
        attn.attend(qkv, kb, vb, cos, sin, [3], causal(1, 3), heads=5, kv_heads=2, scale=0.1)
    s = session(model(64, 16))
    cos, sin = tables(16, 64)
    qkv, kb, vb = case(rng, 2, 15, 64, 16)
    feeds = {
        "qkv": qkv[None],
        "past_k": kb[None],
        "past_v": vb[None],
        "pos": np.array([[15, 16]]),
        "bias": causal(2, 15)[None, None],
    }
    with pytest.raises(Exception, match="must fit the buffer"):
        s.run(None, feeds)
    feeds["bias"] = causal(2, 5)[None, None]
    feeds["pos"] = np.array([[5, 99]])
    with pytest.raises(Exception, match="outside the rotary tables"):
        s.run(None, feeds)
    feeds["pos"] = np.array([[5, 6]])
    slotted = session(model(64, 16, slots=True))
    for sr, rs, match in (
        ([0, 7], [0, 1], "slot_rows holds a row outside"),
        ([0, 1], [0, 2], "row_slots holds a slot"),
    ):
        with pytest.raises(Exception, match=match):
            slotted.run(None, {**feeds, "slot_rows": np.array(sr), "row_slots": np.array(rs)})


def test_one_library_registers_both_operators():
    """The attention operator lives in the Q4_1 operator's library: registering it once (what the
    runtime does for a graph that imports both domains) registers both, and a graph with a node of
    each domain runs."""

    so = ort.SessionOptions()
    kernels.register(so, {q41.DOMAIN, attn.DOMAIN})
    assert kernels.OPERATORS[attn.DOMAIN] is kernels.OPERATORS[q41.DOMAIN]
    assert kernels.unavailable([attn.DOMAIN]) is None
    m = onnx.load_from_string(model(64, 32))
    sw = helper.make_node(q41.SWIGLU_OP, ["out"], ["act"], domain=q41.DOMAIN)
    m.graph.node.append(sw)
    m.graph.output.append(helper.make_tensor_value_info("act", TensorProto.FLOAT, None))
    m.opset_import.append(helper.make_opsetid(q41.DOMAIN, q41.OPSET))
    sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(1)
    cos, sin = tables(32, 64)
    qkv, kb, vb = case(rng, 2, 3, 64, 32)
    feeds = {
        "qkv": qkv[None],
        "past_k": kb[None],
        "past_v": vb[None],
        "pos": np.array([[3, 4]]),
        "bias": causal(2, 3)[None, None],
    }
    out, _, _, act = sess.run(None, feeds)
    assert np.array_equal(bits(act[0]), bits(attn.swiglu(out[0])))
