"""The row guard: a lone row never reaches an op whose one-row kernel differs from its multi-row one.

``export.exactness`` measures, per op, whether a row computed alone gets other bits than among
several rows while every multi-row forward agrees ("guardable"). For exactly those nodes this pass
gives the forward a zero pad row (only when it has one row), keeps that row through the row-local
ops that follow (norms, elementwise ops, the small offset products of a GGUF carry) and cuts it
off where an op needs the forward's own rows (attention, reshapes, the lm-head, graph outputs), so
a one-token step and a verify step run the same kernels, and nowhere else does the graph pay for
it: on a decoder, one Pad and one Slice per layer around attention (measured on AVX2 with the
one-step timings: docs/exactness.md). ONNX ``Attention`` of the concat flavour, where guardable,
is padded around that node only (its rows lie on another axis).

Why by hand: no optimizer pads an op's rows conditionally. Names are deterministic: a value's
padded twin is ``<value>/row_guard/padded``, made by ``<node>/row_guard/Pad_<i>`` and cut back by
``<value>/row_guard/rows``; ``strip_row_guard`` undoes both this and the older per-node form.
"""

from __future__ import annotations

import json

import numpy as np

from ... import schema as S
from ...errors import ExportError
from ..exactness import constant_values

# op -> (row-shaped inputs, row axis); the op's first output is row-shaped along the same axis
ROW_INPUTS = {"MatMulNBits": ((0,), 1), "MatMul": ((0,), 1), "Attention": ((0, 3), 2)}

# ops whose output row r depends on input row r only (rows on axis 1 of [batch, rows, ...]): a
# guarded op's padded rows flow on through them, so the graph pads once per run of such ops
# instead of around every guarded node. Row-local is not enough: each must also give a row the
# same bits among two rows as among more, which the probe measures for MatMul and the norms
# (``invariant``); elementwise kernels compute each element alone. The batched gate checks the
# whole graph afterwards either way.
ROW_LOCAL = {
    *("Add", "Sub", "Mul", "Div"),
    *("Sigmoid", "Tanh", "Relu", "Neg", "Erf", "Softplus", "QuickGelu", "Gelu", "FastGelu", "Cast"),
    *("SkipSimplifiedLayerNormalization", "SimplifiedLayerNormalization", "RMSNormalization"),
    *("LayerNormalization", "SkipLayerNormalization"),
    *("Split", "MatMul", "MatMulNBits"),
}
# a matrix product that is not guarded runs two rows only when it is this small (the block sums
# and offset terms of an exact GGUF carry): a second row of a large one (the lm-head) costs time
SMALL_PRODUCT = 1 << 20
PADDED = "/row_guard/padded"  # a value's padded twin is named <value>/row_guard/padded


