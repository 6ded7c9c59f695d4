"""Q41MatMul (dejavuu_build/kernels/q41.py, q41.cpp): the weight layouts, the operator through
onnxruntime against the numpy reference bit for bit, rows alone and together, every ISA path this
CPU can run giving the same bits, and the build cache (reuse, concurrent builders, no compiler).
Every form: 4- or 8-bit levels, with a minimum or centred (no m), float32 or float16 d and m.

The libraries are compiled once per session into a temporary cache root (DEJAVUU_CACHE), never
into ~/.cache."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from dejavuu_build.errors import KernelUnavailable
from dejavuu_build.kernels import q41
from dejavuu_build.machine import cpu

K, N = 96, 40  # 3 blocks; N not a multiple of 16 (3 tiles, the last one 8 columns wide)


FLAGS = set(cpu()[1])  # this CPU's vector flags
BEST = (
    "avx512vnni"
    if {"avx512f", "avx512bw", "avx512_vnni"} <= FLAGS
    else "avx2"
    if {"avx2", "fma"} <= FLAGS
    else "scalar"
)
# every path this CPU runs: None is -march=native (its best one)
RUNNABLE: list[str | None] = [None, *(["avx2"] if {"avx2", "fma"} <= FLAGS else []), "scalar"]


@pytest.fixture(scope="module", autouse=True)
def kernel_cache(tmp_path_factory):
    """A cache root of this module's own (each library compiles once per session)."""
    root = tmp_path_factory.mktemp("q41-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DEJAVUU_CACHE", str(root))
        yield root


@pytest.fixture(scope="module")
def libs(kernel_cache) -> dict[str | None, Path]:
    return {isa: q41.library(isa) for isa in RUNNABLE}


def weights(rng: np.random.Generator, n: int = N, k: int = K):
    nb = k // q41.BLOCK
    q = rng.integers(0, 16, (n, nb, q41.BLOCK), dtype=np.uint8)
    scale = (rng.random((n, nb), dtype=np.float32) * 0.01 + 0.005).astype(np.float32)
    offset = -(rng.random((n, nb), dtype=np.float32) * 0.1 + 0.05).astype(np.float32)
    return q, scale, offset


def awkward(rng: np.random.Generator, rows: int, k: int = K) -> np.ndarray:
    """Activations with the cases that could split the paths: a block of zeros (amax 0), negative
    and large and tiny magnitudes, and exact ties (v*inv = x.5, which rounds to even)."""
    x = rng.standard_normal((rows, k)).astype(np.float32)
    if rows > 1:
        x[1] *= np.float32(3e4)
        x[0, :32] = 0.0
    if rows > 2:
        x[2, 32:64] = np.float32(1e-30) * rng.standard_normal(32).astype(np.float32)
    if rows > 3:  # amax 127 -> sc 1, inv 1: the values themselves are rounded
        x[3, :32] = np.array([127, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5] * 4, np.float32)
    if rows > 4:
        x[4] = -np.abs(x[4])
    return x


def q41_model(packed, d, m, k: int = K, n: int = N, bits: object = None, omit: str = "empty") -> bytes:
    """A one-node graph; ``m`` None (the centred form) is an empty input name (``omit="empty"``) or
    no 4th input at all (``"absent"``); ``bits`` None leaves the attribute out (the default, 4)."""
    attrs = {} if bits is None else {"bits": bits}
    inputs = ["A", "packed", "d", "m"] if m is not None else ["A", "packed", "d"] + ([""] if omit == "empty" else [])
    node = helper.make_node(q41.OP, inputs, ["Y"], domain=q41.DOMAIN, K=k, N=n, **attrs)
    inits = [(packed, "packed"), (d, "d")] + ([(m, "m")] if m is not None else [])
    graph = helper.make_graph(
        [node],
        "q41",
        [helper.make_tensor_value_info("A", TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)],
        initializer=[numpy_helper.from_array(a, name) for a, name in inits],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(q41.DOMAIN, q41.OPSET)]
    return helper.make_model(graph, opset_imports=opsets).SerializeToString()


def session(model: bytes, isa: str | None = None) -> ort.InferenceSession:
    so = ort.SessionOptions()
    q41.register(so, isa)
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


bits_of = bits  # for tests whose parameter is named bits


# ------------------------------------------------------------------------------------ packing
def test_pack_layout_by_hand():
    """Byte g*64 + lane*4 + e of a tile's block holds k = 4g+e low and k = 16+4g+e high; d and m
    are [tiles][nb][16]; columns past N are zero levels with d = m = 0."""
    rng = np.random.default_rng(1)
    n, nb = 20, 2  # 2 tiles, the second with 12 padded columns
    q, scale, offset = weights(rng, n, nb * 32)
    q[0, 0, 0], q[0, 0, 16] = 1, 2
    packed, d, m = q41.pack(q, scale, offset)
    assert packed.dtype == np.uint8 and d.dtype == np.float32 and m.dtype == np.float32
    assert packed.shape == (2 * nb * 256,) and d.shape == m.shape == (2 * nb * 16,)
    assert packed[0] == 0x21
    for t in range(2):
        for b in range(nb):
            base = (t * nb + b) * 256
            for lane in range(16):
                col = t * 16 + lane
                if col < n:
                    assert d[(t * nb + b) * 16 + lane] == scale[col, b]
                    assert m[(t * nb + b) * 16 + lane] == offset[col, b]
                else:
                    assert d[(t * nb + b) * 16 + lane] == 0 and m[(t * nb + b) * 16 + lane] == 0
                for g in range(4):
                    for e in range(4):
                        byte = packed[base + g * 64 + lane * 4 + e]
                        lo, hi = (q[col, b, 4 * g + e], q[col, b, 16 + 4 * g + e]) if col < n else (0, 0)
                        assert byte == lo | (hi << 4), (t, b, lane, g, e)


