"""One quantizer, parameterised by a plan: body bits, lm-head bits, embedding bits.

Every MatMul with a constant 2D weight becomes ``com.microsoft.MatMulNBits`` (blocks along K);
the embedding Gather becomes ``GatherBlockQuantized``. Where the fp32 weights came from a GGUF,
the file's own blocks are carried over exactly (``gguf_blocks.py``, ``carry``) instead of rounding
them a second time; everything else is rounded by onnxruntime's own blockwise quantizer
(round-to-nearest; 4-bit blocks with a zero point where this machine's kernel keeps rows exact
with one, ``zero_points_row_exact``). Its other methods were weighed
(docs/quantization.md): HQQ writes float zero points, which the CPU kernel runs off its fast path
(many times slower per MatMul), and k-quant rounds no better than this on the real model measured.

A block with a minimum (Q4_1, Q4_K, Q5_1, Q5_K: ``w = d*q + m``) is carried as the symmetric
kernel's ``d * (q - 8)`` plus an offset term ``(m + 8d) * sum(x over the block)``: the block sums
are one fp32 MatMul of x with a 0/1 [K, blocks] matrix (shared by every projection reading x),
times an fp32 [blocks, N] matrix, added to MatMulNBits' output. Both MatMuls are fp32 and
row-invariant at every row count (measured: docs/quantization.md); siblings' offset MatMuls read
the same block sums, so the in-place flavours' sibling fusion concatenates them along N like the
4-bit weights.
Q5_x and Q6_K levels do not fit 4 bits: they are carried at 8 bits (Q6_K in blocks of 16), or, where
our operator runs them (``_op_form``), Q5_x at its own 5 bits (0.625 bytes a weight instead of 1).
What the library lacks and this module keeps: the plan (which node gets which width), the tied 8-bit table and the carried GGUF blocks.
The lm-head and the embedding are found by name (``/lm_head/MatMul``,
``/model/embed_tokens/Gather``, set by the exporter), never by guessing.

The lm-head's 8-bit table is the one weight whose block is measured, not planned: a block whose
MatMulNBits gives a row other bits alone than among rows would fail the batched gate, and which
blocks do is a property of the CPU's kernel (``choose_table_block``).

Tied embeddings stay tied: when the lm-head reads the embedding table through a Transpose,
both ops read ONE 8-bit table ([V, H] rows quantized in blocks along H, which is exactly the
MatMulNBits layout for N=V, K=H). An untied model keeps two tables.
We never write ``QAttention`` or touch ONNX ``Attention`` (a trap of ``quantize_dynamic``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from ..errors import ExportError
from ..log import logger, progress
from ..precisions import PLANS as PLANS  # re-exported: name -> plan, a view of the table
from ..precisions import QuantPlan
from ..schema import DEFAULT_THREADS, EMBED_NODE, LM_HEAD_NODE
from .gguf_blocks import BLOCK

if TYPE_CHECKING:
    from .gguf_blocks import GGUFBlocks
    from .stream import StreamedModel

MS = "com.microsoft"


# The plan of each precision is its entry in precisions.PRECISIONS (PLANS: a view of it).
GGUF_MIN_FORMS = ("offset", "nearest", "float_zp", "q41")
Q41 = "q41"  # kernels.q41's minimum form: w = d * q + m per block of 32, 4- or 8-bit levels as the file holds them


@dataclass
class Encoded:
    """One weight in MatMulNBits' layout: levels [N, nb, block] uint8 (unpacked), scales [N, nb],
    zero points [N, nb] (uint8 levels, float32, or None for the default 2^(bits-1)), and an
    optional offset [N, nb] float32 added to every weight of its block (the block-sum term).
    ``form`` "q41": the layout of our own operator instead (kernels.q41): 4-bit levels 0..15 as
    the file holds them, ``scales`` the blocks' d and ``offset`` their minimum m, w = d * q + m."""

    bits: int
    q: np.ndarray
    scales: np.ndarray
    zp: np.ndarray | None
    note: str
    offset: np.ndarray | None = None
    form: str = "nbits"

    @property
    def block(self) -> int:
        return int(self.q.shape[-1])

    def dequantize(self) -> np.ndarray:
        """[N, K] float32, as the graph computes it: (q - zero_point) * scale (+ offset)."""
        if self.form == Q41:
            if self.offset is None:
                raise ValueError("a q41 encoding carries its blocks' minima")
            w = self.scales[..., None] * self.q.astype(np.float32) + self.offset[..., None]
            return w.reshape(self.q.shape[0], -1)
        zp = np.float32(2 ** (self.bits - 1)) if self.zp is None else self.zp.astype(np.float32)[..., None]
        w = (self.q.astype(np.float32) - zp) * self.scales[..., None]
        if self.offset is not None:
            w = w + self.offset[..., None]
        return w.reshape(self.q.shape[0], -1)

    def packed(self) -> np.ndarray:
        return _pack(self.q, self.bits)

    def packed_zp(self) -> np.ndarray | None:
        if self.zp is None or self.zp.dtype == np.float32 or self.bits == 8:
            return self.zp
        z = self.zp if self.zp.shape[1] % 2 == 0 else np.pad(self.zp, ((0, 0), (0, 1)))
        return (z[:, 0::2] | (z[:, 1::2] << 4)).astype(np.uint8)


# Row counts the probe checks: pairs, odd counts, the kernel's tile edges and a tree's widths.
PROBE_ROWS = (2, 3, 4, 5, 8, 9, 16, 17, 18, 32, 33, 64)


