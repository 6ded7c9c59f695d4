"""``dejavuu.attn.GroupAttention``: a decoder layer's attention over the in-place KV buffer, row
by row in one fixed order of float operations (attn.cpp heads the contract), so a query row gives
the same bits alone as among any number of rows: the static graph needs no two-row floor under it.

Why our own operator: onnxruntime's GroupQueryAttention gives a lone row other bits than the
same row among several, so the static graph ran it on two rows at least, and it was the second
cost of a step on a 2-core AMD EPYC (AVX2): 28% of a one-token step's kernel time at a past of
256, 58% at 1024 (docs/speed.md, twenty-fourth session). It is compiled into the Q4_1 operator's
library (q41.SOURCES: one build, one load registers both domains), so it is available exactly where
Q41MatMul is and a graph of ours uses it only beside that operator (export.passes.own_operators)."""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import numpy.typing as npt

from . import q41

DOMAIN = "dejavuu.attn"
OP = "GroupAttention"
OPSET = 1
HEAD_SIZES = (64, 128, 256)  # what the kernel is instantiated for
UNSEEN = -1e30  # a bias at or below it: a key the row does not see (its weight is an exact zero)
# the operator's inputs by position (attn.cpp's contract): export.passes.own_operators writes them in
# this order, export.passes.serve_batch rewires a batch's (the last two only in the batched graph)
(
    IN_QKV,
    IN_PAST_KEY,
    IN_PAST_VALUE,
    IN_COS,
    IN_SIN,
    IN_POSITIONS,
    IN_BIAS,
    IN_SLOT_ROWS,
    IN_ROW_SLOTS,
    IN_SEQLENS_K,
    IN_QUERY_SEQLENS,
    IN_Q_NORM,
    IN_K_NORM,
) = range(13)
NORM_EPSILON = "norm_epsilon"  # the attribute of q_norm / k_norm's epsilon (absent: 1e-6)

F32 = npt.NDArray[np.float32]


def _fn(isa: str | None) -> Any:
    return q41._load(q41.library(isa)).dejavuu_attention  # its argtypes are declared where it loads