def guard_rows(model, nodes: list[str], *, length_invariant: bool, record: dict | None = None):
    """``model`` (onnx ModelProto) with ``nodes`` guarded: each sees at least two rows. The graph's
    metadata (schema.ROW_GUARD_KEY) records ``length_invariant`` (every op of the graph, guarded or
    not, gives a row the same bits whatever the row count) and ``record`` (what was measured).

    A guarded node's padded output stays padded through the row-local ops after it (ROW_LOCAL) and
    is cut back to the forward's rows only where an op needs them (attention, reshapes, the
    lm-head, graph outputs): on a decoder that is one Pad and one Slice per layer around attention
    instead of a pair around each projection."""
    from onnx import helper, numpy_helper

    g = model.graph
    todo = set(nodes)
    _record(model, {"length_invariant": bool(length_invariant), "nodes": len(todo), **(record or {})})
    if not todo:
        return model
    names = {n.name for n in g.node}
    if todo - names:
        raise ExportError(f"row guard: no node {sorted(todo - names)[0]!r} in the graph")
    primary = next((i.name for i in g.input if i.name in (S.INPUT_IDS, S.INPUTS_EMBEDS)), None)
    if primary is None:
        raise ExportError("row guard: the graph has neither input_ids nor inputs_embeds")

    def const(name, arr):
        g.initializer.append(numpy_helper.from_array(np.asarray(arr), name))
        return name

    # rows = R (the forward's row count), pads = [0, max(2 - R, 0)]: computed once per graph
    head = [
        helper.make_node("Shape", [primary], ["/row_guard/R"], name="/row_guard/Shape", start=1, end=2),
        helper.make_node(
            "Sub",
            [const("row_guard.two", np.array([2], np.int64)), "/row_guard/R"],
            ["/row_guard/missing"],
            name="/row_guard/Sub",
        ),
        helper.make_node(
            "Max",
            ["/row_guard/missing", const("row_guard.zero", np.array([0], np.int64))],
            ["/row_guard/pad"],
            name="/row_guard/Max",
        ),
        helper.make_node(
            "Concat", ["row_guard.zero", "/row_guard/pad"], ["/row_guard/pads"], name="/row_guard/Concat", axis=0
        ),
    ]
    axes = {ax: const(f"row_guard.axis{ax}", np.array([ax], np.int64)) for ax in (1, 2)}
    constant = constant_values(model)
    dims = {t.name: list(t.dims) for t in g.initializer}
    run_padded_nodes = _padded_nodes(g, todo, primary, constant, dims)
    guarded_as = {n.name: ROW_INPUTS.get(n.op_type) for n in g.node if n.name in todo}
    for name, spec in guarded_as.items():
        if spec is None:
            op = next(n.op_type for n in g.node if n.name == name)
            raise ExportError(f"row guard: no row layout known for {op} ({name})")

    twin: dict[str, str] = {}  # value (rows on axis 1) -> its padded twin, once computed
    cut: set[str] = set()  # values whose producer now makes their twin: a Slice gives them back
    out_nodes: list = []
    produced_at: dict[str, int] = {}  # twin -> index in out_nodes after which its Slice may go
    slices: dict[int, list] = {}  # out_nodes index -> Slices to insert after it

    def padded(x: str, by: str, j: int) -> str:
        if x not in twin:
            y = x + PADDED
            out_nodes.append(
                helper.make_node("Pad", [x, "/row_guard/pads", "", axes[1]], [y], name=f"{by}/row_guard/Pad_{j}")
            )
            twin[x] = y
            produced_at[y] = len(out_nodes) - 1
        return twin[x]

    def unpadded(x: str) -> None:
        if x in cut:
            cut.discard(x)
            at = produced_at[twin[x]]
            slices.setdefault(at, []).append(
                helper.make_node(
                    "Slice",
                    [twin[x], "row_guard.zero", "/row_guard/R", axes[1]],
                    [x],
                    name=f"{x}/row_guard/rows",
                )
            )

    for node in g.node:
        spec = guarded_as.get(node.name)
        if spec is not None and spec[1] != 1:  # padded along another axis (attention): around this node only
            rows_in, ax = spec
            for x in node.input:
                unpadded(x)
            for j in rows_in:
                x = node.input[j]
                y = f"{node.name}/row_guard/pad_{j}"
                out_nodes.append(
                    helper.make_node(
                        "Pad", [x, "/row_guard/pads", "", axes[ax]], [y], name=f"{node.name}/row_guard/Pad_{j}"
                    )
                )
                node.input[j] = y
            y = node.output[0]
            node.output[0] = f"{node.name}/row_guard/out"
            out_nodes.append(node)
            out_nodes.append(
                helper.make_node(
                    "Slice",
                    [node.output[0], "row_guard.zero", "/row_guard/R", axes[ax]],
                    [y],
                    name=f"{node.name}/row_guard/rows",
                )
            )
            continue
        if spec is not None:
            row_in = [node.input[j] for j in spec[0]]
        else:
            row_in = [x for x in node.input if x and x not in constant]
        if spec is None and node.name not in run_padded_nodes:
            for x in node.input:
                unpadded(x)
            out_nodes.append(node)
            continue
        for x in node.input:
            if x in twin or x in row_in:
                continue
            unpadded(x)  # a non-row input (a shape, a weight computed at run time)
        for j, x in enumerate(node.input):
            if x in row_in:
                node.input[j] = padded(x, node.name, j)
        out_nodes.append(node)
        for k, y in enumerate(node.output):
            if y:
                node.output[k] = twin[y] = y + PADDED
                produced_at[twin[y]] = len(out_nodes) - 1
                cut.add(y)
    for o in g.output:
        unpadded(o.name)
    final = []
    for i, n in enumerate(out_nodes):
        final.append(n)
        final.extend(slices.get(i, []))
    del g.node[:]
    g.node.extend(head + final)
    return model