@lru_cache(maxsize=None)
def zero_points_row_exact(accuracy_level: int, threads: int = DEFAULT_THREADS) -> tuple[bool, str]:
    """Does 4-bit MatMulNBits with zero points give every row the same bits among M rows
    (``PROBE_ROWS``) as beside one pad row (the row guard's lone form)? Measured here, on this
    machine's kernel, because losslessness rests on it and it is a property of the instruction set
    (a symmetric block has the same M = 1 behaviour, which the row guard pads; docs/exactness.md).
    Returns (exact, why) for the build's report."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    k, n, block = 256, 96, 32
    nb = k // block
    w = rng.integers(0, 256, size=(n, nb, block // 2), dtype=np.uint8)
    scales = (rng.random(n * nb, dtype=np.float32) * 0.02 + 0.001).astype(np.float32)
    zp = rng.integers(0, 256, size=n * ((nb + 1) // 2), dtype=np.uint8)
    node = helper.make_node(
        "MatMulNBits", ["x", "w", "s", "z"], ["y"], domain=MS, K=k, N=n, bits=4, block_size=block,
        accuracy_level=accuracy_level,
    )  # fmt: skip
    graph = helper.make_graph(
        [node],
        "zero_points_probe",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", n])],
        [numpy_helper.from_array(a, nm) for a, nm in ((w, "w"), (scales, "s"), (zp, "z"))],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(MS, 1)])
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.log_severity_level = threads, 3
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    pad = np.zeros((1, k), np.float32)
    for m in PROBE_ROWS:
        x = rng.standard_normal((m, k)).astype(np.float32)
        among = sess.run(None, {"x": x})[0]
        for r in range(m):
            alone = sess.run(None, {"x": np.concatenate([x[r : r + 1], pad])})[0][0]
            if not np.array_equal(among[r], alone):
                return False, f"4-bit zero points: row {r} of {m} differs from it beside a pad row on this CPU"
    return True, f"4-bit zero points: every row of {', '.join(map(str, PROBE_ROWS))} equal to it beside a pad row"


# Row counts the table probe compares each row across (as export.exactness), and the row counts its
# timing reads: a plain step, the row guard's two rows, a verify step of a chain of 7 drafts.
TABLE_ROWS = (2, 3, 5, 8, 17)
TABLE_TIMED_ROWS = (1, 2, 8)
VERDICTS = ("invariant", "guardable", "variant")


def _nbits_session(
    bits: int, block: int, k: int, n: int, accuracy_level: int, threads: int, seed: int = 0, zero_points: bool = False
):
    """One MatMulNBits [1, M, K] -> [1, M, N] with random levels and scales, symmetric (the table's
    form) or with a random uint8 zero point per block (an asymmetric body's)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    nb = k // block
    q = rng.integers(0, 256, size=(n, nb, block * bits // 8), dtype=np.uint8)
    scales = (rng.random((n, nb), dtype=np.float32) * 0.02 + 0.001).astype(np.float32)
    arrays: list[tuple[np.ndarray, str]] = [(q, "w"), (scales, "s")]
    if zero_points:  # 8 bits: a byte per block; 4 bits: two per byte, each column's padded to whole bytes
        per_col = nb if bits == 8 else (nb + 1) // 2
        arrays.append((rng.integers(0, 256, size=n * per_col, dtype=np.uint8), "z"))
    node = helper.make_node(
        "MatMulNBits", ["x"] + [nm for _, nm in arrays], ["y"], domain=MS, K=k, N=n, bits=bits, block_size=block,
        accuracy_level=accuracy_level,
    )  # fmt: skip
    graph = helper.make_graph(
        [node],
        "table_probe",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "M", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "M", n])],
        [numpy_helper.from_array(a, nm) for a, nm in arrays],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(MS, 1)])
    del q, scales, graph, arrays
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.log_severity_level = threads, 3
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


@lru_cache(maxsize=None)
def nbits_rows(
    bits: int, block: int, k: int, n: int, accuracy_level: int, threads: int, zero_points: bool = False
) -> tuple[int, int, int]:
    """(rows compared, rows equal to the row alone, rows equal to it beside one zero pad row) of one
    MatMulNBits signature on this machine's kernel, every row of 2, 3, 5, 8 and 17-row forwards:
    export.exactness's per-op measure, made before the graph exists so that the quantizer can pick
    a form the graph keeps exact (docs/exactness.md)."""
    sess = _nbits_session(bits, block, k, n, accuracy_level, threads, zero_points=zero_points)
    x = np.random.default_rng(1).standard_normal((1, max(TABLE_ROWS), k)).astype(np.float32)
    pad = np.zeros((1, 1, k), np.float32)
    alone = [sess.run(None, {"x": x[:, r : r + 1]})[0][0, 0] for r in range(x.shape[1])]
    padded = [sess.run(None, {"x": np.concatenate([x[:, r : r + 1], pad], 1)})[0][0, 0] for r in range(x.shape[1])]
    rows = eq_alone = eq_padded = 0
    for m in TABLE_ROWS:
        out = sess.run(None, {"x": x[:, :m]})[0][0]
        for r in range(m):
            rows += 1
            eq_alone += int(np.array_equal(out[r], alone[r]))
            eq_padded += int(np.array_equal(out[r], padded[r]))
    return rows, eq_alone, eq_padded


VERDICT_THREADS = tuple(sorted({1, DEFAULT_THREADS}))  # a block's rows are judged at each of these


def rows_verdict(rows: int, eq_alone: int, eq_padded: int) -> str:
    """export.exactness's verdict: invariant (nothing to pay), guardable (the row guard's pad row
    makes it exact), variant (no graph with it is exact)."""
    if eq_padded < rows:
        return "variant"
    return "invariant" if eq_alone == rows else "guardable"


def block_verdict(bits: int, block: int, k: int, n: int, accuracy_level: int, zero_points: bool = False) -> dict:
    """One MatMulNBits signature at one block on this machine: the worst ``rows_verdict`` over
    VERDICT_THREADS and the rows counted over them (the record ``choose_table_block`` keeps)."""
    per = [nbits_rows(bits, block, k, n, accuracy_level, t, zero_points=zero_points) for t in VERDICT_THREADS]
    rows, alone, padded = (sum(c) for c in zip(*per))
    worst = max((rows_verdict(*p) for p in per), key=VERDICTS.index)
    return {"verdict": worst, "rows": rows, "equal_alone": alone, "equal_padded": padded}


def nbits_slowdown(
    bits: int, base: int, other: int, k: int, n: int, accuracy_level: int, threads: int, rounds: int = 7, reps: int = 5
) -> tuple[dict[int, dict[int, float]], dict[int, float]]:
    """How much slower one MatMulNBits signature runs in blocks of ``other`` than of ``base``, at each
    row count of TABLE_TIMED_ROWS: the two interleaved forward by forward group (a shared machine's
    load drifts), the fastest of ``reps`` forwards each, the ratio taken within each round and its
    median over rounds. Returns (median ms per block and row count, ratio per row count)."""
    sessions = {b: _nbits_session(bits, b, k, n, accuracy_level, threads) for b in (base, other)}
    x = np.random.default_rng(2).standard_normal((1, max(TABLE_TIMED_ROWS), k)).astype(np.float32)
    got: dict[tuple[int, int], list[float]] = {(b, m): [] for b in sessions for m in TABLE_TIMED_ROWS}
    for _ in range(rounds):
        for m in TABLE_TIMED_ROWS:
            feed = {"x": x[:, :m]}
            for b, sess in sessions.items():
                sess.run(None, feed)
                best = float("inf")
                for _ in range(reps):
                    t = time.perf_counter()
                    sess.run(None, feed)
                    best = min(best, time.perf_counter() - t)
                got[(b, m)].append(best)
    ms = {b: {m: round(1e3 * float(np.median(got[(b, m)])), 3) for m in TABLE_TIMED_ROWS} for b in sessions}
    ratio = {
        m: round(float(np.median(np.array(got[(other, m)]) / np.array(got[(base, m)]))), 3) for m in TABLE_TIMED_ROWS
    }
    return ms, ratio


