"""A GGUF file's own quantized blocks, found again for the ONNX weights they became.

A model loaded from a GGUF was de-quantized (``gguf.quants.dequantize``) into the fp32 export.
Quantizing those fp32 weights again puts a second rounding error on top of the file's: instead
we take the file's blocks. A weight is matched by content, never by name: every row of the
ONNX weight must be bit-identical to a row of the de-quantized GGUF tensor (transformers permutes
the rows of Llama's q/k projections, so rows are matched one by one), and nothing is carried
otherwise.

Every type decoded here is, per block of 32 (16 for Q6_K) along K, ``w = scale * q + offset``
with integer levels q of ``bits`` bits; ``nbits.carry`` turns that into MatMulNBits' form
``scale * (q' - 2^(width-1))`` plus, where the block has a minimum, a per-block offset term:
- centred (offset = -scale * 2^(bits-1)): Q8_0, Q4_0, Q5_0, Q6_K;
- with a minimum: Q4_1, Q5_1 (``d * q + m``), Q4_K, Q5_K (``d*sc * q - dmin*m`` per sub-block of
  32, 6-bit sub-block scales and mins inside super-blocks of 256).
Others (Q2_K, Q3_K, IQ*) have no such form here and are re-quantized.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

BLOCK = 32
CARRIED_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")


@dataclass
class Blocks:
    """One GGUF tensor's blocks as rows [N, K/block] of levels: ``w = scale * q + offset``."""

    kind: str  # the GGUF type
    bits: int  # bits of the file's levels: 4, 5, 6 or 8
    q: np.ndarray  # [N, nb, block] uint8 levels, 0 .. 2^bits - 1
    scale: np.ndarray  # [N, nb] float32
    offset: np.ndarray  # [N, nb] float32 (-scale * 2^(bits-1) for a centred type)

    @property
    def block(self) -> int:
        return int(self.q.shape[-1])

    def dequantize(self) -> np.ndarray:
        """[N, K] float32, the way the file means it."""
        return (self.scale[..., None] * self.q.astype(np.float32) + self.offset[..., None]).reshape(self.q.shape[0], -1)

    @property
    def centred(self) -> bool:
        """True when the offset is exactly -scale * 2^(bits-1): MatMulNBits' default zero point."""
        return bool(np.array_equal(self.offset, -self.scale * 2 ** (self.bits - 1)))

    def rows(self, perm: np.ndarray) -> "Blocks":
        return Blocks(self.kind, self.bits, self.q[perm], self.scale[perm], self.offset[perm])


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)[..., 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes -> 32 levels, GGML order: low nibbles are elements 0..15, high nibbles 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.uint8)


