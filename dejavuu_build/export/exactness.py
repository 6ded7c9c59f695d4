"""Per-op row invariance, measured on this machine: which ops give a row different bits when it is
computed alone than when it is computed among other rows.

Lossless speculative decoding needs a token's logits bit-identical whether the token is decoded
alone (one graph row) or verified among drafted rows. Whether that holds is a property of each
kernel on each instruction set (onnxruntime 1.32, measured: 4-bit ``MatMulNBits`` with int8
activations and blocks of 32 computes a lone row on AVX2 with another micro-kernel than rows in
pairs; on AVX-512 VNNI it does not). So nothing is assumed: each op of a decoder is cut out with
its own weights, fed random rows, and a row's output is compared bit for bit computed (a) among
2..17 rows, (b) alone, (c) beside one zero pad row. An op is

* ``invariant``: (a) == (b) == (c) for every row: it costs nothing to keep exact;
* ``guardable``: (a) == (c) but not (b): exact as soon as it never runs one row, which
  ``passes.row_guard`` ensures inside the graph (a pad row for that op only);
* ``variant``: rows differ among multi-row forwards too: no graph of this shape is exact.

Attention is probed with the semantics of its flavour: concat (a lone row sees only the keys
before it) or rowwise (query rows folded into heads over one bound buffer).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable

import numpy as np

from .. import schema as S
from ..machine import describe, machine

# what _compare takes for one op: run(feeds), make_rows(m, full=None), split_row(feeds, r), pad_row(feeds)
ProbeFns = tuple[Callable, Callable, Callable, Callable]

ROWS = (2, 3, 5, 8, 17)  # the multi-row forwards each row is compared across
# Attention's pasts: rows of a step at past p see p+1 .. p+17 keys, so each of these crosses an
# edge where onnxruntime's kernels may change how they group keys or the head (export.passes.
# key_floor): MLAS's SGEMM K stride changes at 16, 32 and 64 keys (8, 24, 56, 60), the probs·V
# product is chunked by 128 keys (120, 250, 1010 cross 128, 256, 1024); 40 crosses none.
ATTENTION_PASTS = (8, 24, 40, 56, 60, 120, 250, 1010)
NORMS = (
    "SkipSimplifiedLayerNormalization",
    "SimplifiedLayerNormalization",
    "RMSNormalization",
    "LayerNormalization",
    "SkipLayerNormalization",
)
MS = "com.microsoft"


@dataclass
class OpProbe:
    """What one op (one node, standing for every node of its signature) does to a row's bits."""

    signature: str  # "MatMulNBits bits=4 block=32 acc=4 K=576 N=960"
    op: str
    nodes: list[str]  # every node of this signature, in graph order
    first_index: int  # topological index of the first of them
    rows: int = 0  # rows compared
    equal_alone: int = 0  # ... equal to the row computed alone
    equal_padded: int = 0  # ... equal to the row computed beside one pad row
    maxdiff_alone: float = 0.0
    maxdiff_padded: float = 0.0
    note: str = ""

    @property
    def verdict(self) -> str:
        if not self.rows:
            return "not probed"
        if self.equal_padded < self.rows:
            return "variant"
        return "invariant" if self.equal_alone == self.rows else "guardable"

    def to_json(self) -> dict:
        return {**asdict(self), "verdict": self.verdict}


@dataclass
class ExactnessReport:
    machine: dict
    probes: list[OpProbe] = field(default_factory=list)

    @property
    def first_break(self) -> OpProbe | None:
        """The op earliest in the graph whose lone row differs (what breaks a one-row step first)."""
        bad = [p for p in self.probes if p.verdict in ("guardable", "variant")]
        return min(bad, key=lambda p: p.first_index) if bad else None

    def guard_nodes(self) -> list[str]:
        return [n for p in self.probes if p.verdict == "guardable" for n in p.nodes]

    def to_json(self) -> dict:
        fb = self.first_break
        return {
            "machine": self.machine,
            "first_break": fb.signature if fb else None,
            "probes": [p.to_json() for p in self.probes],
        }