def attend(
    qkv: npt.ArrayLike,
    kbuf: F32,
    vbuf: F32,
    cos: npt.ArrayLike,
    sin: npt.ArrayLike,
    positions: npt.ArrayLike,
    bias: npt.ArrayLike,
    *,
    heads: int,
    kv_heads: int,
    scale: float,
    slot_rows: npt.ArrayLike | None = None,
    row_slots: npt.ArrayLike | None = None,
    window: int = 0,
    q_norm: npt.ArrayLike | None = None,
    k_norm: npt.ArrayLike | None = None,
    norm_eps: float = 1e-6,
    isa: str | None = None,
) -> F32:
    """The compiled operator without onnxruntime (one thread), as the graph runs it: ``qkv``
    [R, (heads + 2*kv_heads)*D], ``kbuf``/``vbuf`` [kv_heads, capacity, D] float32 C-contiguous,
    written in place at rows past..past+S-1 (past = bias's width - S), ``cos``/``sin`` [positions,
    D/2], ``positions`` [S], ``bias`` [S, past + S]. ``slot_rows`` [S] (the row each slot reads)
    and ``row_slots`` [R] (each row's slot) decouple rows from slots (a tree's aligned layout);
    None: S = R, slot i is row i. ``window`` > 0: a sliding window's layer (a row at position q
    sees no key at position k with q - k >= window; past keys sit at their index). ``q_norm`` and
    ``k_norm`` [D] (together): each q and k head RMS-normed with that scale and ``norm_eps`` before
    its rotary (Gemma 3's). Returns the output [R, heads*D]."""
    x = np.ascontiguousarray(qkv, np.float32)
    c, s = np.ascontiguousarray(cos, np.float32), np.ascontiguousarray(sin, np.float32)
    pos = np.ascontiguousarray(positions, np.int64)
    b = np.ascontiguousarray(bias, np.float32)
    for buf in (kbuf, vbuf):
        if buf.dtype != np.float32 or not buf.flags.c_contiguous or buf.ndim != 3:
            raise ValueError("kbuf and vbuf must be C-contiguous float32 [kv_heads, capacity, D]")
    if window < 0:
        raise ValueError(f"window ({window}) must be positive, or 0 for none")
    if heads <= 0 or kv_heads <= 0 or heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a positive multiple of kv_heads ({kv_heads})")
    if x.ndim != 2 or b.ndim != 2:
        raise ValueError("qkv must be [R, width] and bias [S, past + S]")
    rows, width = x.shape
    slots = b.shape[0]
    if b.shape[1] < slots or b.shape[1] > kbuf.shape[1]:
        raise ValueError(f"past + S = {b.shape[1]} must be at least S = {slots} and fit the buffer's {kbuf.shape[1]}")
    if (slot_rows is None) != (row_slots is None):
        raise ValueError("slot_rows and row_slots come together")
    sr = None if slot_rows is None else np.ascontiguousarray(slot_rows, np.int64)
    rs = None if row_slots is None else np.ascontiguousarray(row_slots, np.int64)
    if sr is not None and rs is not None:
        if (
            sr.shape != (slots,)
            or rs.shape != (rows,)
            or sr.min() < 0
            or sr.max() >= rows
            or rs.min() < 0
            or rs.max() >= slots
        ):
            raise ValueError("slot_rows [S] must name rows of qkv and row_slots [R] slots of the bias")
    elif slots != rows:
        raise ValueError("without slot_rows and row_slots the bias has one row per qkv row")
    d = width // (heads + 2 * kv_heads)
    if d * (heads + 2 * kv_heads) != width or kbuf.shape != (kv_heads, kbuf.shape[1], d) or vbuf.shape != kbuf.shape:
        raise ValueError(f"qkv's width {width} and the buffers {kbuf.shape} disagree with the heads")
    if pos.shape != (slots,) or c.shape != s.shape or c.shape[1] != d // 2:
        raise ValueError("bias [S, T], positions [S] and cos/sin [positions, D/2] are needed")
    if pos.min(initial=0) < 0 or pos.max(initial=0) >= c.shape[0]:
        raise ValueError("a position is outside the rotary tables")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm and k_norm come together")
    qn = None if q_norm is None else np.ascontiguousarray(q_norm, np.float32)
    kn = None if k_norm is None else np.ascontiguousarray(k_norm, np.float32)
    if qn is not None and kn is not None and (qn.shape != (d,) or kn.shape != (d,)):
        raise ValueError(f"q_norm and k_norm must both be [{d}] (the head size)")
    out = np.empty((rows, heads * d), np.float32)
    rc = _fn(isa)(
        x.ctypes.data,
        rows,
        slots,
        None if sr is None else sr.ctypes.data,
        None if rs is None else rs.ctypes.data,
        kbuf.ctypes.data,
        vbuf.ctypes.data,
        kbuf.shape[1],
        c.ctypes.data,
        s.ctypes.data,
        pos.ctypes.data,
        b.ctypes.data,
        b.shape[1],
        heads,
        kv_heads,
        d,
        scale,
        window,
        None if qn is None else qn.ctypes.data,
        None if kn is None else kn.ctypes.data,
        norm_eps,
        out.ctypes.data,
    )
    if rc == -1:
        raise ValueError(f"the kernel refused head size {d} (it takes {HEAD_SIZES})")
    if rc != 0:
        raise ValueError(f"the kernel refused its arguments (code {rc})")
    return out