def _fifth_bit(qh: np.ndarray) -> np.ndarray:
    """4 bytes (a little-endian uint32) -> 32 high bits, bit j for element j (Q5_0 / Q5_1)."""
    return np.unpackbits(np.ascontiguousarray(qh), axis=-1, bitorder="little")


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes -> 8 six-bit scales and 8 six-bit mins (GGML's get_scale_min_k4)."""
    lo, mid, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([lo & 0x3F, (hi & 0x0F) | ((lo >> 2) & 0x30)], axis=-1).astype(np.float32)
    mn = np.concatenate([mid & 0x3F, (hi >> 4) | ((mid >> 2) & 0x30)], axis=-1).astype(np.float32)
    return sc, mn


def decode(kind: str, raw: np.ndarray, n: int, k: int) -> Blocks:
    """The blocks of a GGUF tensor's raw bytes ([N, row bytes] uint8) as rows of levels."""
    nb = k // BLOCK
    if kind == "Q8_0":
        b = raw.reshape(n, nb, 34)
        d = _f16(b[..., 0:2])
        q: np.ndarray = (b[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return Blocks(kind, 8, q, d, -128 * d)
    if kind == "Q4_0":
        b = raw.reshape(n, nb, 18)
        d = _f16(b[..., 0:2])
        return Blocks(kind, 4, _nibbles(b[..., 2:]), d, -8 * d)
    if kind == "Q4_1":
        b = raw.reshape(n, nb, 20)
        return Blocks(kind, 4, _nibbles(b[..., 4:]), _f16(b[..., 0:2]), _f16(b[..., 2:4]))
    if kind in ("Q5_0", "Q5_1"):
        at = 2 if kind == "Q5_0" else 4
        b = raw.reshape(n, nb, at + 20)
        q = _nibbles(b[..., at + 4 :]) | (_fifth_bit(b[..., at : at + 4]) << 4)
        d = _f16(b[..., 0:2])
        return Blocks(kind, 5, q, d, -16 * d if kind == "Q5_0" else _f16(b[..., 2:4]))
    if kind in ("Q4_K", "Q5_K"):  # super-blocks of 256: 8 sub-blocks of 32, 6-bit scales and mins
        five = kind == "Q5_K"
        b = raw.reshape(n, k // 256, 176 if five else 144)
        d, dmin = _f16(b[..., 0:2])[..., None], _f16(b[..., 2:4])[..., None]
        sc, mn = _k_scales(b[..., 4:16])
        qs = b[..., 48 if five else 16 :].reshape(n, k // 256, 4, 32)  # 4 x 64 elements: low nibbles, then high
        q = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(n, k // 256, 8, 32)
        if five:  # bit i of qh[j]: the fifth bit of sub-block i, element j
            qh = b[..., 16:48]
            q = q | (((qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1) << 4)
        return Blocks(
            kind,
            5 if five else 4,
            q.reshape(n, nb, BLOCK).astype(np.uint8),
            (d * sc).reshape(n, nb),
            (-(dmin * mn)).reshape(n, nb),
        )
    if kind == "Q6_K":  # super-blocks of 256: 16 sub-blocks of 16, int8 scales, q - 32
        b = raw.reshape(n, k // 256, 210)
        ql: np.ndarray = b[..., 0:128].reshape(n, -1, 2, 1, 64) >> np.array([0, 4], np.uint8)[:, None]
        ql = (ql & 0x0F).reshape(n, -1, 8, 32)
        qh = b[..., 128:192].reshape(n, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]
        qh = (qh & 0x03).reshape(n, -1, 8, 32)
        q = (ql | (qh << 4)).reshape(n, k // 16, 16).astype(np.uint8)
        s = (_f16(b[..., 208:210])[..., None] * b[..., 192:208].view(np.int8).astype(np.float32)).reshape(n, -1)
        return Blocks(kind, 6, q, s, -32 * s)
    raise ValueError(f"GGUF type {kind} has no exact MatMulNBits form")


def _row_keys(w: np.ndarray) -> list[bytes]:
    return [hashlib.blake2b(r.tobytes(), digest_size=16).digest() for r in np.ascontiguousarray(w, np.float32)]


class GGUFBlocks:
    """Find the GGUF blocks of an fp32 weight [N, K] (rows = output features)."""

    @classmethod
    def open(cls, path: str | Path) -> "GGUFBlocks":
        """The finder of ``path``, shared by every quantize call of a build while the file is
        unchanged (same size and mtime): the auto build quantizes three precisions from one GGUF,
        and each parse of it (SmolLM2: 49k tokenizer strings as reader fields) and row index cost
        ~2-3 s again."""
        st = Path(path).stat()
        return _open_cached(str(Path(path).resolve()), st.st_size, st.st_mtime_ns)

    def __init__(self, path: str | Path):
        from gguf import GGUFReader

        self.path = Path(path)
        self._reader = GGUFReader(str(path))
        self._by_shape: dict[tuple[int, int], list] = {}
        for t in self._reader.tensors:
            if t.tensor_type.name in CARRIED_TYPES and len(t.shape) == 2:
                k, n = (int(x) for x in t.shape)  # GGML order: ne0 = K
                self._by_shape.setdefault((n, k), []).append(t)
        self._keys: dict[str, dict[bytes, int]] = {}

    def _index(self, t) -> dict[bytes, int]:
        if t.name not in self._keys:
            from gguf.quants import dequantize

            w = dequantize(t.data, t.tensor_type).reshape(self._shape(t))
            self._keys[t.name] = {key: i for i, key in enumerate(_row_keys(w))}
        return self._keys[t.name]

    @staticmethod
    def _shape(t) -> tuple[int, int]:
        return int(t.shape[1]), int(t.shape[0])

    def find(self, w_nk: np.ndarray) -> tuple[str, Blocks] | None:
        """(tensor name, its blocks with rows in ``w_nk``'s order), or None if no tensor holds exactly these rows."""
        n, k = w_nk.shape
        cands = self._by_shape.get((n, k), [])
        if not cands or k % BLOCK:
            return None
        keys = _row_keys(w_nk)
        for t in cands:
            idx = self._index(t)
            if keys[0] not in idx:
                continue
            perm = [idx.get(key) for key in keys]
            if any(p is None for p in perm):
                continue
            blocks = decode(t.tensor_type.name, np.asarray(t.data).reshape(n, -1), n, k)
            return t.name, blocks.rows(np.asarray(perm))
        return None


@functools.lru_cache(maxsize=1)
def _open_cached(path: str, size: int, mtime_ns: int) -> GGUFBlocks:
    return GGUFBlocks(path)
