"""Graph-editing steps the in-place KV passes and the fusions share (onnx-ir graphs): node and
initializer insertion, dropping nodes, and the parts of an attention layer both KV rewrites replace
in the same way (the Concat(past, new) pair, the present outputs, the finished proto)."""

from __future__ import annotations

import numpy as np

from ... import schema as S
from ...errors import ExportError

MS_DOMAIN = "com.microsoft"


def insert(g, op: str, ins, name: str, anchor, attrs=None, domain: str = "", outs: int = 1):
    """A new node ``name`` inserted before ``anchor`` (the passes keep graph order, then re-sort)."""
    import onnx_ir as ir

    nd = ir.node(op, ins, attributes=attrs or {}, domain=domain, num_outputs=outs, name=name)
    g.insert_before(anchor, nd)
    return nd


def initializer(g, name: str, arr: np.ndarray):
    """Register ``arr`` as a graph initializer named ``name``; returns its value."""
    import onnx_ir as ir

    v = ir.Value(
        name=name,
        const_value=ir.tensor(arr, name=name),
        shape=ir.Shape(arr.shape),
        type=ir.TensorType(ir.DataType.from_numpy(arr.dtype)),
    )
    g.register_initializer(v)
    return v


def drop(g, nodes) -> None:
    """Remove nodes whose outputs are no longer used, detaching their inputs (so the producers
    become dead too and RemoveUnusedNodesPass can drop them)."""
    for nd in nodes:
        for i in range(len(nd.inputs)):
            nd.replace_input_with(i, None)
    g.remove(nodes, safe=False)


def concat_kv(att, inputs: dict):
    """The ``Concat(past, new)`` nodes feeding ``att``'s K and V, which both in-place passes replace."""
    cat_k, cat_v = att.inputs[1].producer(), att.inputs[2].producer()
    if (
        cat_k is None
        or cat_v is None
        or cat_k.op_type != "Concat"
        or cat_v.op_type != "Concat"
        or cat_k.inputs[0].name not in inputs
        or cat_v.inputs[0].name not in inputs
    ):
        raise ExportError(f"{att.name}: K/V do not come from Concat(past, new): unknown attention pattern")
    return cat_k, cat_v


def take_over_present(g, att, concats, writers, shape) -> None:
    """The in-place writers of K and V become the graph's ``present`` outputs (names kept) and the
    buffer's shape is declared on past and present; the concats and the old attention go."""
    import onnx_ir as ir

    for cat, nv in zip(concats, writers):
        old = cat.outputs[0]
        name = old.name
        old.name = name + "__concat"
        nv.name = name
        g.outputs[[i for i, o in enumerate(g.outputs) if o is old][0]] = nv
        nv.shape = shape
        nv.type = ir.TensorType(ir.DataType.FLOAT)
        cat.inputs[0].shape = shape
    drop(g, [att, *concats])


def query_heads(att, q3, head_dim: int) -> int:
    """The attention's query head count: from its q shape, the packed q width, or the
    producer's num_heads."""
    n = att.inputs[0].shape[1] if att.inputs[0].shape is not None else None
    if isinstance(n, int):
        return n
    d = q3.shape[-1] if q3.shape is not None else None
    if isinstance(d, int):
        return d // head_dim
    p = att.inputs[0].producer()
    if p is not None and "num_heads" in p.attributes:
        return int(p.attributes["num_heads"].value)
    raise ExportError(f"{att.name}: cannot tell the number of query heads")