def test_unpack_inverts_pack():
    rng = np.random.default_rng(2)
    for n in (1, 16, 40):
        q, scale, offset = weights(rng, n, 64)
        q2, s2, o2 = q41.unpack(*q41.pack(q, scale, offset), n, 64)
        assert np.array_equal(q2, q) and np.array_equal(s2, scale) and np.array_equal(o2, offset)


@pytest.mark.parametrize(
    "q, scale, message",
    [
        (np.zeros((4, 2, 16), np.uint8), np.zeros((4, 2), np.float32), r"\[N, nb, 32\]"),
        (np.full((4, 2, 32), 16, np.uint8), np.zeros((4, 2), np.float32), "0..15"),
        (np.full((4, 2, 32), -1, np.int8), np.zeros((4, 2), np.float32), "0..15"),
        (np.zeros((4, 2, 32), np.float32), np.zeros((4, 2), np.float32), "integer"),
        (np.zeros((0, 2, 32), np.uint8), np.zeros((0, 2), np.float32), "N, nb > 0"),
        (np.zeros((4, 2, 32), np.uint8), np.zeros((4, 3), np.float32), "scale must be"),
        (np.zeros((4, 2, 32), np.uint8), np.zeros((4, 2), np.int32), "scale must be"),
    ],
)
def test_pack_rejects_bad_input(q, scale, message):
    with pytest.raises(ValueError, match=message):
        q41.pack(q, scale, np.zeros(scale.shape, np.float32))


# ------------------------------------------------------------------------- the numpy reference
def test_fmaf_is_libms():
    """The reference's fmaf rounds once, as C's does, including the double-rounding trap: a*b =
    1 + 2^-24 (a float32 midpoint) plus a tiny c, where rounding through float64 goes wrong."""
    libm = ctypes.CDLL(ctypes.util.find_library("m") or None)
    libm.fmaf.restype = ctypes.c_float
    libm.fmaf.argtypes = [ctypes.c_float] * 3
    a = np.float32(97 * 257 * 2.0**-12)  # 97 * 257 * 673 = 2^24 + 1
    b = np.float32(673 * 2.0**-12)
    trap = [
        (a, b, np.float32(2.0**-60)),
        (a, b, np.float32(-(2.0**-60))),
        (a, b, np.float32(0)),
        (-a, b, np.float32(2.0**-60)),
    ]
    rng = np.random.default_rng(3)
    rand = rng.standard_normal((3, 2000)).astype(np.float32) * np.float32(10.0) ** rng.integers(-6, 6, (3, 2000))
    cases = trap + list(zip(*rand))
    got = q41.fmaf(*(np.array(c, np.float32) for c in zip(*cases)))
    want = np.array([libm.fmaf(float(x), float(y), float(z)) for x, y, z in cases], np.float32)
    assert np.array_equal(bits(got), bits(want))
    assert got[0] == np.float32(1 + 2.0**-23) and got[1] == np.float32(1)


def test_reference_is_close_to_the_float64_matmul():
    """The int8 activations' rounding is the only error: |y - x @ w| stays under
    sum_b sc_b/2 * sum_k |w| (half a step per activation) plus float32 noise."""
    rng = np.random.default_rng(4)
    q, scale, offset = weights(rng)
    x = awkward(rng, 7)
    y = q41.reference(x, q, scale, offset).astype(np.float64)
    w = q.astype(np.float64) * scale[..., None] + offset[..., None]  # [N, nb, 32]
    exact = x.astype(np.float64) @ w.reshape(N, K).T
    sc = np.abs(x.reshape(7, -1, 32)).max(-1).astype(np.float64) / 127  # [rows, nb]
    bound = (sc / 2 + 1e-6 * sc) @ np.abs(w).sum(-1).T + 1e-5 * (np.abs(x) @ np.abs(w.reshape(N, K)).T)
    assert np.all(np.abs(y - exact) <= bound)


# ------------------------------------------------------------------------- through onnxruntime
@pytest.mark.parametrize("shape", [(1, K), (3, K), (8, K), (13, K), (2, 5, K), (0, K)])
def test_operator_is_the_reference(libs, shape):
    rng = np.random.default_rng(5)
    q, scale, offset = weights(rng)
    s = session(q41_model(*q41.pack(q, scale, offset)))
    rows = int(np.prod(shape[:-1]))
    x = awkward(rng, rows).reshape(shape) if rows else np.zeros(shape, np.float32)
    y = s.run(None, {"A": x})[0]
    assert y.shape == (*shape[:-1], N) and y.dtype == np.float32
    assert np.array_equal(bits(y), bits(q41.reference(x, q, scale, offset)))