def reference(
    qkv: npt.ArrayLike,
    kbuf: F32,
    vbuf: F32,
    cos: npt.ArrayLike,
    sin: npt.ArrayLike,
    positions: npt.ArrayLike,
    bias: npt.ArrayLike,
    *,
    heads: int,
    kv_heads: int,
    scale: float,
    window: int = 0,
    q_norm: npt.ArrayLike | None = None,
    k_norm: npt.ArrayLike | None = None,
    norm_eps: float = 1e-6,
) -> npt.NDArray[np.float64]:
    """The same attention in float64 numpy (what the operator approximates in float32): per-head
    RMS norms where given, rotary halves, K/V written at past.., softmax over the keys the bias
    (and ``window``) does not hide. Updates copies of the buffers, returns [S, heads*D]."""
    x = np.asarray(qkv, np.float64)
    rows = x.shape[0]
    d = x.shape[1] // (heads + 2 * kv_heads)
    b = np.asarray(bias, np.float64)
    past = b.shape[1] - rows
    k, v = np.array(kbuf, np.float64), np.array(vbuf, np.float64)
    c = np.asarray(cos, np.float64)[np.asarray(positions)]
    s = np.asarray(sin, np.float64)[np.asarray(positions)]

    def rot(t):  # t [S, n, D]
        t1, t2 = t[..., : d // 2], t[..., d // 2 :]
        return np.concatenate([t1 * c[:, None] - t2 * s[:, None], t2 * c[:, None] + t1 * s[:, None]], -1)

    def norm(t, w):  # t [S, n, D]
        if w is None:
            return t
        r = 1 / np.sqrt((t * t).mean(-1, keepdims=True) + norm_eps)
        return t * r * np.asarray(w, np.float64)

    q = rot(norm(x[:, : heads * d].reshape(rows, heads, d), q_norm))
    kn = rot(norm(x[:, heads * d : (heads + kv_heads) * d].reshape(rows, kv_heads, d), k_norm))
    vn = x[:, (heads + kv_heads) * d :].reshape(rows, kv_heads, d)
    k[:, past : past + rows] = kn.transpose(1, 0, 2)
    v[:, past : past + rows] = vn.transpose(1, 0, 2)
    out = np.zeros((rows, heads, d))
    group = heads // kv_heads
    key_pos = np.concatenate([np.arange(past), np.asarray(positions)])
    for r in range(rows):
        seen = b[r] > UNSEEN
        if window:
            seen &= np.asarray(positions)[r] - key_pos < window
        for h in range(heads):
            g = h // group
            sc = k[g, : b.shape[1]] @ q[r, h] * scale + b[r]
            sc = np.where(seen, sc, -np.inf)
            e = np.exp(sc - sc.max())
            out[r, h] = (e / e.sum()) @ v[g, : b.shape[1]]
    return out.reshape(rows, heads * d)


def swiglu(x: npt.ArrayLike, isa: str | None = None) -> F32:
    """The compiled ``dejavuu.q41.SwiGLU`` (attn.cpp) without onnxruntime: ``x`` [rows, 2F] =
    [gate | up] -> silu(gate) * up, [rows, F]."""
    return _gated(x, "dejavuu_swiglu", isa)


def geglu(x: npt.ArrayLike, isa: str | None = None) -> F32:
    """The compiled ``dejavuu.q41.GeGLU`` (attn.cpp) without onnxruntime: ``x`` [rows, 2F] =
    [gate | up] -> gelu_tanh(gate) * up, [rows, F]."""
    return _gated(x, "dejavuu_geglu", isa)


def _gated(x: npt.ArrayLike, symbol: str, isa: str | None) -> F32:
    a = np.ascontiguousarray(x, np.float32)
    if a.ndim != 2 or a.shape[1] % 2:
        raise ValueError("x must be [rows, 2F]")
    fn = getattr(q41._load(q41.library(isa)), symbol)
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    out = np.empty((a.shape[0], a.shape[1] // 2), np.float32)
    fn(a.ctypes.data, a.shape[0], a.shape[1] // 2, out.ctypes.data)
    return out