def slice_logits(g) -> None:
    """Feed the lm-head only the rows from a new input, LOGITS_FROM ([1] int64; 0: every row).

    Why: a prefill keeps its last row's logits only, and the lm-head over every prompt row was 12%
    of a 64-row-chunked prefill's kernel time (SmolLM2-135M: 49,152 x 576 per row; docs/speed.md).
    Hidden states keep every row; rows are computed alike whatever their count (the per-op probe
    and the row guard see to it), so a row's logits do not depend on where the slice starts.
    In-place flavours only (finish_layout): their runtime feeds inputs of its own anyway, while
    the concat export stays what other runtimes load. (An optional input -- an initializer of the
    same name -- cannot be bound through onnxruntime's IOBinding, which the in-place caches need.)"""
    import onnx_ir as ir

    logits = next((v for v in g.outputs if v.name == S.LOGITS), None)
    node = logits.producer() if logits is not None else None
    while node is not None and node.op_type not in ("MatMul", "MatMulNBits", "Gemm"):
        # an element-wise tail after the lm-head (a soft cap): follow its one computed input
        live = [x for x in node.inputs if x is not None and x.const_value is None and x.producer() is not None]
        node = live[0].producer() if len(live) == 1 and live[0].producer().op_type != "Constant" else None
    if node is None:  # no lm-head product (a hand-made graph): every row, as before
        return
    start = ir.Value(name=S.LOGITS_FROM, shape=ir.Shape([1]), type=ir.TensorType(ir.DataType.INT64))
    g.inputs.append(start)
    end = initializer(g, "lm_head.rows_end", np.array([np.iinfo(np.int64).max], np.int64))
    axis = initializer(g, "lm_head.rows_axis", np.array([1], np.int64))
    sl = insert(g, "Slice", [node.inputs[0], start, end, axis], "/lm_head/rows_Slice", node)
    node.replace_input_with(0, sl.outputs[0])


def finish_layout(m, layout: str, capacity: int):
    """The rewritten model as a proto: the lm-head's rows sliced (slice_logits), unused
    initializers (the unfused weights) dropped, nodes sorted, layout and capacity recorded,
    checked where the checker can serialise it (< 2 GB)."""
    import onnx
    import onnx_ir as ir
    from onnx_ir.passes.common import TopologicalSortPass

    from ..exporter import EXTERNAL_DATA_BYTES, tensor_bytes

    g = m.graph
    slice_logits(g)
    graph_outs = set(g.outputs)
    for name, v in list(g.initializers.items()):
        if not list(v.uses()) and v not in graph_outs:
            del g.initializers[name]
    TopologicalSortPass()(m)
    out = ir.to_proto(m)
    del out.graph.value_info[:]  # shapes of rewritten values are re-inferred by onnxruntime
    drop_unused_optional_outputs(out.graph)
    out.metadata_props.add(key=S.KV_LAYOUT_KEY, value=layout)
    out.metadata_props.add(key=S.KV_CAPACITY_KEY, value=str(capacity))
    if tensor_bytes(out) < EXTERNAL_DATA_BYTES:
        onnx.checker.check_model(out)
    return out


# op -> its optional outputs by position (what a fused node computes only when they are named)
OPTIONAL_OUTPUTS = {"SkipSimplifiedLayerNormalization": (1, 2)}  # mean, inv_std_var


def drop_unused_optional_outputs(graph) -> int:
    """Blank (``""``) the optional outputs nobody reads (OPTIONAL_OUTPUTS): onnxruntime allocates
    and writes every named output, and onnx-ir names them all (``val_N``); the per-row statistics
    of 60 SkipSimplifiedLayerNormalization nodes were written every step for no reader (genai's
    graph leaves them blank). Returns how many were blanked."""
    read = {x for n in graph.node for x in n.input} | {o.name for o in graph.output}
    blanked = 0
    for n in graph.node:
        for j in OPTIONAL_OUTPUTS.get(n.op_type, ()):
            if j < len(n.output) and n.output[j] and n.output[j] not in read:
                n.output[j] = ""
                blanked += 1
    return blanked


def drop_logits_slice(g) -> None:
    """Undo slice_logits in an onnx GraphProto: the lm-head reads every row again and the
    LOGITS_FROM input goes. A batched serving graph needs that: its requests' last rows sit
    at different places, and it returns every row's logits (as a graph without the slice did)."""
    sl = next((n for n in g.node if n.op_type == "Slice" and len(n.input) > 1 and n.input[1] == S.LOGITS_FROM), None)
    if sl is None:
        return
    for n in g.node:
        for i, x in enumerate(n.input):
            if x == sl.output[0]:
                n.input[i] = sl.input[0]
    g.node.remove(sl)
    used = {x for n in g.node for x in n.input}
    for t in [t for t in g.initializer if t.name in sl.input[1:] and t.name not in used]:
        g.initializer.remove(t)
    for v in [v for v in g.input if v.name == S.LOGITS_FROM]:
        g.input.remove(v)
