"""Q41MatMul (dejavuu_build/kernels/q41.py, q41.cpp): the weight layout, the operator through
onnxruntime against the numpy reference bit for bit, rows alone and together, every ISA path this
CPU can run giving the same bits, and the build cache (reuse, concurrent builders, no compiler).

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

K, N = 96, 40  # 3 blocks; N not a multiple of 16 (3 tiles, the last one 8 columns wide)


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


FLAGS = cpu_flags()
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


def q41_model(packed, d, m, k: int = K, n: int = N) -> bytes:
    node = helper.make_node(q41.OP, ["A", "packed", "d", "m"], ["Y"], domain=q41.DOMAIN, K=k, N=n)
    graph = helper.make_graph(
        [node],
        "q41",
        [helper.make_tensor_value_info("A", TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)],
        initializer=[numpy_helper.from_array(a, name) for a, name in ((packed, "packed"), (d, "d"), (m, "m"))],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(q41.DOMAIN, q41.OPSET)]
    return helper.make_model(graph, opset_imports=opsets).SerializeToString()


def session(model: bytes, isa: str | None = None) -> ort.InferenceSession:
    so = ort.SessionOptions()
    q41.register(so, isa)
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


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
    monkeypatch.setattr(q41, "SOURCE", bad)
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