def table_blocks(k: int, largest: int) -> list[int]:
    """The blocks the lm-head table may take: ``largest`` halved down to 16, those dividing K."""
    out, b = [], largest
    while b >= 16:
        if k % b == 0:
            out.append(b)
        b //= 2
    return out


def first_exact(cands: list[int], verdict) -> tuple[int, str] | None:
    """The first block of ``cands`` (in the caller's preference order) with the best verdict any of
    them reaches -- ``invariant``, else ``guardable`` -- and that verdict; None where every block is
    ``variant``. ``verdict`` measures a block (lazily: blocks past the first invariant one are not
    measured), so the lm-head's and the body's choices rank blocks alike."""
    for tier in VERDICTS[:2]:
        best = next((b for b in cands if verdict(b) == tier), None)
        if best is not None:
            return best, tier
    return None


def choose_table_block(k: int, n: int, plan: QuantPlan, file_block: int | None = None) -> dict:
    """The block of the 8-bit lm-head (a tied model's embedding table too) on this machine.

    Each candidate block (``plan.lm_head_block`` halved down to 16, dividing K, and the GGUF's own
    table block ``file_block`` where the file holds the table in a centred 8-bit-exact type) is
    measured as the graph will run it (``nbits_rows`` at the real K and N, with 1 thread and the
    default threads): rows must be ``invariant``, else ``guardable`` (the row guard pads them); a
    ``variant`` block would fail the batched gate (Gemma-3-270M's K=640 lm-head in blocks of 128
    on an Intel AMX Xeon: docs/exactness.md). Within the best verdict reached, the file's own
    blocks where they reach it too (``plan.carry_table``: the table is the file's, exactly), else
    the largest block (fewest scales); with ``carry_table`` off, the file's blocks only where they
    run at most ``plan.table_carry_slowdown`` times slower at 1, 2 and 8 rows (timed here).
    Returns the record the quantize report keeps (block, carried, why, what was measured)."""
    bits, acc = plan.lm_head_bits, plan.accuracy_level
    cands = table_blocks(k, plan.lm_head_block)
    if file_block and k % file_block == 0 and file_block not in cands:
        cands = sorted({*cands, file_block}, reverse=True)
    measured: dict[int, dict] = {}

    def verdict(b: int) -> str:
        if b not in measured:
            measured[b] = block_verdict(bits, b, k, n, acc)
        return measured[b]["verdict"]

    sig = f"MatMulNBits bits={bits} acc={acc} K={k} N={n}"
    rec: dict = {"signature": sig, "candidates": cands, "file_block": file_block, "threads": list(VERDICT_THREADS)}
    found = first_exact(cands, verdict)
    if found is not None:
        best, tier = found
        rec.update(block=best, verdict=tier, carried=file_block == best)
        if plan.carry_table and file_block is not None and file_block < best and verdict(file_block) == tier:
            rec.update(block=file_block, carried=True)
        elif (
            plan.table_carry_slowdown > 0
            and file_block is not None
            and file_block < best
            and verdict(file_block) == tier
        ):
            ms, ratio = nbits_slowdown(bits, best, file_block, k, n, acc, DEFAULT_THREADS)
            slow = max(ratio.values())
            rec["ms"] = {str(b): {str(m): t for m, t in v.items()} for b, v in ms.items()}
            rec["file_block_slowdown"] = {str(m): r for m, r in ratio.items()}
            if slow <= plan.table_carry_slowdown:
                rec.update(block=file_block, carried=True)
        what = "the file's own blocks" if rec["carried"] else "re-rounded"
        others = ", ".join(f"{b}: {measured[b]['verdict']}" for b in sorted(measured, reverse=True))
        rec["why"] = f"{sig}: blocks of {rec['block']} ({what}), {tier} here ({others})" + (
            f"; the file's blocks of {file_block} ran {slow:.2f}x the time of {best}'s at worst "
            f"over {', '.join(map(str, TABLE_TIMED_ROWS))} rows (limit {plan.table_carry_slowdown}x)"
            if "file_block_slowdown" in rec
            else ""
        )
        rec["measured"] = {str(b): v for b, v in sorted(measured.items(), reverse=True)}
        return rec
    block = cands[0]
    rec.update(
        block=block, verdict="variant", carried=file_block == block, measured={str(b): v for b, v in measured.items()}
    )
    rec["why"] = f"{sig}: no block of {cands} keeps rows exact here; blocks of {block} (the batched gate decides)"
    logger.warning("  %s", rec["why"])
    return rec


def choose_body_block(
    bits: int, k: int, n: int, largest: int, accuracy_level: int, zero_points: bool = False
) -> tuple[int | None, str]:
    """The block of a re-rounded body weight [K, N] (N: the fused siblings' width, as the in-place
    flavours run it) on this machine: the largest of ``largest`` halved down to 16 dividing K whose
    rows stay exact here alone and among rows (else beside a pad row: the row guard's form), measured
    with ``block_verdict`` as ``choose_table_block`` measures the lm-head's. Returns (block, why);
    None where no block of 16 or more divides K.

    Why a plan may ask for more than the GGUF's 32: each block carries a float scale (MLAS adds a
    float block sum), so an 8-bit weight in blocks of 32 streams 1.25 bytes per weight and in 64
    about 1.13 (SmolLM2-135M's one-token step 0.93-0.94x; its quality cost is why the registered
    int8 keeps 32: precisions.py). Why measured: which blocks keep rows exact is the CPU's kernel's
    property (blocks of 128 at K = 1536, N = 576 give a lone row other bits on an AVX-512 AMD EPYC;
    64 do not)."""
    cands = table_blocks(k, largest)
    if not cands:
        return None, f"no block of 16..{largest} divides K = {k}"
    if len(cands) == 1:
        return cands[0], f"blocks of {cands[0]} (the only one dividing K = {k})"
    verdicts: dict[int, str] = {}

    def verdict(b: int) -> str:
        if b not in verdicts:
            verdicts[b] = block_verdict(bits, b, k, n, accuracy_level, zero_points)["verdict"]
        return verdicts[b]

    found = first_exact(cands, verdict)
    seen = ", ".join(f"{c}: {v}" for c, v in verdicts.items())
    if found is not None:
        return found[0], f"blocks of {found[0]}, {found[1]} here ({seen})"
    return cands[-1], f"no block keeps rows exact here ({seen}); blocks of {cands[-1]} (the batched gate decides)"