def _session(model, threads: int):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _single_node(model, node, feeds: list[str]):
    """A model of ``node`` alone with its constant inputs (initializers, or values computed from
    initializers only, e.g. the tied lm-head's view of the embedding table); ``feeds`` become
    graph inputs."""
    from onnx import helper

    inits = {t.name: t for t in model.graph.initializer}
    producers = {o: n for n in model.graph.node for o in n.output}
    nodes, consts, seen = [], [], set()

    def need(v: str) -> None:
        if not v or v in seen or v in feeds:
            return
        seen.add(v)
        if v in inits:
            consts.append(inits[v])
        elif v in producers:
            p = producers[v]
            for x in p.input:
                need(x)
            if p not in nodes:
                nodes.append(p)

    for x in node.input:
        need(x)
    ins = [helper.make_value_info(n, helper.make_tensor_type_proto(1, None)) for n in feeds]
    outs = [helper.make_value_info(node.output[0], helper.make_tensor_type_proto(1, None))]
    g = helper.make_graph(nodes + [node], "probe", ins, outs, consts)
    return helper.make_model(g, opset_imports=list(model.opset_import), ir_version=model.ir_version)


def constant_values(model) -> set[str]:
    """Values that depend on initializers only (never on a graph input): what has no row axis of
    its own (the probe feeds the rest; the row guard never pads it)."""
    const = {t.name for t in model.graph.initializer}
    for n in model.graph.node:  # graph order is topological
        if n.input and all((not x) or x in const for x in n.input) or (not n.input and n.op_type == "Constant"):
            const.update(n.output)
    return const


def _attr(node, name, default=None):
    from onnx import helper

    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _compare(p: OpProbe, run, make_rows, split_row, pad_row) -> None:
    """Fill ``p`` with row comparisons: ``make_rows(M)`` gives feeds for M rows, ``split_row(feeds,
    r)`` the feeds of row r alone, ``pad_row(feeds)`` those feeds beside one zero pad row; ``run``
    returns the output as [rows, ...]."""
    full = make_rows(max(ROWS))
    ref = run(full)  # each row among 17
    alone = [run(split_row(full, r))[0] for r in range(max(ROWS))]
    padded = [run(pad_row(split_row(full, r)))[0] for r in range(max(ROWS))]
    for m in ROWS:
        out = ref if m == max(ROWS) else run(make_rows(m, full))
        for r in range(m):
            da, dp = np.abs(out[r] - alone[r]).max(), np.abs(out[r] - padded[r]).max()
            p.rows += 1
            p.equal_alone += int(da == 0)
            p.equal_padded += int(dp == 0)
            p.maxdiff_alone, p.maxdiff_padded = max(p.maxdiff_alone, float(da)), max(p.maxdiff_padded, float(dp))


