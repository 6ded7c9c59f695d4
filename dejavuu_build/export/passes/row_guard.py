"""The row guard: a lone row never reaches an op whose one-row kernel differs from its multi-row one.

``export.exactness`` measures, per op, whether a row computed alone gets other bits than among
several rows while every multi-row forward agrees ("guardable"). For exactly those nodes this pass
pads the row inputs to at least two rows (one zero row, only when the forward has one) and cuts
the output back, so a one-token step and a verify step run the same kernel there, and nowhere
else does the graph pay for it. Measured on AVX2 (onnxruntime 1.32): 4-bit ``MatMulNBits`` with
int8 activations runs two rows in the time of one (its 2x4 micro-kernel), so the guard is free
there; ONNX ``Attention`` of the concat flavour takes its multi-row path for every step, which
makes that flavour exact in any runtime that feeds one row per step and knows nothing of us.

Why by hand: no optimizer pads an op's rows conditionally. Nodes are named after the node they
guard (``<node>/row_guard/pad_<i>``, ``<node>/row_guard/rows``), so the output is deterministic.
"""

from __future__ import annotations

import json

import numpy as np

from ... import schema as S
from ...errors import ExportError

# op -> (row-shaped inputs, row axis); the op's first output is row-shaped along the same axis
ROW_INPUTS = {"MatMulNBits": ((0,), 1), "MatMul": ((0,), 1), "Attention": ((0, 3), 2)}


def guard_rows(model, nodes: list[str], *, length_invariant: bool, record: dict | None = None):
    """``model`` (onnx ModelProto) with ``nodes`` guarded: each sees at least two rows. The graph's
    metadata (schema.ROW_GUARD_KEY) records ``length_invariant`` (every op of the graph, guarded or
    not, gives a row the same bits whatever the row count) and ``record`` (what was measured)."""
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
    padded: dict[tuple[str, int], str] = {}  # (value, axis) -> its padded twin (shared, e.g. a mask)
    out_nodes = []
    for node in g.node:
        if node.name not in todo:
            out_nodes.append(node)
            continue
        spec = ROW_INPUTS.get(node.op_type)
        if spec is None:
            raise ExportError(f"row guard: no row layout known for {node.op_type} ({node.name})")
        rows_in, ax = spec
        for j in rows_in:
            x = node.input[j]
            if (x, ax) not in padded:
                y = f"{node.name}/row_guard/pad_{j}"
                out_nodes.append(
                    helper.make_node(
                        "Pad", [x, "/row_guard/pads", "", axes[ax]], [y], name=f"{node.name}/row_guard/Pad_{j}"
                    )
                )
                padded[(x, ax)] = y
            node.input[j] = padded[(x, ax)]
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
    del g.node[:]
    g.node.extend(head + out_nodes)
    return model


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
    cuts = {n.input[0]: n.output[0] for n in g.node if n.name.endswith("/row_guard/rows")}
    keep = [n for n in g.node if "row_guard/" not in n.name]
    for n in keep:
        for j, x in enumerate(n.input):
            if x in pads:
                n.input[j] = pads[x]
        for j, y in enumerate(n.output):
            if y in cuts:
                n.output[j] = cuts[y]
    del g.node[:]
    g.node.extend(keep)
    inits = [t for t in g.initializer if not t.name.startswith("row_guard.")]
    del g.initializer[:]
    g.initializer.extend(inits)
    return model