def _quantize_rows(w_rows: np.ndarray, bits: int, block: int, symmetric: bool = True) -> Encoded:
    """Round ``w_rows`` [N, K] to ``bits`` in blocks of ``block`` along K with onnxruntime's own
    blockwise quantizer (MLAS, the one its MatMulNBitsQuantizer uses)."""
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, DefaultWeightOnlyQuantizer

    n, k = w_rows.shape
    cfg = DefaultWeightOnlyQuantConfig(block_size=block, is_symmetric=symmetric, bits=bits)
    packed, scales, zp = DefaultWeightOnlyQuantizer(cfg).qbits_block_quant(np.ascontiguousarray(w_rows.T, np.float32))
    q = _unpack(packed, bits).reshape(n, k // block, block)
    z = None if symmetric else _unpack(zp, bits)[:, : k // block]
    return Encoded(bits, q, scales.astype(np.float32), z, f"q{bits} bs{block} {'sym' if symmetric else 'asym'}")


def _unpack(x: np.ndarray, bits: int) -> np.ndarray:
    if bits == 8:
        return x.astype(np.uint8)
    return np.stack([x & 0x0F, x >> 4], axis=-1).reshape(*x.shape[:-1], -1).astype(np.uint8)


def carry(src, bits: int, plan: QuantPlan) -> Encoded | None:
    """The GGUF blocks ``src`` (gguf_blocks.Blocks, rows already in the weight's order) at ``bits``.

    Levels wider than 4 bits (Q5_x, Q6_K, Q8_0) go to 8 bits, except Q5_x's in blocks of 32 where
    our operator runs them (``_op_5bit``): 5 bits, as the file holds them. Centred blocks (Q4_0, Q5_0, Q6_K,
    Q8_0) are MatMulNBits' own form. A block minimum (Q4_1, Q4_K, Q5_1, Q5_K) is, by
    ``plan.gguf_min``: "offset", exact (levels re-centred, the rest in the block-sum term);
    "float_zp", exact on slow kernels; "nearest", the nearest integer zero point (per block a
    fresh asymmetric rounding where that is closer); those two hold 4-bit levels only. None where
    the blocks have no such form: a minimum in an 8-bit plan (an 8-bit rounding of the file's
    weights loses nothing measurable and needs no offset term), or 5-bit levels with a minimum
    outside the "offset" form."""
    name = src.kind
    if plan.gguf_min == Q41 and bits == 4 and src.block == BLOCK and (src.bits == 4 or not src.centred):
        # Q4_0 / Q4_1 / Q4_K: levels, scale and minimum (a centred type's -8d, exact in float32)
        # as the file holds them, for our operator: nothing re-rounded, nothing re-centred; Q5_1 /
        # Q5_K likewise in its 5-bit levels (the block minimum needs no offset term there either)
        w = src.bits if src.bits in (4, 5) else 8
        return Encoded(w, src.q, src.scale, None, f"{name} carried exactly (q41 operator)", src.offset, form=Q41)
    width = 5 if bits != 8 and _op_5bit(src, plan) else 8 if bits == 8 or src.bits > 4 else 4
    shift = 2 ** (width - 1) - 2 ** (src.bits - 1)  # centre the file's levels in the kernel's range
    q = (src.q.astype(np.int16) + shift).astype(np.uint8)
    bs = "" if src.block == BLOCK else f" bs{src.block}"
    if src.centred:
        return Encoded(width, q, src.scale, None, f"{name} carried exactly (q{width}{bs})")
    if bits == 8:
        return None
    if plan.gguf_min in ("offset", Q41):  # s*q + o = s*(q' - 2^(w-1)) + (o + s*2^(b-1))
        c = (src.offset + src.scale * np.float32(2 ** (src.bits - 1))).astype(np.float32)
        return Encoded(width, q, src.scale, None, f"{name} carried exactly (q{width}{bs} + block-sum offset)", c)
    if width != 4:  # onnxruntime has no 8-bit float zero points
        return None
    flat = src.scale == 0  # a constant block: w = offset
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = shift - src.offset / src.scale
    if plan.gguf_min == "float_zp":  # (q' - zp) * scale = scale * q + offset
        qf = np.where(flat[..., None], 0, q).astype(np.uint8)
        zp = np.where(flat, -1.0, ratio).astype(np.float32)  # a constant block: (0 + 1) * offset
        s = np.where(flat, src.offset, src.scale).astype(np.float32)
        return Encoded(width, qf, s, zp, f"{name} carried exactly (q{width}{bs}, float zero points)")
    # Nearest integer zero point: w = scale * (q - z) + r, |r| <= scale / 2 per block.
    z = np.where(flat, 0, ratio)
    ok = (z >= 0) & (z <= 15) & np.isfinite(z)
    own_zp = np.clip(np.nan_to_num(z), 0, 15).astype(np.uint8)
    own = Encoded(4, src.q, src.scale, own_zp, "")
    w = src.dequantize()
    n, k = w.shape
    fresh = _quantize_rows(w, 4, src.block, symmetric=False)
    if fresh.zp is None:
        raise AssertionError("an asymmetric rounding comes with its zero points")
    err_own = ((own.dequantize() - w) ** 2).reshape(n, -1, src.block).sum(-1)
    err_fresh = ((fresh.dequantize() - w) ** 2).reshape(n, -1, src.block).sum(-1)
    use_own = ok & (err_own <= err_fresh)
    q = np.where(use_own[..., None], own.q, fresh.q)
    s = np.where(use_own, own.scales, fresh.scales).astype(np.float32)
    zp = np.where(use_own, own_zp, fresh.zp).astype(np.uint8)
    return Encoded(
        4,
        q,
        s,
        zp,
        f"{name} carried (q4, minimum as the nearest integer zero point; "
        f"{100 * (1 - use_own.mean()):.1f}% of blocks re-rounded where closer)",
    )


def _centred_in_op(plan: QuantPlan) -> bool:
    """Whether ``plan`` runs centred blocks (the file's Q8_0 / Q5_0 levels, and the lm-head) in our
    operator, not only q41 encodings: the one test ``_op_5bit`` and ``_op_form`` share."""
    return plan.gguf_min == Q41 and plan.lm_head_op


def _op_5bit(src, plan: QuantPlan) -> bool:
    """Whether ``src`` (centred 5-bit levels in blocks of 32: Q5_0) runs in our operator at its own
    width under ``plan``."""
    return _centred_in_op(plan) and src.bits == 5 and src.centred and src.block == BLOCK


def _sibling_name(node, role: str) -> str:
    """``/model/layers.0/self_attn/q_proj/MatMul`` -> ``/model/layers.0/self_attn/q_proj_<role>/MatMul``:
    the in-place flavours name a fused group after its members' parent scopes, so the offset
    MatMuls of q/k/v fuse under a name of their own, apart from the fused MatMulNBits'."""
    scope, _, op = node.name.rpartition("/")
    return f"{scope}_{role}/{op}" if scope else f"{node.name}_{role}"


def block_sum_matrix(k: int, block: int) -> np.ndarray:
    """[K, K/block] float32 of 0/1: x @ it is x's sums over each block of ``block`` along K."""
    return np.repeat(np.eye(k // block, dtype=np.float32), block, axis=0)


def fit_block(k: int, block: int) -> int | None:
    """The largest power-of-two block <= ``block`` (and >= 16) that divides ``k``; None if none does."""
    b = block
    while b >= 16:
        if k % b == 0:
            return b
        b //= 2
    return None


def _pack(q: np.ndarray, bits: int) -> np.ndarray:
    if bits == 8:
        return q
    if bits == 4:
        return (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
    raise ValueError(f"unsupported bit width {bits}")


def quantize_model(
    src: Path, dst: Path, plan: QuantPlan, *, tied: bool | None = None, gguf: str | Path | None = None
) -> dict:
    """Quantize the fp32 decoder at ``src`` into ``dst`` following ``plan``; returns a report.
    ``gguf``: the GGUF file the fp32 weights came from, whose own blocks are carried over.

    Memory: the graph is read without its weights (``stream.py``); each fp32 weight is read from
    the file when it is quantized and dropped after, so the peak is the quantized model plus the
    largest weight's working copies, not the fp32 model."""
    from onnx import helper

    from ..export.exporter import save_model
    from .stream import StreamedModel

    if plan.gguf_min not in GGUF_MIN_FORMS:
        raise ExportError(f"gguf_min must be one of {', '.join(GGUF_MIN_FORMS)} (got {plan.gguf_min!r})")
    t0 = time.perf_counter()
    blocks = None
    if gguf is not None:
        from .gguf_blocks import GGUFBlocks

        blocks = GGUFBlocks.open(gguf)
    streamed = StreamedModel(src)
    model = streamed.model
    g = model.graph
    by_name = {nd.name: nd for nd in g.node}
    lm = by_name.get(LM_HEAD_NODE)
    emb = by_name.get(EMBED_NODE)
    if lm is None:
        raise ExportError(f"{src.name}: no {LM_HEAD_NODE} node; re-export with this version of dejavuu-build")
    q = _Quantizing(
        plan,
        blocks,
        streamed,
        producers={o: nd for nd in g.node for o in nd.output},
        report={"plan": plan.to_json(), "nodes": {}, "gguf": {"carried": 0, "requantized": 0} if blocks else None},
    )
    lm_tied = _quantize_embedding(q, emb, lm) if emb is not None else False
    if tied is not None and tied != lm_tied and emb is not None:
        raise ExportError(f"manifest says tied={tied} but the graph's lm-head tied={lm_tied}")
    q.report["tied_embeddings"] = bool(lm_tied)
    _quantize_matmuls(q, list(g.node))
    nodes = []
    for nd in g.node:
        if id(nd) in q.drop_nodes:
            continue
        nodes.extend(q.replaced.get(id(nd), [nd]))
    del g.node[:]
    g.node.extend(nodes)
    used = {x for nd in g.node for x in nd.input}
    g.initializer.extend([streamed.proto(n) for n in streamed.names if n in used] + q.new_inits)
    del q.new_inits[:]
    streamed.close()
    if not any(o.domain == MS for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS, 1))
    for domain in sorted(q.operators):
        model.opset_import.append(helper.make_opsetid(domain, 1))
    if q.operators:
        q.report["operators"] = sorted(q.operators)
    save_model(model, dst)
    report = q.report
    if blocks is not None:
        report["gguf"]["file"] = blocks.path.name
    report.update(
        seconds=round(time.perf_counter() - t0, 2),
        quantized_nodes=len(report["nodes"]),
        float_weight_bytes=int(q.fp_bytes),
        quantized_weight_bytes=int(q.q_bytes),
    )
    return report


@dataclass
class _Quantizing:
    """One quantize_model run: the plan, the GGUF's blocks (None: nothing to carry), the fp32 graph's
    weights (read one at a time) and producers, and what the run writes: the report, the new
    initializers, the nodes that replace or drop old ones, the block sums computed per input."""

    plan: QuantPlan
    blocks: GGUFBlocks | None
    inits: StreamedModel
    producers: dict
    report: dict
    new_inits: list = field(default_factory=list)
    new_names: set = field(default_factory=set)
    replaced: dict = field(default_factory=dict)  # id(node) -> replacement nodes
    drop_nodes: set = field(default_factory=set)
    block_sums: dict = field(default_factory=dict)  # (input, block) -> its block sums, shared by its readers
    operators: set = field(default_factory=set)  # our operators' domains the graph uses (kernels)
    hidden: int | None = None  # the residual stream's width (the embedding table's), where there is one
    fp_bytes: int = 0
    q_bytes: int = 0

    def add_init(self, arr: np.ndarray, name: str) -> str:
        from onnx import numpy_helper

        self.new_inits.append(numpy_helper.from_array(arr, name))
        self.new_names.add(name)
        self.q_bytes += arr.nbytes
        return name


class _SharedTable(NamedTuple):
    """The tied 8-bit table: [V, H] uint8 levels and [V, nb] scales, read by the lm-head as [N, nb, block]."""

    data: str
    scales: str
    block: int
    n: int
    k: int


def _symmetric_4bit(q: _Quantizing) -> bool:
    """What re-rounded 4-bit blocks get: a zero point only where this machine keeps rows exact
    with one; probed once, when the first 4-bit block is re-rounded or carried with one."""
    if q.plan.symmetric:
        return True
    if "rounding" not in q.report:
        exact, why = zero_points_row_exact(q.plan.accuracy_level)
        q.report["rounding"] = {"zero_points": exact, "why": why}
        if not exact:
            logger.warning("  %s: re-rounded 4-bit blocks are symmetric here", why)
    return not q.report["rounding"]["zero_points"]


def _symmetric(q: _Quantizing, bits: int) -> bool:
    """Whether re-rounded body blocks of ``bits`` are symmetric: 8 bits as the plan says (rows with
    8-bit zero points are probed with the block, ``choose_body_block``), 4 bits also where this
    machine's kernel would give rows other bits with one (``_symmetric_4bit``)."""
    return q.plan.symmetric if bits == 8 else _symmetric_4bit(q)


def _encode(q: _Quantizing, w_nk: np.ndarray, bits: int, block: int) -> Encoded:
    """The file's own blocks where the GGUF holds exactly these rows (at the file's block, whatever
    the plan's: Q8_0 stays in its blocks of 32); else onnxruntime's rounding at ``block``."""
    found = q.blocks.find(w_nk) if q.blocks is not None and block >= BLOCK else None
    if found is not None:
        where, file_blocks = found
        enc = carry(file_blocks, bits, q.plan)
        if enc is not None and enc.zp is not None and enc.zp.dtype == np.uint8 and _symmetric_4bit(q):
            enc = None  # a block minimum needs a zero point: round afresh, symmetric
        if enc is not None:
            q.report["gguf"]["carried"] += 1
            enc.note = f"{where} {enc.note}"
            return enc
    if q.blocks is not None:
        q.report["gguf"]["requantized"] += 1
    if q.plan.gguf_min == Q41 and bits == 4 and block == BLOCK:
        return q41_rows(w_nk)
    return _quantize_rows(w_nk, bits, block, symmetric=_symmetric(q, bits))


def q41_rows(w_rows: np.ndarray) -> Encoded:
    """[N, K] float32 rounded to our operator's form (kernels.q41) as llama.cpp rounds Q4_1
    (quantize_row_q4_1_ref): per block of 32, m = min, d = (max - min) / 15, q = round((w - m) / d).
    Written here because onnxruntime's quantizer writes only integer zero points."""
    n, k = w_rows.shape
    w = np.ascontiguousarray(w_rows, np.float32).reshape(n, k // BLOCK, BLOCK)
    lo, hi = w.min(-1), w.max(-1)
    d = ((hi - lo) / np.float32(15)).astype(np.float32)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    q = np.clip(np.floor((w - lo[..., None]) * inv[..., None] + np.float32(0.5)), 0, 15).astype(np.uint8)
    # d and m kept as float16, as the file format keeps them: the levels are what llama.cpp (and
    # the gguf package) would write, and the operator streams half the bytes of float32 scales
    d16, m16 = (a.astype(np.float16).astype(np.float32) for a in (d, lo))
    return Encoded(4, q, d16, None, "q4_1 bs32 (q41 operator)", m16, form=Q41)


def _head_encoding(q: _Quantizing, w_nk: np.ndarray) -> Encoded:
    """The 8-bit lm-head (tied: the embedding table) at the block ``choose_table_block`` measured
    on this machine: the GGUF's own blocks where the file holds them in a centred type and
    they keep rows exact (and fast enough), else a symmetric re-rounding at that block."""
    n, k = w_nk.shape
    found = q.blocks.find(w_nk) if q.blocks is not None else None
    own = carry(found[1], 8, q.plan) if found is not None else None
    if own is not None and (own.bits != 8 or own.zp is not None or own.offset is not None):
        own = None  # a table with block minima has no exact 8-bit form without an offset term
    if q.plan.gguf_min == Q41 and q.plan.lm_head_op and k % BLOCK == 0:  # our operator: row-exact at its one block
        carried = own is not None and own.block == BLOCK
        why = "our operator's blocks of 32 (rows exact by construction)"
        choice: dict = {"block": BLOCK, "carried": carried, "why": why + (", the file's own" if carried else "")}
    else:
        choice = choose_table_block(k, n, q.plan, own.block if own is not None else None)
    q.report["lm_head_block"] = choice
    logger.info("  lm-head table: %s", choice["why"])
    if own is not None and found is not None and choice["carried"]:
        q.report["gguf"]["carried"] += 1
        own.note = f"{found[0]} {own.note}"
        return own
    if q.blocks is not None:
        q.report["gguf"]["requantized"] += 1
    enc = _quantize_rows(w_nk, 8, choice["block"], symmetric=True)
    if found is not None:
        enc.note = f"{found[0]} {found[1].kind} re-rounded ({enc.note})"
    return enc


def _offset_term(q: _Quantizing, node, x: str, enc: Encoded, prefix: str) -> tuple[list, str]:
    """Nodes adding ``sum(x over block b) * offset[b, n]`` to the MatMulNBits output; returns
    (nodes, the MatMulNBits' own output name). The block sums of ``x`` are computed once."""
    from onnx import helper

    k = enc.q.shape[1] * enc.block
    nodes = []
    key = (x, enc.block)
    if key not in q.block_sums:
        e_name = f"quant.block_sums.k{k}_bs{enc.block}"
        if e_name not in q.new_names:
            q.add_init(block_sum_matrix(k, enc.block), e_name)
        q.block_sums[key] = f"{prefix}.block_sums"
        nodes.append(
            helper.make_node("MatMul", [x, e_name], [q.block_sums[key]], name=_sibling_name(node, "blocksums"))
        )
    if enc.offset is None:
        raise ValueError(f"{node.name}: an offset term needs the encoding's block offsets")
    c = q.add_init(np.ascontiguousarray(enc.offset.T), prefix + f".q{enc.bits}_offset")
    y0, off = node.output[0] + "_nbits", node.output[0] + "_offset"
    nodes += [
        helper.make_node("MatMul", [q.block_sums[key], c], [off], name=_sibling_name(node, "offset")),
        helper.make_node("Add", [y0, off], [node.output[0]], name=node.name + "_AddOffset"),
    ]
    return nodes, y0


def _matmul_nbits(q: _Quantizing, node, enc: Encoded | None, prefix: str, shared: _SharedTable | None = None) -> list:
    """``node`` (a MatMul) as MatMulNBits over ``enc``, or over the tied table ``shared``."""
    from onnx import helper

    after: list = []
    out = node.output[0]
    if _op_form(q, enc):
        assert enc is not None
        return [_q41_node(q, node, enc, prefix)]
    if shared is None:
        if enc is None:
            raise ValueError(f"{node.name}: MatMulNBits needs the weight's encoding or the shared table")
        n, k = enc.q.shape[0], enc.q.shape[1] * enc.block
        bits, block = enc.bits, enc.block
        ins = [
            node.input[0],
            q.add_init(enc.packed(), prefix + f".q{bits}"),
            q.add_init(enc.scales, prefix + f".q{bits}_scales"),
        ]
        packed_zp = enc.packed_zp()  # None exactly when enc.zp is
        if packed_zp is not None:
            ins.append(q.add_init(packed_zp, prefix + f".q{bits}_zero_points"))
        if enc.offset is not None:
            after, out = _offset_term(q, node, node.input[0], enc, prefix)
        extra: list = []
    else:  # the tied table: [V, H] uint8 + [V, nb] scales, viewed as MatMulNBits' [N, nb, block]
        bits, block, n, k = 8, shared.block, shared.n, shared.k
        shape = q.add_init(np.array([n, k // block, block], dtype=np.int64), prefix + ".q_shape")
        b_name = prefix + ".q8_view"
        extra = [helper.make_node("Reshape", [shared.data, shape], [b_name], name=node.name + "_ViewTied")]
        ins = [node.input[0], b_name, shared.scales]
    mm = helper.make_node(
        "MatMulNBits",
        ins,
        [out],
        name=node.name + "NBits",
        domain=MS,
        K=k,
        N=n,
        bits=bits,
        block_size=block,
        accuracy_level=q.plan.accuracy_level,
    )
    return extra + [mm] + after


def _op_form(q: _Quantizing, enc: Encoded | None) -> bool:
    """Whether ``enc`` runs in our operator (kernels.q41) under this plan: a q41 encoding (4-bit
    levels with a minimum), or, where the plan runs the lm-head or 8-bit weights there too, a
    centred one in blocks of 32 (the file's Q8_0 or Q5_0 levels, d * (q - 2^(bits-1))): 4, 5 or
    8 bits."""
    if enc is None:
        return False
    if enc.form == Q41:
        return True
    return (
        _centred_in_op(q.plan)
        and enc.block == BLOCK
        and enc.zp is None
        and enc.offset is None
        and enc.bits in (4, 5, 8)
    )


def _q41_node(q: _Quantizing, node, enc: Encoded, prefix: str):
    """``node`` (a MatMul) as our operator (kernels.q41) over ``enc``'s levels and d, with the
    blocks' minima m (a q41 encoding) or none (the centred form: exact integer correction). d and
    m go as float16 where every value is one (the GGUF's Q4_1 and Q8_0 hold float16 scales): the
    same bits, fewer bytes a step streams."""
    from onnx import helper

    from ..kernels import q41 as op

    offset = enc.offset if enc.form == Q41 else None
    if enc.form == Q41 and offset is None:
        raise ValueError(f"{node.name}: a q41 encoding carries its blocks' minima")
    half = op.fits_float16(enc.scales) and (offset is None or op.fits_float16(offset))
    packed, d, m = op.pack(enc.q, enc.scales, offset, bits=enc.bits, scale_dtype=np.float16 if half else np.float32)
    n, k = enc.q.shape[0], enc.q.shape[1] * enc.block
    tag = ".q41" if enc.bits == 4 else f".q{enc.bits}op"
    ins = [node.input[0], q.add_init(packed, prefix + tag), q.add_init(d, prefix + tag + "_d")]
    ins.append(q.add_init(m, prefix + tag + "_m") if m is not None else "")
    q.operators.add(op.DOMAIN)
    attrs = {"K": k, "N": n} | ({"bits": enc.bits} if enc.bits != 4 else {})
    return helper.make_node(op.OP, ins, list(node.output), name=node.name + "Q41", domain=op.DOMAIN, **attrs)


def _fusion_key(q: _Quantizing, member: tuple) -> object:
    """Siblings (on one input) with equal keys become one node (``_fused_nbits``): those carried
    with an offset term or in our operator's minimum form, by form, width and block; centred
    blocks our operator runs (Gemma's Q5_0 q/k/v and gate/up, Q8_0 siblings), by width and block;
    any other weight is a key of its own."""
    nd, enc = member[0], member[1]
    if enc.offset is not None:
        return (enc.form, enc.bits, enc.block)
    if _op_form(q, enc):
        return ("centred", enc.bits, enc.block)
    return id(nd)


def _fused_nbits(q: _Quantizing, members: list[tuple]) -> list:
    """Siblings on one input, each carried with an offset term (or in our operator, ``_fusion_key``),
    as ONE node over their columns concatenated along N (MatMulNBits with one offset MatMul and
    one Add, or one Q41MatMul), then a Split into their outputs: per column the same arithmetic
    as apart (either kernel's columns are its own), a third of the nodes (node dispatch, not
    arithmetic, is what a one-row step pays for them)."""
    from onnx import helper

    nds, encs, prefixes = zip(*members)
    scope = nds[0].name.rsplit("/", 2)[0]
    name = scope + "/" + "_".join(nd.name.rsplit("/", 2)[-2] for nd in nds)
    scope_p = prefixes[0].rpartition(".")[0]
    prefix = (scope_p + "." if scope_p else "") + "_".join(p.rpartition(".")[2] for p in prefixes)
    enc = Encoded(
        encs[0].bits,
        np.concatenate([e.q for e in encs]),
        np.concatenate([e.scales for e in encs]),
        None,
        "",
        None if encs[0].offset is None else np.concatenate([e.offset for e in encs]),
        form=encs[0].form,
    )
    fused = helper.make_node("MatMul", [nds[0].input[0], "-"], [prefix + ".fused"], name=name + "/MatMul")
    sizes = q.add_init(np.array([e.q.shape[0] for e in encs], np.int64), prefix + ".split")
    split = helper.make_node(
        "Split", [fused.output[0], sizes], [nd.output[0] for nd in nds], axis=-1, name=name + "/Split"
    )
    return _matmul_nbits(q, fused, enc, prefix) + [split]


def _quantize_embedding(q: _Quantizing, emb, lm) -> bool:
    """The embedding Gather as GatherBlockQuantized over an 8-bit table; a tied lm-head (reading
    that table through a Transpose) as MatMulNBits over the same table. Returns whether it was tied."""
    from onnx import helper

    plan, inits, report = q.plan, q.inits, q.report
    lm_w = lm.input[1]
    table_name = emb.input[0]
    if table_name not in inits:
        raise ExportError(f"{EMBED_NODE} does not read a constant table")
    table = inits.array(table_name)
    q.hidden = int(table.shape[1])
    lm_tied = (
        lm_w not in inits
        and lm_w in q.producers
        and q.producers[lm_w].op_type == "Transpose"
        and q.producers[lm_w].input[0] == table_name
    )
    eb = plan.lm_head_bits if lm_tied else plan.embed_bits
    eblock = fit_block(table.shape[1], plan.lm_head_block if lm_tied else min(plan.body_block, BLOCK))
    if eb != 8 or eblock is None:
        raise ExportError("embedding tables are quantized at 8 bits in blocks of 16..128 dividing the hidden size")
    if lm_tied:  # the lm-head's table: its block measured on this machine
        enc = _head_encoding(q, table)
    else:  # a gather reads rows whole: any block keeps them exact
        enc = _encode(q, table, 8, eblock)
        if enc.bits != 8 or enc.zp is not None or enc.offset is not None or enc.block != eblock:
            enc = _quantize_rows(table, 8, eblock, symmetric=True)  # a 4-bit or Q6_K table: 8 bits
    eblock = enc.block
    n, k = table.shape
    data_name = q.add_init(enc.q.reshape(table.shape), "model.embed_tokens.q8")
    s_name = q.add_init(enc.scales, "model.embed_tokens.q8_scales")
    q.fp_bytes += table.nbytes
    report["nodes"][EMBED_NODE] = f"float32 {list(table.shape)} --> {enc.note}"
    head = _q41_node(q, lm, enc, "lm_head") if lm_tied and _op_form(q, enc) else None
    note = enc.note
    del table, enc
    q.replaced[id(emb)] = [
        helper.make_node(
            "GatherBlockQuantized",
            [data_name, emb.input[1], s_name],
            list(emb.output),
            name=EMBED_NODE + "BlockQuantized",
            domain=MS,
            bits=8,
            block_size=eblock,
            gather_axis=0,
            quantize_axis=1,
        )
    ]
    if lm_tied and head is not None:  # the lm-head in our operator: its own copy, in its layout
        q.replaced[id(lm)] = [head]
        q.drop_nodes.add(id(q.producers[lm_w]))
        report["nodes"][LM_HEAD_NODE] = (
            f"tied to the embedding table --> {note} in our operator (its own copy of the table; "
            f"{report['lm_head_block']['why']})"
        )
    elif lm_tied:
        q.replaced[id(lm)] = _matmul_nbits(q, lm, None, "lm_head", shared=_SharedTable(data_name, s_name, eblock, n, k))
        q.drop_nodes.add(id(q.producers[lm_w]))
        report["nodes"][LM_HEAD_NODE] = (
            f"tied to the embedding table --> q8 bs{eblock} (one shared table; {report['lm_head_block']['why']})"
        )
    return lm_tied


def _const_source(q: _Quantizing, nd) -> tuple[str, bool] | None:
    """(initializer, read through a Transpose) of a MatMul's constant 2D weight: directly, or
    through a Transpose of an initializer (a tied lm-head whose embedding lives outside the
    graph, in inputs_embeds decoders)."""
    x = nd.input[1]
    if x in q.inits and len(q.inits.dims(x)) == 2:
        return x, False
    t = q.producers.get(x)
    if t is not None and t.op_type == "Transpose" and t.input[0] in q.inits and len(q.inits.dims(t.input[0])) == 2:
        return t.input[0], True
    return None


def _group_body_block(q: _Quantizing, members: list) -> int | None:
    """The block of one input's body projections (siblings fuse only at one block): blocks of 32
    (the GGUF's) where the plan asks no more or where they read a vector wider than the residual
    stream, else ``choose_body_block`` at their summed width, recorded in the report once per
    signature.

    Why not wider everywhere: MLAS's 8-bit kernels (accuracy_level 4) round the activations to int8
    per weight block too, and the MLP's down projection reads SiLU(gate) * up, whose outliers a wide
    block's one scale flattens: SmolLM2-135M's quality gate gave top-1 0.957, KL 0.0060 with every
    body block at 64, 0.970 / 0.0053 with the down projection's at 32 (0.973 / 0.0040 all at 32)."""
    plan = q.plan
    body = [src_ for nd, src_ in members if nd.name != LM_HEAD_NODE]
    if not body:
        return None
    dims = [q.inits.dims(w)[::-1] if t else q.inits.dims(w) for w, t in body]  # [K, N] each
    kk = dims[0][0]  # siblings read one input: one K
    if plan.body_block <= BLOCK or (q.hidden is not None and kk > q.hidden):
        return fit_block(kk, min(plan.body_block, BLOCK))
    n = sum(d[1] for d in dims)
    zp = not _symmetric(q, plan.body_bits)
    block, why = choose_body_block(plan.body_bits, kk, n, plan.body_block, plan.accuracy_level, zero_points=zp)
    sig = f"MatMulNBits bits={plan.body_bits} acc={plan.accuracy_level} K={kk} N={n}"
    if sig not in q.report.setdefault("body_blocks", {}):
        q.report["body_blocks"][sig] = {"block": block, "why": why}
        logger.info("  body %s: %s", sig, why)
    return block


def _quantize_matmuls(q: _Quantizing, graph_nodes: list) -> None:
    """Every other MatMul with a constant weight (lm-head untied included), one weight in memory at
    a time; siblings reading one input (q/k/v, gate/up) are encoded together, so that those carried
    with an offset term can be fused (_fused_nbits)."""
    plan, report = q.plan, q.report
    todo = [
        (nd, src_)
        for nd in graph_nodes
        if nd.op_type == "MatMul"
        and id(nd) not in q.replaced
        and len(nd.input) == 2
        and (src_ := _const_source(q, nd)) is not None
    ]
    siblings: dict[str, list] = {}
    for nd, src_ in todo:
        siblings.setdefault(nd.input[0], []).append((nd, src_))
    bar = progress(iter(()), desc="quantize", total=len(todo))
    for members in siblings.values():
        encoded = []
        body_block = _group_body_block(q, members)
        for nd, (w_name, transposed) in members:
            is_head = nd.name == LM_HEAD_NODE
            bits = plan.lm_head_bits if is_head else plan.body_bits
            dims = list(q.inits.dims(w_name))
            k = dims[1] if transposed else dims[0]
            block = fit_block(k, plan.lm_head_block) if is_head else body_block
            if block is None:
                report["nodes"][nd.name] = f"float32 {dims} kept (no block size divides K)"
                continue
            w = q.inits.array(w_name)
            if transposed:
                q.drop_nodes.add(id(q.producers[nd.input[1]]))
                w = w.T
            q.fp_bytes += w.nbytes
            enc = _head_encoding(q, w.T) if is_head and bits == 8 else _encode(q, w.T, bits, block)
            del w
            encoded.append((nd, enc, nd.input[1].removesuffix(".weight_T") or nd.name))
            note = enc.note or f"q{enc.bits} bs{enc.block}"
            report["nodes"][nd.name] = f"float32 {[k, dims[0] if transposed else dims[1]]} --> {note}"
            logger.debug("  %s: float32 %s --> %s", nd.name, dims, note)
            if hasattr(bar, "update"):
                bar.update(1)
        kinds: dict = {}
        for m in encoded:
            kinds.setdefault(_fusion_key(q, m), []).append(m)
        for group in kinds.values():
            if len(group) > 1:
                q.replaced[id(group[0][0])] = _fused_nbits(q, group)
                for nd, _, _ in group[1:]:
                    q.replaced[id(nd)] = []
            else:
                q.replaced[id(group[0][0])] = _matmul_nbits(q, *group[0])
    if hasattr(bar, "close"):
        bar.close()