def _padded_nodes(g, guarded: set[str], primary: str, constant: set[str], dims: dict) -> set[str]:
    """The row-local nodes that run on the padded rows: every input that is not constant holds the
    forward's rows on axis 1 and at least one of them is padded. Rows: the embeddings of the input
    tokens, a guarded product's input and output, and what row-local ops compute from rows alone;
    padded: a guarded product's input and output, and what a padded node computes."""
    rows = {primary} if primary == S.INPUTS_EMBEDS else set()
    padded: set[str] = set()
    for n in g.node:
        if n.op_type in ("Gather", "GatherBlockQuantized") and len(n.input) > 1 and n.input[1] == primary:
            rows.add(n.output[0])
        if n.name in guarded and ROW_INPUTS.get(n.op_type, ((), 0))[1] == 1:
            rows.update((n.input[0], n.output[0]))
            padded.update((n.input[0], n.output[0]))
    nodes = set()
    for n in g.node:
        live = [x for x in n.input if x and x not in constant]
        if n.name not in guarded and live and all(x in rows for x in live) and _row_local(n, constant, dims):
            outs = [y for y in n.output if y]
            rows.update(outs)
            if any(x in padded for x in live):
                padded.update(outs)
                nodes.add(n.name)
    return nodes


def _row_local(node, constant: set[str], dims: dict) -> bool:
    """Whether ``node`` computes each row from the same row of its inputs (ROW_LOCAL, a Split
    along the last axis of a rank-3 value, a small product with a constant matrix)."""
    op = node.op_type
    if op not in ROW_LOCAL:
        return False
    if op == "Split":
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        return axis in (-1, 2)
    if op in ("MatMul", "MatMulNBits"):
        if op == "MatMulNBits":
            at = {a.name: a.i for a in node.attribute}
            size = at.get("K", 0) * at.get("N", 0)
        else:
            w = dims.get(node.input[1])
            if w is None or len(w) != 2:
                return False
            size = int(w[0]) * int(w[1])
        return all(x in constant for x in node.input[1:] if x) and 0 < size <= SMALL_PRODUCT
    return True


def _record(model, meta: dict) -> None:
    for p in list(model.metadata_props):
        if p.key == S.ROW_GUARD_KEY:
            model.metadata_props.remove(p)
    model.metadata_props.add(key=S.ROW_GUARD_KEY, value=json.dumps(meta, sort_keys=True))


def strip_row_guard(model):
    """``model`` as it was before ``guard_rows`` (the passes and the quantizer rewrite the unguarded
    graph; the guard is measured and applied last). A graph without a guard comes back unchanged."""
    g = model.graph
    for p in list(model.metadata_props):
        if p.key == S.ROW_GUARD_KEY:
            model.metadata_props.remove(p)
    if not any("row_guard/" in n.name for n in g.node):
        return model
    pads = {n.output[0]: n.input[0] for n in g.node if "/row_guard/Pad_" in n.name}
    pads.update({y: y[: -len(PADDED)] for n in g.node for y in [*n.input, *n.output] if y.endswith(PADDED)})
    cuts = {n.input[0]: n.output[0] for n in g.node if n.name.endswith("/row_guard/rows")}
    keep = [n for n in g.node if "row_guard/" not in n.name]
    for n in keep:
        for j, x in enumerate(n.input):
            while x in pads:  # a guard's Pad of a key floor's Pad (export.passes.key_floor)
                x = n.input[j] = pads[x]
        for j, y in enumerate(n.output):
            if y in cuts:
                n.output[j] = cuts[y]
            elif y in pads:
                n.output[j] = pads[y]
    del g.node[:]
    g.node.extend(keep)
    inits = [t for t in g.initializer if not t.name.startswith("row_guard.")]
    del g.initializer[:]
    g.initializer.extend(inits)
    return model