def _row_op(model, node, threads: int, rng, head_dim: int) -> tuple[ProbeFns | None, str]:
    """Run / feed builders for row-wise ops: rank-3 activations [1, R, width] (rows on axis 1), and
    RotaryEmbedding's [1, heads, R, head_dim] with cos/sin [1, R, head_dim/2]."""
    const = constant_values(model)
    feeds = [i for i in node.input if i and i not in const]
    if not feeds:
        return None, "no activation input"
    R = max(ROWS)
    shapes = {t.name: list(t.dims) for t in model.graph.initializer}
    if node.op_type == "MatMulNBits":
        specs = {feeds[0]: ([1, R, int(_attr(node, "K"))], 1)}
    elif node.op_type == "RotaryEmbedding":
        if len(feeds) != 3 or not head_dim:
            return None, "RotaryEmbedding with a position input or unknown head size: not probed"
        specs = {
            feeds[0]: ([1, 2, R, head_dim], 2),
            feeds[1]: ([1, R, head_dim // 2], 1),
            feeds[2]: ([1, R, head_dim // 2], 1),
        }
    else:
        w = next((shapes[i] for i in node.input if i in shapes), None)
        if w is None:
            return None, "no constant weight"
        specs = {f: ([1, R, w[0] if node.op_type == "MatMul" else w[-1]], 1) for f in feeds}
    if set(specs) != set(feeds):
        return None, f"inputs {feeds} not understood"
    s = _session(_single_node(model, node, feeds), threads)
    data = {f: rng.standard_normal(shape).astype(np.float32) for f, (shape, _) in specs.items()}
    ax = {f: a for f, (_, a) in specs.items()}
    out_axis = 2 if node.op_type == "RotaryEmbedding" else 1

    def take(v, a, sl):
        return v[(slice(None),) * a + (sl,)]

    def run(fd):
        return np.moveaxis(s.run(None, fd)[0], out_axis, 0)

    return (
        run,
        lambda m, full=None: {f: take(v, ax[f], slice(0, m)) for f, v in data.items()},
        lambda fd, r: {f: take(v, ax[f], slice(r, r + 1)) for f, v in fd.items()},
        lambda fd: {f: np.concatenate([v, np.zeros_like(v)], ax[f]) for f, v in fd.items()},
    ), ""


def _attention(model, node, threads: int, rng, layout: str, heads: int, past: int) -> tuple[ProbeFns | None, str]:
    """ONNX Attention over a past of ``past`` keys, with the flavour's row semantics."""
    from ..runtime.tree import NEG
    from .passes.key_floor import unfloored_inputs

    if len(node.input) < 4 or not node.input[3]:
        return None, "no mask input"
    feeds = unfloored_inputs(model, node)  # the node with its key floor, if the graph has one
    s = _session(_single_node(model, node, feeds), threads)
    q, k, v, mask = feeds
    R = max(ROWS)
    kv_heads, dim = _kv_shape(model, node)
    if not kv_heads:
        return None, "K/V shape unknown"
    if layout == S.KV_ROWWISE:
        L = -(-(past + R) // 64) * 64  # the runtime's buffer: whole tiles of 64
        K = rng.standard_normal((1, kv_heads, L, dim)).astype(np.float32)
        V = rng.standard_normal((1, kv_heads, L, dim)).astype(np.float32)
        Q = rng.standard_normal((1, heads, R, dim)).astype(np.float32) * 0.125

        def feeds_for(rows: list[int]):
            n = len(rows)
            m = np.full((1, heads, n, L), NEG, np.float32)
            for i, r in enumerate(rows):
                m[..., i, : past + r + 1 if r >= 0 else past + 1] = 0  # a pad row attends the past
            qq = (
                Q[:, :, [max(r, 0) for r in rows]]
                * np.array([1.0 if r >= 0 else 0.0 for r in rows], np.float32)[None, None, :, None]
            )
            return {q: qq.reshape(1, heads * n, 1, dim), k: K, v: V, mask: m.reshape(1, heads * n, 1, L)}

        def run(fd):
            n = fd[q].shape[1] // heads
            return s.run(None, fd)[0].reshape(heads, n, dim).transpose(1, 0, 2)
    else:
        K = rng.standard_normal((1, kv_heads, past + R, dim)).astype(np.float32)
        V = rng.standard_normal((1, kv_heads, past + R, dim)).astype(np.float32)
        Q = rng.standard_normal((1, heads, R, dim)).astype(np.float32)

        def feeds_for(rows: list[int]):
            last = max(rows) + 1  # a step sees the keys up to its last row
            m = np.full((1, 1, len(rows), past + last), NEG, np.float32)
            for i, r in enumerate(rows):
                if r >= 0:
                    m[0, 0, i, : past + r + 1] = 0
                else:
                    m[0, 0, i] = 0
            qq = np.concatenate([Q[:, :, [r]] if r >= 0 else np.zeros_like(Q[:, :, :1]) for r in rows], 2)
            return {q: qq, k: K[:, :, : past + last], v: V[:, :, : past + last], mask: m}

        def run(fd):
            return s.run(None, fd)[0][0].transpose(1, 0, 2)

    def make_rows(m, full=None):
        fd = feeds_for(list(range(m)))
        fd["_rows"] = list(range(m))
        return fd

    def split_row(fd, r):
        return {**feeds_for([r]), "_rows": [r]}

    def pad_row(fd):
        return {**feeds_for(fd["_rows"] + [-1]), "_rows": fd["_rows"] + [-1]}

    def run_(fd):
        return run({a: b for a, b in fd.items() if a != "_rows"})

    return (run_, make_rows, split_row, pad_row), ""


def _kv_shape(model, node) -> tuple[int, int]:
    """(kv heads, head dim) of ``node``'s K input, from the graph inputs it comes from."""
    by_name = {vi.name: vi for vi in list(model.graph.input) + list(model.graph.value_info)}
    producers = {o: n for n in model.graph.node for o in n.output}
    name = node.input[1]
    for _ in range(4):
        vi = by_name.get(name)
        if vi is not None and len(vi.type.tensor_type.shape.dim) == 4:
            d = vi.type.tensor_type.shape.dim
            if d[1].dim_value and d[3].dim_value:
                return d[1].dim_value, d[3].dim_value
        p = producers.get(name)
        if p is None or not p.input:
            break
        name = p.input[0]
    return 0, 0


def _signature(model, node) -> str | None:
    op = node.op_type
    if op == "MatMulNBits":
        has_zp = len(node.input) > 3 and bool(node.input[3])
        return (
            f"MatMulNBits bits={_attr(node, 'bits', 4)} block={_attr(node, 'block_size')} "
            f"acc={_attr(node, 'accuracy_level', 0)}{' zp' if has_zp else ''} K={_attr(node, 'K')} N={_attr(node, 'N')}"
        )
    inits = {t.name: list(t.dims) for t in model.graph.initializer}
    if op == "MatMul" and len(node.input) == 2 and node.input[1] in inits and len(inits[node.input[1]]) == 2:
        k, n = inits[node.input[1]]
        return f"MatMul fp32 K={k} N={n}"
    if op in NORMS:
        w = next((inits[i] for i in node.input if i in inits), None)
        return f"{op} H={w[-1]}" if w else None
    if op == "Attention" and node.domain in ("", "ai.onnx"):
        return "Attention"
    if op == "RotaryEmbedding":
        return f"RotaryEmbedding interleaved={_attr(node, 'interleaved', 0)}"
    return None


def probe(
    model,
    *,
    layout: str = S.KV_CONCAT,
    heads: int = 0,
    head_dim: int = 0,
    threads: int = S.DEFAULT_THREADS,
    pasts: tuple[int, ...] = ATTENTION_PASTS,
    seed: int = 0,
) -> ExactnessReport:
    """Probe every op signature of ``model`` (an onnx ModelProto of one of our decoders)."""
    rng = np.random.default_rng(seed)
    groups: dict[str, OpProbe] = {}
    for i, node in enumerate(model.graph.node):
        sig = _signature(model, node)
        if sig is None:
            continue
        p = groups.setdefault(sig, OpProbe(sig, node.op_type, [], i))
        p.nodes.append(node.name)
    rep = ExactnessReport(machine())
    nodes = {n.name: n for n in model.graph.node}
    for p in sorted(groups.values(), key=lambda p: p.first_index):
        node = nodes[p.nodes[0]]
        if p.op == "Attention":
            if not heads:
                p.note = "query heads unknown"
            for past in pasts:
                fns, why = _attention(model, node, threads, rng, layout, heads, past) if heads else (None, "")
                if fns is None:
                    p.note = p.note or why
                    break
                _compare(p, *fns)
            if p.rows:
                p.note = f"{layout} semantics, pasts {', '.join(map(str, pasts))}"
        else:
            fns, why = _row_op(model, node, threads, rng, head_dim)
            if fns is None:
                p.note = why
            else:
                _compare(p, *fns)
        rep.probes.append(p)
    return rep


def format_report(rep: ExactnessReport, title: str) -> list[str]:
    m = rep.machine
    lines = [
        f"{title}: row invariance per op, {describe(m)}",
        f"  {'op':<58} {'nodes':>5} {'alone':>9} {'padded':>9}  verdict",
    ]
    for p in rep.probes:
        lines.append(
            f"  {p.signature:<58} {len(p.nodes):>5} {p.equal_alone:>4}/{p.rows:<4} "
            f"{p.equal_padded:>4}/{p.rows:<4} {p.verdict}{'  (' + p.note + ')' if p.note else ''}"
        )
    fb = rep.first_break
    lines.append(
        f"  first op whose lone row differs: {fb.signature} ({fb.nodes[0]}), {fb.verdict}"
        if fb
        else "  every probed op gives a row the same bits alone and among others"
    )
    return lines