@pytest.mark.parametrize("rows", [8, 13])
def test_a_row_alone_is_the_same_row_among_others(libs, rows):
    """What makes speculative verification lossless: no row's bits depend on the others."""
    rng = np.random.default_rng(6)
    q, scale, offset = weights(rng)
    s = session(q41_model(*q41.pack(q, scale, offset)))
    x = awkward(rng, rows)
    together = s.run(None, {"A": x})[0]
    for r in range(rows):
        assert np.array_equal(bits(s.run(None, {"A": x[r : r + 1]})[0][0]), bits(together[r])), r


def test_operator_refuses_bad_shapes_and_attributes(libs):
    rng = np.random.default_rng(7)
    q, scale, offset = weights(rng)
    packed, d, m = q41.pack(q, scale, offset)
    s = session(q41_model(packed, d, m))
    with pytest.raises(Exception, match="last dimension must be K = 96"):
        s.run(None, {"A": np.zeros((2, 64), np.float32)})
    with pytest.raises(Exception, match="packed must hold"):
        session(q41_model(packed, d, m, n=N + 16)).run(None, {"A": np.zeros((1, K), np.float32)})
    with pytest.raises(Exception, match="positive multiple of 32"):
        session(q41_model(packed, d, m, k=K + 1)).run(None, {"A": np.zeros((1, K + 1), np.float32)})


def test_register_turns_a_refusal_into_kernel_unavailable(libs):
    class Refusing:
        def register_custom_ops_library(self, path):
            raise RuntimeError("no custom ops here")

    with pytest.raises(KernelUnavailable, match="refused.*no custom ops here"):
        q41.register(Refusing())
    assert q41.available()


# ------------------------------------------------------------------------------------ ISA paths
def test_native_build_is_this_cpus_best_path(libs):
    assert q41.isa_of(libs[None]) == BEST
    assert [q41.isa_of(libs[isa]) for isa in RUNNABLE[1:]] == [isa for isa in RUNNABLE[1:]]


def test_every_path_gives_the_same_bits(libs):
    """avx512vnni, avx2 and scalar (those this CPU runs): the same bits as each other and as the
    reference, on a realistic shape (K 576, N not a multiple of 16) and every row count 1..9."""
    rng = np.random.default_rng(8)
    k, n = 576, 200
    q, scale, offset = weights(rng, n, k)
    packed, d, m = q41.pack(q, scale, offset)
    x = awkward(rng, 9, k)
    want = bits(q41.reference(x, q, scale, offset))
    for isa in RUNNABLE:
        for rows in (1, 2, 7, 8, 9):
            assert np.array_equal(bits(q41.gemm(x[:rows], packed, d, m, n, isa=isa)), want[:rows]), (isa, rows)
    model = q41_model(packed, d, m, k, n)
    for isa in RUNNABLE:  # and through onnxruntime's thread pool
        assert np.array_equal(bits(session(model, isa).run(None, {"A": x})[0]), want), isa


# ------------------------------------------------------------------ the forms: bits, centred, float16
# every form: (bits, centred (no m), float16 d and m); (4, False, False) is the original one
FORMS = [(b, c, h) for b in (4, 5, 8) for c in (False, True) for h in (False, True)]
FORM_IDS = [f"q{b}-{'centred' if c else 'min'}-{'f16' if h else 'f32'}" for b, c, h in FORMS]


def form_weights(rng: np.random.Generator, bits: int, centred: bool, half: bool, n: int = N, k: int = K):
    """Levels over the whole range of ``bits``, scales and (unless centred) offsets; with ``half``
    values that are exactly float16 (what pack then writes as float16)."""
    nb = k // q41.BLOCK
    q = rng.integers(0, 1 << bits, (n, nb, q41.BLOCK), dtype=np.uint16).astype(np.uint8)
    step = {4: 0.01, 5: 0.005, 8: 0.0006}[bits]
    scale = (rng.random((n, nb), dtype=np.float32) * step + step / 2).astype(np.float32)
    offset = -(rng.random((n, nb), dtype=np.float32) * 0.1 + 0.05).astype(np.float32)
    if half:
        scale, offset = (a.astype(np.float16).astype(np.float32) for a in (scale, offset))
    return q, scale, None if centred else offset


def form_pack(q, scale, offset, bits: int, half: bool):
    return q41.pack(q, scale, offset, bits=bits, scale_dtype=np.float16 if half else np.float32)


def form_model(bits: int, centred: bool, half: bool, rng: np.random.Generator, n: int = N, k: int = K):
    q, scale, offset = form_weights(rng, bits, centred, half, n, k)
    packed, d, m = form_pack(q, scale, offset, bits, half)
    return (q, scale, offset), (packed, d, m), q41_model(packed, d, m, k, n, bits=None if bits == 4 else bits)


