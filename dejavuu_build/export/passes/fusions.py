"""Fusions the in-place KV flavours run first: sibling projections of one input (q/k/v, gate/up)
as one wider MatMul or MatMulNBits + Split, and RMSNormalization(Add) as one
SkipSimplifiedLayerNormalization. Why: a one- or two-row forward pays per node (dispatch, thread
pool), not per FLOP, so fewer nodes decode faster with the same arithmetic per column."""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from .common import MS_DOMAIN, drop, initializer


def fuse_siblings(g) -> None:
    """Fuse MatMuls (or MatMulNBits) that share their input into one wider MatMul + Split.

    One kernel over the concatenated weights does the same arithmetic per output column; what it
    saves is the per-node dispatch and thread-pool cost that dominates a 2-row forward."""
    import onnx_ir as ir

    groups: dict[tuple, list] = defaultdict(list)
    for nd in g:
        if nd.op_type == "MatMulNBits" and nd.domain == MS_DOMAIN:
            if len(nd.inputs) > 4 or any(x is not None and x.const_value is None for x in nd.inputs[1:]):
                continue
            a = {k: v.value for k, v in nd.attributes.items() if k != "N"}
            # zero points (uint8 levels or float), like weights and scales, are rows per output
            # column: concatenated along N with them, but only between nodes of the same kinds
            groups[
                (
                    "nbits",
                    nd.inputs[0].name,
                    tuple(sorted(a.items())),
                    tuple(None if x is None else str(x.const_value.dtype) for x in nd.inputs[1:]),
                )
            ].append(nd)
        elif (
            nd.op_type == "MatMul" and nd.inputs[1].const_value is not None and len(nd.inputs[1].const_value.shape) == 2
        ):
            groups[("matmul", nd.inputs[0].name, nd.inputs[1].const_value.shape[0])].append(nd)
    for key, nodes in groups.items():
        if len(nodes) < 2:
            continue
        nodes.sort(key=lambda n: _order(n.name))
        anchor = nodes[0]
        name = anchor.name.rsplit("/", 2)[0] + "/" + "_".join(n.name.rsplit("/", 2)[-2] for n in nodes)
        if key[0] == "nbits":
            ns = [int(n.attributes["N"].value) for n in nodes]
            ws: list = []  # the fused inputs (onnx_ir values; None for an absent optional input)
            for j in range(1, len(nodes[0].inputs)):
                if nodes[0].inputs[j] is None:
                    ws.append(None)
                    continue
                arr = np.concatenate([n.inputs[j].const_value.numpy() for n in nodes], axis=0)
                ws.append(initializer(g, f"{name}.w{j}", arr))
            attrs = {k: v.value for k, v in anchor.attributes.items()}
            attrs["N"] = int(sum(ns))
            fused = ir.node(
                "MatMulNBits", [anchor.inputs[0], *ws], attributes=attrs, domain=MS_DOMAIN, name=f"{name}/MatMulNBits"
            )
        else:
            arrs = [n.inputs[1].const_value.numpy() for n in nodes]
            ns = [a.shape[1] for a in arrs]
            arr = np.concatenate(arrs, axis=1)
            fused = ir.node(
                "MatMul", [anchor.inputs[0], initializer(g, f"{name}.weight_T", arr)], name=f"{name}/MatMul"
            )
        g.insert_before(anchor, fused)
        sizes = initializer(g, f"{name}.split", np.array(ns, np.int64))
        split = ir.node(
            "Split", [fused.outputs[0], sizes], attributes={"axis": -1}, num_outputs=len(nodes), name=f"{name}/Split"
        )
        g.insert_before(anchor, split)
        for n, o in zip(nodes, split.outputs):
            o.name = n.outputs[0].name + "_fused"
            o.shape, o.type = n.outputs[0].shape, n.outputs[0].type
            n.outputs[0].replace_all_uses_with(o)
        drop(g, nodes)


def fuse_skip_norm(g) -> None:
    """``RMSNormalization(Add(a, b))`` -> ``SkipSimplifiedLayerNormalization(a, b)``, whose extra
    output is the residual sum the next layer adds to: one kernel and one pass over the row
    instead of two (what onnxruntime-genai's graphs use; ORT's own fusion does not match the
    ONNX-standard RMSNormalization)."""
    import onnx_ir as ir

    for nd in list(g):
        if nd.op_type != "RMSNormalization" or nd.domain not in ("", "ai.onnx") or len(nd.inputs) < 2:
            continue
        add = nd.inputs[0].producer()
        axis = nd.attributes["axis"].value if "axis" in nd.attributes else -1
        if add is None or add.op_type != "Add" or axis != -1 or nd.inputs[1].const_value is None:
            continue
        a, b = add.inputs
        if (
            a is None
            or b is None
            or a.const_value is not None
            or b.const_value is not None
            or a.shape is None
            or b.shape is None
            or list(a.shape) != list(b.shape)
        ):
            continue
        eps = float(nd.attributes["epsilon"].value) if "epsilon" in nd.attributes else 1e-5
        fused = ir.node(
            "SkipSimplifiedLayerNormalization",
            [a, b, nd.inputs[1]],
            attributes={"epsilon": eps},
            domain=MS_DOMAIN,
            num_outputs=4,
            name=nd.name.rsplit("/", 1)[0] + "/SkipSimplifiedLayerNorm",
        )
        g.insert_before(add, fused)
        y, _, _, total = fused.outputs
        y.name, total.name = nd.outputs[0].name + "_skipnorm", add.outputs[0].name + "_skipsum"
        y.shape = total.shape = add.outputs[0].shape
        y.type = total.type = add.outputs[0].type
        outs = set(g.outputs)
        for old, new_v in ((nd.outputs[0], y), (add.outputs[0], total)):
            name, was_output = old.name, old in outs
            old.replace_all_uses_with(new_v, replace_graph_outputs=True)
            if was_output:  # keep graph output names (hidden_states)
                old.name, new_v.name = name + "__unfused", name
        drop(g, [nd, add])


_PROJ_ORDER = {"q_proj": 0, "k_proj": 1, "v_proj": 2, "gate_proj": 0, "up_proj": 1}


def _order(name: str) -> tuple:
    parts = name.split("/")
    return (_PROJ_ORDER.get(parts[-2] if len(parts) > 1 else "", 9), name)
