"""Q41MatMul: an exact matmul of block-quantized weights (4-, 5- or 8-bit levels in blocks of 32
along K) by int8-rounded activations, as an onnxruntime custom operator (q41.cpp), compiled on first use
on this machine (pip install stays pure Python) for the best ISA path it has.

The quantizer writes the weights with :func:`pack`; the runtime calls :func:`register` on its
``SessionOptions``; :func:`reference` is the operator's arithmetic in numpy, bit for bit, and
:func:`gemm` runs the compiled kernel without onnxruntime (tests, timing).

Operator (domain ``dejavuu.q41``, opset 1): inputs ``A`` float32 [..., K], ``packed`` uint8
[tiles*nb*64*bits], ``d`` float32 or float16 [tiles*nb*16] and optionally ``m`` (d's type, same
size); attributes ``K`` (a multiple of 32), ``N`` and ``bits`` (4, 5 or 8; absent: 4); output float32
[..., N]; ``tiles = ceil(N/16)``, ``nb = K/32``. Weight column n of block b (32 consecutive k), with
levels q in 0..2^bits-1, is

- with ``m`` (the minimum form): ``d[b,n] * q + m[b,n]`` (GGUF Q4_1; Q4_K and Q4_0 have that form
  per 32 too);
- without it (an empty input name, or no 4th input: the centred form): ``d[b,n] * (q - 2^(bits-1))``
  (GGUF Q4_0 or Q5_0 as q and d; Q8_0 as its int8 level + 128 and d), corrected by an exact
  integer instead of a float term, and no m to stream.

5-bit levels (GGUF Q5_0 / Q5_1 / Q5_K) are packed as 4-bit nibbles plus a plane of fifth bits,
0.625 bytes a weight instead of 8 bits' 1, and on AVX2 they are multiplied whole (levels to 31 keep
4 groups of int16 pair sums exact) instead of as two nibbles: fewer bytes and fewer products.

float16 d and m (what the GGUF stores) convert to float32 exactly, so they give the same bits as the
same values in float32, with fewer bytes streamed per step. Activations are rounded to int8 per row
and block of 32; every ISA path does the same float operations in the same order, and each row's
arithmetic is its own, so a row gives the same bits alone as among others (what keeps speculative
verification lossless). The exact contract (layouts, the operations and their order) heads q41.cpp.

onnxruntime: the operator uses only its C API, functions of API version 17 or lower, and stamps
itself with the highest version both its vendored headers (25) and the running library have; so it
needs onnxruntime >= 1.17 (below that, registering fails with a message saying so). The optional
``m`` (OrtCustomOp input characteristics, API 8) and float16 or float32 ``d``/``m`` (an input
type left undefined: since onnxruntime 1.17 each such input has its own all-types constraint) need
nothing newer.

Security: the library is only ever built from this package's own source (q41.cpp, include/) into
the cache's ``.kernels`` folder, under a key over that source, the compiler and the flags; nothing
is ever loaded from a model entry or any other path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, overload

import numpy as np
import numpy.typing as npt

from ..cache import cache_root
from ..errors import KernelUnavailable
from ..log import logger
from ..schema import KERNELS_DIR

DOMAIN = "dejavuu.q41"
OP = "Q41MatMul"
SWIGLU_OP = "SwiGLU"  # the MLP's silu(gate) * up in the same domain (attn.cpp: elementwise, one node)
GEGLU_OP = "GeGLU"  # gelu_tanh(gate) * up (Gemma's MLP), likewise
OPSET = 1
BLOCK = 32  # k per block: one scale and one minimum per column and block
TILE = 16  # columns per tile: N is padded up to a multiple
TILE_BYTES = TILE * BLOCK // 2  # packed bytes per tile and block at 4 bits (256; 320 at 5, 512 at 8)
PLANE = TILE_BYTES  # bits 5: where a tile's block keeps its 64 bytes of fifth bits, after the nibbles
BITS = (4, 5, 8)  # the levels' widths the operator takes
SCALE_DTYPES = (np.dtype(np.float32), np.dtype(np.float16))  # d's and m's element types
ISAS = ("avx512vnni", "avx2", "scalar")  # the compiled paths, best first (isa_of names one)
BUILD_ISAS = ("avx2", "scalar")  # what library(isa=...) can force instead of -march=native

LIBRARY = "libdejavuu_q41.so"

_HERE = Path(__file__).resolve().parent
SOURCE = _HERE / "q41.cpp"
# compiled into one library with q41.cpp, which registers both domains: the attention operator
# (attn.cpp, kernels.attn) runs in the graphs that run Q41MatMul
SOURCES = (SOURCE, _HERE / "attn.cpp")
INCLUDE = _HERE / "include"
# -ffp-contract=off: no fused multiply-add the source does not write (the float order is the
# contract); never -ffast-math
BASE_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-ffp-contract=off", "-fvisibility=hidden")

F32 = npt.NDArray[np.float32]
U8 = npt.NDArray[np.uint8]
Scales = npt.NDArray[Any]  # float32 or float16 (pack's scale_dtype)


# ------------------------------------------------------------------------------------- weights
def tile_bytes(bits: int) -> int:
    """Packed bytes per tile of 16 columns and block of 32: 256 at 4 bits, 320 at 5, 512 at 8."""
    return TILE * BLOCK * _check_bits(bits) // 8


def _check_bits(bits: int) -> int:
    if isinstance(bits, bool) or bits not in BITS:
        raise ValueError(f"bits must be 4, 5 or 8, got {bits!r}")
    return int(bits)


def fits_float16(a: npt.ArrayLike) -> bool:
    """Whether every value of ``a`` (as float32) is exactly a float16: converting it there and
    back gives the same bits (so -0.0 fits, a NaN only with a payload float16 keeps, values past
    65504 or under float16's subnormals do not)."""
    a32 = np.ascontiguousarray(a, np.float32)
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        back = a32.astype(np.float16).astype(np.float32)
    return bool(np.array_equal(a32.view(np.uint32), back.view(np.uint32)))


@overload
def pack(
    q: npt.ArrayLike, scale: npt.ArrayLike, offset: None = None, *, bits: int = 4, scale_dtype: Any = np.float32
) -> tuple[U8, Scales, None]: ...
@overload
def pack(
    q: npt.ArrayLike, scale: npt.ArrayLike, offset: npt.ArrayLike, *, bits: int = 4, scale_dtype: Any = np.float32
) -> tuple[U8, Scales, Scales]: ...
def pack(
    q: npt.ArrayLike,
    scale: npt.ArrayLike,
    offset: npt.ArrayLike | None = None,
    *,
    bits: int = 4,
    scale_dtype: Any = np.float32,
) -> tuple[U8, Scales, Scales | None]:
    """The operator's ``packed``, ``d`` and ``m`` from levels ``q`` [N, nb, 32] (integers
    0..2^bits-1), ``scale`` and ``offset`` [N, nb] (floats, taken as float32): w = scale * q +
    offset per column and block, or, with ``offset`` None (the centred form, ``m`` returned None),
    w = scale * (q - 2^(bits-1)).

    ``bits`` 4 packs two levels a byte (256 bytes per tile and block), 5 their low 4 bits so plus a
    plane of fifth bits (320: byte 256 + 4*lane + e holds in bit j the fifth bit of k = 4j+e), 8
    one level a byte (512); ``scale_dtype``
    np.float16 writes d and m as float16, refused (ValueError) unless every float32 value is one
    exactly (:func:`fits_float16`: the caller decides). Columns are padded up to a multiple of 16
    with zero levels, scale 0 and offset 0. ``pack(q, scale, offset)`` is the original form."""
    bits = _check_bits(bits)
    sdt = np.dtype(scale_dtype)
    if sdt not in SCALE_DTYPES:
        raise ValueError(f"scale_dtype must be float32 or float16, got {sdt}")
    q = np.asarray(q)
    if q.ndim != 3 or q.shape[2] != BLOCK or q.shape[0] == 0 or q.shape[1] == 0:
        raise ValueError(f"q must be [N, nb, {BLOCK}] with N, nb > 0, got shape {q.shape}")
    if not np.issubdtype(q.dtype, np.integer):
        raise ValueError(f"q must hold integer levels, got {q.dtype}")
    top = (1 << bits) - 1
    if q.min() < 0 or q.max() > top:
        raise ValueError(f"q's levels must be 0..{top} (bits={bits}), got {q.min()}..{q.max()}")
    n, nb, _ = q.shape
    sc, off = _block_params(scale, offset, n, nb)
    if sdt == np.float16:
        for name, a in (("scale", sc), ("offset", off)):
            if a is not None and not fits_float16(a):
                raise ValueError(f"{name} holds values that are not exactly float16: pack them as float32")
    tiles = -(-n // TILE)
    qp = np.zeros((tiles * TILE, nb, BLOCK), np.uint8)
    qp[:n] = q
    # [tiles, nb, 8 groups of 4 k, 16 columns, 4]: group g holds k = 4g..4g+3, 16 columns x 4 each
    qt = qp.reshape(tiles, TILE, nb, 8, 4).transpose(0, 2, 3, 1, 4)
    if bits in (4, 5):  # group g's bytes: k = 4g+e (low nibble) and k = 16+4g+e (high nibble), g < 4
        lo = qt & 0x0F
        packed = (lo[:, :, :4] | (lo[:, :, 4:] << 4)).astype(np.uint8).reshape(tiles, nb, -1)
        if bits == 5:  # [tiles, nb, 16 columns, 4]: bit j <- the fifth bit of group j's level
            fifth = (qt >> 4).astype(np.uint8) << np.arange(8, dtype=np.uint8)[:, None, None]
            plane = np.bitwise_or.reduce(fifth, axis=2).reshape(tiles, nb, -1)
            packed = np.concatenate([packed, plane], axis=-1)
        packed = packed.reshape(-1)
    else:  # one byte per level, 8 groups of 64 bytes
        packed = qt.reshape(-1)

    def per_tile(a: F32) -> Scales:
        ap = np.zeros((tiles * TILE, nb), np.float32)
        ap[:n] = a
        return np.ascontiguousarray(ap.reshape(tiles, TILE, nb).transpose(0, 2, 1).reshape(-1).astype(sdt))

    return np.ascontiguousarray(packed), per_tile(sc), None if off is None else per_tile(off)


def unpack(
    packed: npt.ArrayLike, d: npt.ArrayLike, m: npt.ArrayLike | None, n: int, k: int, *, bits: int = 4
) -> tuple[U8, F32, F32 | None]:
    """The inverse of :func:`pack`: levels [n, k/32, 32], scale and offset [n, k/32] as float32
    (float16 d and m convert exactly); offset None where m is (the centred form)."""
    bits = _check_bits(bits)
    nb, tiles = k // BLOCK, -(-n // TILE)
    if bits in (4, 5):
        tb = np.asarray(packed, np.uint8).reshape(tiles, nb, tile_bytes(bits))
        p = tb[:, :, :PLANE].reshape(tiles, nb, 4, TILE, 4)
        qt = np.concatenate([p & 0x0F, p >> 4], axis=2)  # [tiles, nb, 8, 16, 4]
        if bits == 5:
            plane = tb[:, :, PLANE:].reshape(tiles, nb, 1, TILE, 4)
            qt = qt | (((plane >> np.arange(8, dtype=np.uint8)[:, None, None]) & 1) << 4)
    else:
        qt = np.asarray(packed, np.uint8).reshape(tiles, nb, 8, TILE, 4)
    q = qt.transpose(0, 3, 1, 2, 4).reshape(tiles * TILE, nb, BLOCK)[:n]

    def per_column(a: npt.ArrayLike) -> F32:
        arr = np.asarray(a).astype(np.float32)
        return np.ascontiguousarray(arr.reshape(tiles, nb, TILE).transpose(0, 2, 1).reshape(-1, nb)[:n])

    return np.ascontiguousarray(q), per_column(d), None if m is None else per_column(m)


def _block_params(scale: npt.ArrayLike, offset: npt.ArrayLike | None, n: int, nb: int) -> tuple[F32, F32 | None]:
    out: list[F32 | None] = []
    for name, a in (("scale", scale), ("offset", offset)):
        if a is None and name == "offset":
            out.append(None)
            continue
        arr = np.asarray(a)
        if arr.shape != (n, nb) or not np.issubdtype(arr.dtype, np.floating):
            raise ValueError(f"{name} must be floats of shape {(n, nb)}, got {arr.dtype} {arr.shape}")
        out.append(arr.astype(np.float32))
    assert out[0] is not None
    return out[0], out[1]


# ----------------------------------------------------------------------------------- reference
def reference(
    x: npt.ArrayLike, q: npt.ArrayLike, scale: npt.ArrayLike, offset: npt.ArrayLike | None = None, *, bits: int = 4
) -> F32:
    """The operator's output for activations ``x`` [..., K] and the weights as :func:`pack` takes
    them (``offset`` None: the centred form; float16 scales given as their float32 values, which
    is exact), computed in numpy with the kernel's float32 operations in the kernel's order: the
    same bits for finite inputs (fmaf emulated exactly, see :func:`fmaf`)."""
    bits = _check_bits(bits)
    q = np.asarray(q)
    n, nb, _ = q.shape
    sc_w, off = _block_params(scale, offset, n, nb)
    x = np.asarray(x, np.float32)
    k = nb * BLOCK
    if x.ndim == 0 or x.shape[-1] != k:
        raise ValueError(f"x's last dimension must be K = {k}, got shape {x.shape}")
    lead = x.shape[:-1]
    xb = x.reshape(-1, nb, BLOCK)
    rows = xb.shape[0]
    amax = np.abs(xb).max(axis=-1) if rows else np.zeros((0, nb), np.float32)
    sc = (amax / np.float32(127)).astype(np.float32)
    inv = np.zeros_like(sc)
    np.divide(np.float32(1), sc, out=inv, where=sc != 0)
    with np.errstate(invalid="ignore"):
        qa = np.rint(xb * inv[..., None]).astype(np.int64)  # ties to even, as cvtps under the default MXCSR
    isum = qa.sum(axis=-1)  # [rows, nb], exact integers
    ssum = (sc * isum.astype(np.float32)).astype(np.float32)
    qi = q.astype(np.int64)
    half = 1 << (bits - 1)
    acc = np.zeros((rows, n), np.float32)
    for b in range(nb):
        dot = qa[:, b, :] @ qi[:, b, :].T  # [rows, n], exact integers (|dot| <= 32*255*127)
        ds = (sc_w[None, :, b] * sc[:, b, None]).astype(np.float32)
        if off is None:  # centred: the exact integer dot - 2^(bits-1) * sum(qa)
            t1 = ((dot - half * isum[:, b, None]).astype(np.float32) * ds).astype(np.float32)
            acc = (acc + t1).astype(np.float32)
        else:
            t1 = (dot.astype(np.float32) * ds).astype(np.float32)
            acc = (acc + fmaf(off[None, :, b], ssum[:, b, None], t1)).astype(np.float32)
    return acc.reshape(*lead, n)


def fmaf(a: npt.ArrayLike, b: npt.ArrayLike, c: npt.ArrayLike) -> F32:
    """C's fmaf on float32 arrays: a*b + c rounded once. a*b is exact in float64 (24+24 bits); the
    sum is kept exact as a float64 pair (TwoSum), and the one case where rounding its high part to
    float32 differs from rounding the exact sum (the high part on a float32 midpoint, the low part
    not zero) is settled towards the low part's sign."""
    a64 = np.asarray(a, np.float32).astype(np.float64)
    b64 = np.asarray(b, np.float32).astype(np.float64)
    c64 = np.asarray(c, np.float32).astype(np.float64)
    p = a64 * b64
    s = p + c64
    with np.errstate(invalid="ignore"):  # non-finite operands: no error term (and no warning)
        bb = s - p
        err = (p - (s - bb)) + (c64 - bb)
    f = s.astype(np.float32)
    f64 = f.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        other = np.nextafter(f, np.where(s > f64, np.float32(np.inf), np.float32(-np.inf))).astype(np.float32)
        o64 = other.astype(np.float64)
        tie = (s != f64) & ((s - f64) == (o64 - s))
        fix = tie & (err != 0) & ((o64 > f64) == (err > 0))
    return np.where(fix, other, f).astype(np.float32)


# ------------------------------------------------------------------------------ the compiled kernel
def _isa_flags(isa: str | None) -> tuple[str, ...]:
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    if isa is None:
        return ("-march=native",)
    if isa not in BUILD_ISAS:
        raise ValueError(f"isa must be None (this CPU's best) or one of {BUILD_ISAS}, got {isa!r}")
    if isa == "avx2":
        if not x86:
            raise KernelUnavailable("the avx2 path of the Q4_1 operator exists on x86-64 only")
        return ("-march=x86-64", "-mavx2", "-mfma", "-mf16c")
    return ("-march=x86-64",) if x86 else ()


def _compiler() -> tuple[str, ...]:
    """$CXX (a command, possibly with arguments: "ccache g++"), else g++, else c++."""
    if cxx := os.environ.get("CXX", "").strip():
        words = shlex.split(cxx)
        found = shutil.which(words[0])
        if found is None:
            raise KernelUnavailable(
                f"CXX={cxx!r} is not a program on PATH: the Q4_1 operator cannot be compiled; "
                "set CXX to a C++17 compiler (or unset it to use g++)"
            )
        return (found, *words[1:])
    for name in ("g++", "c++"):
        if found := shutil.which(name):
            return (found,)
    raise KernelUnavailable(
        "no C++ compiler (g++ or c++) on PATH: the Q4_1 operator cannot be compiled; "
        "install g++ (apt-get install g++) or set CXX to a C++17 compiler"
    )


@functools.lru_cache(maxsize=None)
def _key(
    cxx: tuple[str, ...], flags: tuple[str, ...], isa: str | None, sources: tuple[Path, ...], include: Path
) -> str:
    """What the library depends on: the source and headers, the compiler (its --version) and what
    the flags make of this CPU (the predefined macros: -march=native on another CPU, or another
    compiler release, is another key, so a shared cache never loads a foreign build)."""
    h = hashlib.sha256()

    def part(tag: str, data: bytes) -> None:
        h.update(tag.encode() + b"\0" + len(data).to_bytes(8, "little") + data)

    for source in sources:
        part(f"source {source.name}", source.read_bytes())
    for f in sorted(include.glob("*.h")):
        part(f"header {f.name}", f.read_bytes())
    part("version", _run([*cxx, "--version"]).encode())
    macros = _run([*cxx, *[f for f in flags if f not in ("-shared", "-fPIC")], "-dM", "-E", "-x", "c++", os.devnull])
    part("macros", "\n".join(sorted(macros.splitlines())).encode())
    part("flags", " ".join(flags).encode())
    part("isa", (isa or "native").encode())
    return h.hexdigest()[:20]


def _run(cmd: list[str]) -> str:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise KernelUnavailable(
            f"could not run the C++ compiler ({e}); install g++ or set CXX to a C++17 compiler"
        ) from e
    if proc.returncode != 0:
        raise KernelUnavailable(
            f"the C++ compiler failed ({shlex.join(cmd[:3])} ...: {_first_error(proc.stderr)}); "
            "install g++ or set CXX to a C++17 compiler"
        )
    return proc.stdout


def _first_error(stderr: str) -> str:
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln.lower()]
    return (errors or lines or ["no message"])[0][:300]


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive flock on ``path`` (two processes building the same library wait for each
    other); where fcntl is missing (Windows) the atomic rename alone guards the result."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(path, "a+b") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def library(isa: str | None = None) -> Path:
    """The compiled operator, built on first use into ``<cache root>/.kernels/q41-<key>/``.

    ``isa=None`` compiles for this CPU (-march=native: the best path it has); ``"avx2"`` and
    ``"scalar"`` force those paths (tests compare every path the CPU can run). Raises
    :class:`KernelUnavailable` when no compiler is found or compiling fails."""
    flags = (*BASE_FLAGS, *_isa_flags(isa))
    cxx = _compiler()
    folder = cache_root() / KERNELS_DIR / f"q41-{_key(cxx, flags, isa, SOURCES, INCLUDE)}"
    lib = folder / LIBRARY
    if lib.is_file():
        return lib
    folder.mkdir(parents=True, exist_ok=True)
    with _locked(folder / "build.lock"):
        if lib.is_file():  # another process built it while this one waited
            return lib
        for stale in folder.glob(f".{LIBRARY}.*.tmp"):  # what a killed build left (we hold the lock)
            stale.unlink(missing_ok=True)
        tmp = folder / f".{LIBRARY}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
        t0 = time.perf_counter()
        try:
            _run([*cxx, *flags, "-I", str(INCLUDE), "-o", str(tmp), *map(str, SOURCES)])
            os.replace(tmp, lib)
        finally:
            tmp.unlink(missing_ok=True)
        seconds = time.perf_counter() - t0
    logger.info("compiled the Q4_1 operator (%s path) in %.1fs: %s", isa_of(lib), seconds, lib)
    return lib


_loaded: dict[Path, ctypes.CDLL] = {}


def _load(path: Path) -> ctypes.CDLL:
    if path not in _loaded:
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as e:
            raise KernelUnavailable(f"could not load the Q4_1 operator {path}: {e}") from e
        lib.dejavuu_q41_isa.restype = ctypes.c_char_p
        lib.dejavuu_q41_isa.argtypes = []
        p = ctypes.c_void_p
        lib.dejavuu_q41_gemm.restype = None
        lib.dejavuu_q41_gemm.argtypes = [p, ctypes.c_int64, p, p, p, ctypes.c_int64, ctypes.c_int64, p]
        i64 = ctypes.c_int64
        lib.dejavuu_q41_gemm2.restype = ctypes.c_int
        lib.dejavuu_q41_gemm2.argtypes = [p, i64, p, p, p, i64, i64, i64, ctypes.c_int32, p]
        # the attention operator is compiled into the same library (SOURCES): kernels.attn.attend
        lib.dejavuu_attention.restype = ctypes.c_int
        lib.dejavuu_attention.argtypes = [
            p,
            i64,
            i64,
            p,
            p,
            p,
            p,
            i64,
            p,
            p,
            p,
            p,
            i64,
            i64,
            i64,
            i64,
            ctypes.c_float,
            i64,
            p,
            p,
            ctypes.c_float,
            p,
        ]
        _loaded[path] = lib
    return _loaded[path]


def isa_of(path: Path) -> str:
    """Which path a compiled library runs: "avx512vnni", "avx2" or "scalar"."""
    return str(_load(path).dejavuu_q41_isa().decode())


def gemm(
    x: npt.ArrayLike,
    packed: U8,
    d: npt.ArrayLike,
    m: npt.ArrayLike | None,
    n: int,
    *,
    bits: int = 4,
    isa: str | None = None,
) -> F32:
    """The compiled kernel on ``x`` [..., K] without onnxruntime, on this thread (tests, timing):
    every form, as the operator would run it (``m`` None: the centred form; ``d`` float16, and
    ``m`` with it: float16 scales; other float types are taken as float32)."""
    bits = _check_bits(bits)
    xa = np.ascontiguousarray(x, np.float32)
    if xa.ndim == 0 or xa.shape[-1] % BLOCK or xa.shape[-1] == 0 or n <= 0:
        raise ValueError(f"x must be [..., K] with K a positive multiple of {BLOCK}, and n > 0")
    k = xa.shape[-1]
    nb, tiles = k // BLOCK, -(-n // TILE)
    pk = np.ascontiguousarray(packed, np.uint8)
    d_arr = np.asarray(d)
    half = d_arr.dtype == np.float16
    sdt = np.float16 if half else np.float32
    if m is not None and (np.asarray(m).dtype == np.float16) != half:
        mt = np.asarray(m).dtype
        raise ValueError(f"d and m must be of the same type (float32 or float16), got {d_arr.dtype} and {mt}")
    da = np.ascontiguousarray(d_arr, sdt)
    ma = None if m is None else np.ascontiguousarray(m, sdt)
    sizes_ok = pk.size == tiles * nb * tile_bytes(bits) and da.size == tiles * nb * TILE
    if not sizes_ok or (ma is not None and ma.size != da.size):
        raise ValueError(f"packed/d/m do not match K={k}, N={n}, bits={bits} (see pack)")
    y = np.empty((*xa.shape[:-1], n), np.float32)
    rc = _load(library(isa)).dejavuu_q41_gemm2(
        xa.ctypes.data,
        xa.size // k,
        pk.ctypes.data,
        da.ctypes.data,
        None if ma is None else ma.ctypes.data,
        k,
        n,
        bits,
        int(half),
        y.ctypes.data,
    )
    if rc != 0:
        raise ValueError(f"the kernel refused K={k}, bits={bits}")
    return y


def register(session_options: Any, isa: str | None = None) -> str:
    """Register the operator with an ``onnxruntime.SessionOptions`` (building it first if needed);
    returns the ISA path it runs. Raises :class:`KernelUnavailable` if it cannot be built or
    onnxruntime refuses it."""
    path = library(isa)
    try:
        session_options.register_custom_ops_library(str(path))
    except Exception as e:  # onnxruntime's own error types, re-raised as ours
        raise KernelUnavailable(f"onnxruntime refused the Q4_1 operator {path}: {e}") from e
    return isa_of(path)


@functools.cache
def unavailable() -> str | None:
    """Why the operator cannot run here (building, loading or registering it failed: the one-line
    message), or None where it can. Checked once per process; never raises."""
    try:
        import onnxruntime as ort

        register(ort.SessionOptions())
    except Exception as e:  # noqa: BLE001 - any failure means "not here", and says why
        logger.debug("the Q4_1 operator is not available: %s", e)
        return str(e) or type(e).__name__
    return None


def available() -> bool:
    """Whether the operator builds, loads and registers here (once per process; never raises)."""
    return unavailable() is None