def test_pack_8bit_layout_by_hand():
    """bits 8: byte g*64 + lane*4 + e of a tile's block holds the level of k = 4g+e (8 groups, 512
    bytes); float16 d as [tiles][nb][16]; the centred form has no m."""
    rng = np.random.default_rng(11)
    n, nb = 20, 2
    q, scale, _ = form_weights(rng, 8, True, True, n, nb * 32)
    q[0, 0, 0], q[0, 0, 31] = 255, 0
    packed, d, m = q41.pack(q, scale, None, bits=8, scale_dtype=np.float16)
    assert m is None and packed.dtype == np.uint8 and d.dtype == np.float16
    assert packed.shape == (2 * nb * 512,) and d.shape == (2 * nb * 16,)
    assert packed[0] == 255 and packed[7 * 64 + 3] == 0
    for t in range(2):
        for b in range(nb):
            base = (t * nb + b) * 512
            for lane in range(16):
                col = t * 16 + lane
                assert d[(t * nb + b) * 16 + lane] == (scale[col, b] if col < n else 0)
                for g in range(8):
                    for e in range(4):
                        want = q[col, b, 4 * g + e] if col < n else 0
                        assert packed[base + g * 64 + lane * 4 + e] == want, (t, b, lane, g, e)


def test_pack_5bit_layout_by_hand():
    """bits 5: the 4-bit layout of the levels' low 4 bits (byte g*64 + lane*4 + e: k = 4g+e low,
    k = 16+4g+e high nibble), then 64 bytes whose byte 256 + lane*4 + e holds in bit j the fifth
    bit of k = 4j+e (320 bytes per tile and block)."""
    rng = np.random.default_rng(21)
    n, nb = 20, 2
    q, scale, _ = form_weights(rng, 5, True, True, n, nb * 32)
    q[0, 0, 0], q[0, 0, 31] = 31, 16
    packed, d, m = q41.pack(q, scale, None, bits=5, scale_dtype=np.float16)
    assert m is None and packed.shape == (2 * nb * 320,) and q41.tile_bytes(5) == 320
    assert packed[0] & 15 == 15 and packed[3 * 64 + 3] >> 4 == 0 and packed[256] & 1 == 1
    assert (packed[256 + 3] >> 7) & 1 == 1  # k = 31 = 4*7 + 3: lane 0, e 3, bit 7
    for t in range(2):
        for b in range(nb):
            base = (t * nb + b) * 320
            for lane in range(16):
                col = t * 16 + lane
                for k in range(32):
                    want = int(q[col, b, k]) if col < n else 0
                    g, e = (k % 16) // 4, k % 4
                    nib = packed[base + g * 64 + lane * 4 + e]
                    low = nib & 15 if k < 16 else nib >> 4
                    fifth = (packed[base + 256 + lane * 4 + e] >> (k // 4)) & 1
                    assert low | (fifth << 4) == want, (t, b, lane, k)


def test_5bit_extremes_do_not_saturate(libs):
    """Levels 0 and 31 against activations at +-127: four groups of pairs at 2*31*127 reach 31496,
    the int16 edge the avx2 path sums to; integer activations and power-of-two scales make the
    float64 matmul exact, so every path must give exactly it (both forms, both scale types)."""
    k, n = 128, 40
    nb = k // 32
    q = np.zeros((n, nb, 32), np.uint8)
    q[0::4] = 31
    q[2::4, :, 0::2] = 31
    q[3::4] = np.arange(32, dtype=np.uint8)
    x = np.empty((5, k), np.float32)
    x[0], x[1] = 127, -127
    x[2] = np.tile([127, -127], k // 2)
    x[3] = np.where(np.arange(k) % 32 < 16, 127, -127)
    x[4] = np.where(np.arange(k) % 3 == 0, 127, -127)
    scale = np.full((n, nb), 2.0**-6, np.float32)
    for centred in (True, False):
        offset = None if centred else np.full((n, nb), -0.5, np.float32)
        w = q.astype(np.float64) * scale[..., None]
        w = w - 16 * scale[..., None] if centred else w + offset[..., None]
        exact = x.astype(np.float64) @ w.reshape(n, k).T
        assert np.array_equal(q41.reference(x, q, scale, offset, bits=5).astype(np.float64), exact)
        for half in (False, True):
            packed, d, m = q41.pack(q, scale, offset, bits=5, scale_dtype=np.float16 if half else np.float32)
            for isa in RUNNABLE:
                got = q41.gemm(x, packed, d, m, n, bits=5, isa=isa)
                assert np.array_equal(got.astype(np.float64), exact), (isa, centred, half)
            y = session(q41_model(packed, d, m, k, n, bits=5)).run(None, {"A": x})[0]
            assert np.array_equal(y.astype(np.float64), exact), (centred, half)


def test_pack_keeps_the_original_form():
    """pack(q, scale, offset) is bits 4 with float32 d and m, as before; bits=4 and float32 said
    explicitly give the same arrays; the centred 4-bit form has the same levels and d."""
    rng = np.random.default_rng(12)
    q, scale, offset = weights(rng)
    packed, d, m = q41.pack(q, scale, offset)
    same = q41.pack(q, scale, offset, bits=4, scale_dtype=np.float32)
    assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip((packed, d, m), same))
    assert d.dtype == m.dtype == np.float32 and packed.size == q41.tile_bytes(4) * 3 * 3
    p2, d2, m2 = q41.pack(q, scale)
    assert m2 is None and np.array_equal(p2, packed) and np.array_equal(d2, d)


@pytest.mark.parametrize("bits, centred, half", FORMS, ids=FORM_IDS)
def test_unpack_inverts_pack_every_form(bits, centred, half):
    rng = np.random.default_rng(13)
    for n in (1, 16, 40):
        q, scale, offset = form_weights(rng, bits, centred, half, n, 64)
        packed, d, m = form_pack(q, scale, offset, bits, half)
        assert d.dtype == (np.float16 if half else np.float32) and (m is None) == centred
        q2, s2, o2 = q41.unpack(packed, d, m, n, 64, bits=bits)
        assert np.array_equal(q2, q) and np.array_equal(s2, scale) and s2.dtype == np.float32
        assert (o2 is None) if centred else np.array_equal(o2, offset)


def test_fits_float16():
    f = q41.fits_float16
    assert f(np.array([0.5, -0.0, 0.0, 65504.0, 2.0**-24, -(2.0**-14), np.inf, -np.inf], np.float32))
    assert f(np.float16([1.1, 3.3e-5]).astype(np.float32)) and f(np.zeros((0,), np.float32))
    for bad in (0.1, 65520.0, 1e5, 2.0**-25, 1e-8, 1 + 2.0**-11):
        assert not f(np.array([0.5, bad], np.float32)), bad


@pytest.mark.parametrize(
    "kwargs, q_top, message",
    [
        ({"bits": 3}, 7, "bits must be 4, 5 or 8"),
        ({"bits": 16}, 7, "bits must be 4, 5 or 8"),
        ({"bits": 8}, 256, r"0\.\.255"),
        ({"bits": 5}, 32, r"0\.\.31"),
        ({"bits": 4}, 16, r"0\.\.15"),
        ({"scale_dtype": np.float64}, 7, "scale_dtype must be float32 or float16"),
    ],
)
def test_pack_rejects_bad_forms(kwargs, q_top, message):
    q = np.zeros((4, 2, 32), np.int32)
    q[0, 0, 0] = q_top
    with pytest.raises(ValueError, match=message):
        q41.pack(q, np.full((4, 2), 0.5, np.float32), None, **kwargs)


def test_pack_float16_refuses_values_that_are_not_float16():
    q = np.zeros((4, 2, 32), np.uint8)
    ok = np.full((4, 2), 0.5, np.float32)
    with pytest.raises(ValueError, match="scale holds values that are not exactly float16"):
        q41.pack(q, np.full((4, 2), 0.1, np.float32), None, scale_dtype=np.float16)
    with pytest.raises(ValueError, match="offset holds values that are not exactly float16"):
        q41.pack(q, ok, np.full((4, 2), 1e5, np.float32), scale_dtype=np.float16)
    assert q41.pack(q, ok, ok, scale_dtype=np.float16)[1].dtype == np.float16


def centred_bound(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """What the centred form may differ from the float64 matmul x @ w (w [N, nb, 32], exact in
    float64), provably, for finite x with nb blocks: per activation |x - sc*qa| <= sc/2 + 4u*amax
    (u = 2^-24: qa = rint(fl(x*inv)) is within 1/2 of fl(x*inv), which is within u|x*inv| of x*inv,
    and sc*inv = 1 + (at most u)); the float terms t_b = fl(fl(dotc) * fl(d*sc)) are the exact
    d*sc*dotc within (2u + u^2) (dotc and its conversion are exact), and their float32 sum over nb
    blocks within (nb-1)u/(1-(nb-1)u) of the sum of their magnitudes, each at most
    (1+3u) * sc*127 * sum|w| <= (1+4u) * amax * sum|w|. (Assumes no float32 underflow: the
    test's smallest block, amax ~1e-30, keeps sc and d*sc normal.)"""
    rows, k = x.shape
    n, nb, _ = w.shape
    xb = x.reshape(rows, nb, 32)
    amax = np.abs(xb).max(-1)  # float32, exact
    sc = (amax / np.float32(127)).astype(np.float32).astype(np.float64)
    amax = amax.astype(np.float64)
    u = 2.0**-24
    wsum = np.abs(w).sum(-1)  # [N, nb]
    act = (sc / 2 + 4 * u * amax) @ wsum.T
    gamma = (nb + 2) * u / (1 - (nb + 2) * u)
    flt = gamma * (1 + 4 * u) * (amax @ wsum.T)
    return (act + flt) * (1 + 1e-12) + 1e-300


@pytest.mark.parametrize("bits", [4, 5, 8])
def test_centred_form_is_close_to_the_float64_matmul(bits):
    rng = np.random.default_rng(14)
    for k in (K, 576):
        q, scale, _ = form_weights(rng, bits, True, False, N, k)
        x = awkward(rng, 7, k)
        y = q41.reference(x, q, scale, bits=bits).astype(np.float64)
        w = (q.astype(np.float64) - 2 ** (bits - 1)) * scale[..., None]  # [N, nb, 32]
        exact = x.astype(np.float64) @ w.reshape(N, k).T
        err, bound = np.abs(y - exact), centred_bound(x, w)
        assert np.all(err <= bound), float((err / bound).max())
        assert float((err / bound).max()) > 1e-3  # the bound is not vacuous: errors reach a part of it


@pytest.mark.parametrize("shape", [(1, K), (3, K), (8, K), (13, K), (2, 5, K), (0, K)])
@pytest.mark.parametrize("bits, centred, half", FORMS, ids=FORM_IDS)
def test_every_form_through_onnxruntime_is_the_reference(libs, bits, centred, half, shape):
    rng = np.random.default_rng(15)
    (q, scale, offset), _, model = form_model(bits, centred, half, rng)
    s = session(model)
    rows = int(np.prod(shape[:-1]))
    x = awkward(rng, rows).reshape(shape) if rows else np.zeros(shape, np.float32)
    y = s.run(None, {"A": x})[0]
    assert y.shape == (*shape[:-1], N) and y.dtype == np.float32
    assert np.array_equal(bits_of(y), bits_of(q41.reference(x, q, scale, offset, bits=bits)))


@pytest.mark.parametrize("rows", [8, 13])
@pytest.mark.parametrize("bits, centred, half", FORMS, ids=FORM_IDS)
def test_every_form_a_row_alone_is_the_same_row_among_others(libs, bits, centred, half, rows):
    rng = np.random.default_rng(16)
    _, _, model = form_model(bits, centred, half, rng)
    s = session(model)
    x = awkward(rng, rows)
    together = s.run(None, {"A": x})[0]
    for r in range(rows):
        assert np.array_equal(bits_of(s.run(None, {"A": x[r : r + 1]})[0][0]), bits_of(together[r])), r


@pytest.mark.parametrize("bits, centred", [(b, c) for b in (4, 5, 8) for c in (False, True)])
def test_float16_scales_are_the_same_bits_as_float32(libs, bits, centred):
    """The same values as float16 and as float32 d/m: the same bits, through onnxruntime (whose
    session keeps the float16 initializers as they are: the mixed-type refusal below shows the
    kernel sees them) and through every path's gemm."""
    rng = np.random.default_rng(17)
    q, scale, offset = form_weights(rng, bits, centred, True, 200, 576)
    x = awkward(rng, 9, 576)
    p32, d32, m32 = form_pack(q, scale, offset, bits, False)
    p16, d16, m16 = form_pack(q, scale, offset, bits, True)
    assert np.array_equal(p32, p16) and d16.dtype == np.float16 and d16.nbytes * 2 == d32.nbytes
    attr = None if bits == 4 else bits
    y32 = session(q41_model(p32, d32, m32, 576, 200, bits=attr)).run(None, {"A": x})[0]
    y16 = session(q41_model(p16, d16, m16, 576, 200, bits=attr)).run(None, {"A": x})[0]
    assert np.array_equal(bits_of(y16), bits_of(y32))
    for isa in RUNNABLE:
        g16 = q41.gemm(x, p16, d16, m16, 200, bits=bits, isa=isa)
        assert np.array_equal(bits_of(g16), bits_of(y32)), isa


@pytest.mark.parametrize("bits, centred, half", FORMS, ids=FORM_IDS)
def test_every_path_gives_the_same_bits_on_every_form(libs, bits, centred, half):
    """avx512vnni, avx2 and scalar (those this CPU runs), on every form: the same bits as each
    other and as the reference, on K 576 with N not a multiple of 16, rows 1..9, directly and
    through onnxruntime's thread pool."""
    rng = np.random.default_rng(18)
    k, n = 576, 200
    (q, scale, offset), (packed, d, m), model = form_model(bits, centred, half, rng, n, k)
    x = awkward(rng, 9, k)
    want = bits_of(q41.reference(x, q, scale, offset, bits=bits))
    for isa in RUNNABLE:
        for rows in (1, 2, 7, 8, 9):
            got = q41.gemm(x[:rows], packed, d, m, n, bits=bits, isa=isa)
            assert np.array_equal(bits_of(got), want[:rows]), (isa, rows)
        assert np.array_equal(bits_of(session(model, isa).run(None, {"A": x})[0]), want), isa


@pytest.mark.parametrize("centred", [True, False])
def test_8bit_extremes_do_not_saturate(libs, centred):
    """A Q8_0-like case at the int16 edge: levels 0 and 255 with activations at +-127 (a block
    whose amax is 127 has sc = 1, so qa = x): a level-255 pair times 127 is 64770, past int16,
    which the avx2 path's nibble split must not saturate. Integer activations and power-of-two
    scales make the float64 matmul exact, so every path must give exactly it."""
    k, n = 128, 48
    nb = k // 32
    q = np.zeros((n, nb, 32), np.uint8)
    q[0::4] = 255
    q[1::4] = 0
    q[2::4, :, 0::2] = 255  # alternating 255, 0
    q[3::4] = np.arange(32, dtype=np.uint8) * 8 + 7  # 7..255
    scale = np.full((n, nb), 2.0**-7, np.float32)
    scale[::3] = 2.0**-10
    offset = None if centred else np.full((n, nb), -1.0, np.float32)
    x = np.empty((6, k), np.float32)
    x[0], x[1] = 127, -127
    x[2] = np.tile([127, -127], k // 2)
    x[3] = np.tile([127, 127, -127, -127], k // 4)
    x[4] = np.where(np.arange(k) % 3 == 0, 127, -127)
    x[5, : k // 2], x[5, k // 2 :] = 127, -127
    w = q.astype(np.float64) * scale[..., None].astype(np.float64)
    w = w - 128 * scale[..., None] if centred else w + offset[..., None]
    exact = x.astype(np.float64) @ w.reshape(n, k).T
    ref = q41.reference(x, q, scale, offset, bits=8)
    assert np.array_equal(ref.astype(np.float64), exact)
    for half in (False, True):
        packed, d, m = q41.pack(q, scale, offset, bits=8, scale_dtype=np.float16 if half else np.float32)
        for isa in RUNNABLE:
            got = q41.gemm(x, packed, d, m, n, bits=8, isa=isa)
            assert np.array_equal(got.astype(np.float64), exact), (isa, half)
        y = session(q41_model(packed, d, m, k, n, bits=8)).run(None, {"A": x})[0]
        assert np.array_equal(y.astype(np.float64), exact), half


def every_half() -> np.ndarray:
    """Every float16 that is not a NaN (the subnormals, +-0 and +-inf included), as float32."""
    h = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    return h[~np.isnan(h)].astype(np.float32)


@pytest.mark.parametrize("centred", [True, False])
def test_every_float16_converts_exactly_on_every_path(libs, centred):
    """d (centred) or m (minimum form) set to every non-NaN float16, one column each, against the
    reference fed their float32 values: y = fl(127 * d), or fmaf(m, 127, 0) = fl(127 * m), so
    every half's conversion shows (subnormals, infinities, signed zeros); a NaN half gives NaN."""
    vals = every_half()
    n, k = vals.size + 1, 32
    q = np.full((n, 1, 32), 9, np.uint8)  # centred 4-bit: q - 8 = 1
    x = np.zeros((1, k), np.float32)
    x[0, 0] = 127  # sc = 1, qa = [127, 0, ...]: dotc = 127
    col = np.append(vals, np.float32(0))[:, None]
    if centred:
        scale, offset = col, None
    else:
        scale, offset = np.zeros((n, 1), np.float32), col
    want = q41.reference(x, q, scale, offset)
    packed, d, m = q41.pack(q, scale, offset, scale_dtype=np.float16)
    nan_bits = np.uint16(0x7E01)  # a NaN float16 in the last (padding-free) column
    (d if centred else m)[(n - 1) // 16 * 16 + (n - 1) % 16] = nan_bits.view(np.float16)
    for isa in RUNNABLE:
        got = q41.gemm(x, packed, d, m, n, isa=isa)
        assert np.array_equal(bits_of(got[:, :-1]), bits_of(want[:, :-1])), isa
        assert np.isnan(got[0, -1]), isa


@pytest.mark.parametrize("omit", ["empty", "absent"])
def test_the_centred_form_omits_m_either_way(libs, omit):
    rng = np.random.default_rng(19)
    q, scale, _ = form_weights(rng, 8, True, True)
    packed, d, m = q41.pack(q, scale, bits=8, scale_dtype=np.float16)
    x = awkward(rng, 5)
    y = session(q41_model(packed, d, m, bits=8, omit=omit)).run(None, {"A": x})[0]
    assert np.array_equal(bits_of(y), bits_of(q41.reference(x, q, scale, bits=8)))


def test_bits_4_said_is_the_default(libs):
    rng = np.random.default_rng(20)
    q, scale, offset = weights(rng)
    arrays = q41.pack(q, scale, offset)
    x = awkward(rng, 4)
    y0 = session(q41_model(*arrays)).run(None, {"A": x})[0]
    y4 = session(q41_model(*arrays, bits=4)).run(None, {"A": x})[0]
    assert np.array_equal(bits_of(y0), bits_of(y4))


def test_operator_refuses_bad_forms(libs):
    rng = np.random.default_rng(21)
    q, scale, offset = form_weights(rng, 8, False, True)
    p16, d16, m16 = q41.pack(q, scale, offset, bits=8, scale_dtype=np.float16)
    _, d32, m32 = q41.pack(q, scale, offset, bits=8)
    x = np.zeros((1, K), np.float32)

    def run(model: bytes) -> None:
        session(model).run(None, {"A": x})

    with pytest.raises(Exception, match="d and m must have the same element type.*d float16 and m float"):
        run(q41_model(p16, d16, m32, bits=8))
    with pytest.raises(Exception, match="d and m must have the same element type.*d float and m float16"):
        run(q41_model(p16, d32, m16, bits=8))
    with pytest.raises(Exception, match="d must be float or float16, got double"):
        run(q41_model(p16, d32.astype(np.float64), None, bits=8))
    for bad in (3, 16, 0):
        with pytest.raises(Exception, match=f"attribute bits must be 4, 5 or 8, got {bad}"):
            run(q41_model(p16, d16, m16, bits=bad))
    with pytest.raises(Exception, match="attribute bits must be an int"):
        run(q41_model(p16, d16, m16, bits=8.0))
    p4, d4, m4 = q41.pack(q & 15, scale, offset)  # 4-bit data, read as 8-bit
    with pytest.raises(Exception, match=r"packed must hold tiles\*nb\*512 = 4608 bytes \(bits = 8\)"):
        run(q41_model(p4, d4, m4, bits=8))
    with pytest.raises(Exception, match=r"packed must hold tiles\*nb\*256 = 2304 bytes \(bits = 4\)"):
        run(q41_model(p16, d16, m16))
    with pytest.raises(Exception, match=r"packed must hold tiles\*nb\*320 = 2880 bytes \(bits = 5\)"):
        run(q41_model(p4, d4, m4, bits=5))  # 4-bit data, read as 5-bit
    with pytest.raises(Exception, match=r"d must hold tiles\*nb\*16 = 144 values"):
        run(q41_model(p16, d16[:-16], None, bits=8))


def test_gemm_refuses_bad_forms(libs):
    rng = np.random.default_rng(22)
    q, scale, offset = form_weights(rng, 8, False, True)
    packed, d, m = q41.pack(q, scale, offset, bits=8, scale_dtype=np.float16)
    x = np.zeros((1, K), np.float32)
    with pytest.raises(ValueError, match="same type"):
        q41.gemm(x, packed, d, m.astype(np.float32), N, bits=8)
    with pytest.raises(ValueError, match="do not match"):
        q41.gemm(x, packed, d, m, N)  # 8-bit data as 4-bit
    with pytest.raises(ValueError, match="bits must be 4, 5 or 8"):
        q41.gemm(x, packed, d, m, N, bits=2)


# ---------------------------------------------------------------------------------------- cache
def test_second_call_reuses_the_library(libs, kernel_cache):
    lib = libs[None]
    assert lib.is_relative_to(kernel_cache / q41.KERNELS_DIR) and lib.name == q41.LIBRARY
    before = lib.stat().st_mtime_ns
    assert q41.library() == lib and lib.stat().st_mtime_ns == before
    assert len({libs[isa] for isa in RUNNABLE}) == len(RUNNABLE)  # one folder per path


def test_concurrent_builders_make_one_library(tmp_path):
    """Two processes building the same library into an empty cache: one compiles under the lock,
    the other waits and loads it; no temporary file is left behind."""
    code = "from dejavuu_build.kernels import q41; p = q41.library('scalar'); print(p, q41.isa_of(p))"
    env = {**os.environ, "DEJAVUU_CACHE": str(tmp_path)}
    procs = [
        subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True) for _ in range(2)
    ]
    outs = [p.communicate(timeout=300)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert outs[0] == outs[1] and outs[0][1] == "scalar"
    folder = Path(outs[0][0]).parent
    assert sorted(f.name for f in folder.iterdir()) == sorted([q41.LIBRARY, "build.lock"])


def test_no_compiler_says_what_to_do(monkeypatch, tmp_path):
    monkeypatch.setenv("DEJAVUU_CACHE", str(tmp_path))
    monkeypatch.setenv("PATH", "")
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.raises(KernelUnavailable, match="CXX=.*set CXX to a C\\+\\+17 compiler"):
        q41.library()
    monkeypatch.delenv("CXX")
    with pytest.raises(KernelUnavailable, match="install g\\+\\+"):
        q41.library()
    assert not (tmp_path / q41.KERNELS_DIR).exists()


def test_a_compile_error_says_what_failed(monkeypatch, tmp_path):
    bad = tmp_path / "q41.cpp"
    bad.write_text("this is not C++;\n")
    monkeypatch.setenv("DEJAVUU_CACHE", str(tmp_path))
    monkeypatch.setattr(q41, "SOURCES", (bad, *q41.SOURCES[1:]))
    with pytest.raises(KernelUnavailable, match="compiler failed.*error"):
        q41.library("scalar")
    assert not list((tmp_path / q41.KERNELS_DIR).glob(f"*/{q41.LIBRARY}*"))  # no library, no temp file


def test_the_package_lists_the_operator(libs, monkeypatch, tmp_path):
    """kernels.OPERATORS registers by domain (what the runtime does for a graph's imports), and
    kernels.unavailable says why one cannot run here, e.g. with no compiler."""
    from dejavuu_build import kernels

    so = ort.SessionOptions()
    assert kernels.OPERATORS[q41.DOMAIN](so) == BEST
    assert kernels.unavailable([q41.DOMAIN]) is None and kernels.unavailable([]) is None
    assert "no such operator" in (kernels.unavailable(["dejavuu.nope"]) or "")
    monkeypatch.setenv("DEJAVUU_CACHE", str(tmp_path))
    monkeypatch.setenv("PATH", "")
    monkeypatch.delenv("CXX", raising=False)
    q41.unavailable.cache_clear()
    try:
        assert "install g++" in (kernels.unavailable([q41.DOMAIN]) or "")
        assert not q41.available()
    finally:
        q41.unavailable.cache_clear()
