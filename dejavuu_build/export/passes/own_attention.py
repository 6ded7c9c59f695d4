"""The static graph's attention in our own operator: each ``GroupQueryAttention`` of a static KV
graph (export.passes.static_kv) becomes ``dejavuu.attn.GroupAttention`` (kernels/attn.cpp) on the
same packed q/k/v, buffers, rotary tables, positions and bias, and the two-row floor that
GroupQueryAttention needed goes: our operator gives a row the same bits alone as among any
number of rows, so a lone token runs one attention row.

Why a pass after static_kv and not a flavour of it: everything else about the in-place graph
(slots, fused projections, the buffer binding, the runtime's driver) is the static layout's
unchanged; only the attention node and the floor's pads differ. Applied to the variants of a
precision that runs our operators (precisions.Precision.operators names kernels.attn.DOMAIN): the
library that holds Q41MatMul holds this operator too. A GroupQueryAttention this operator cannot
take (q/k/v unpacked, no or interleaved rotary, a softcap or a window, another head size) stays
as it was, and the log says so."""

from __future__ import annotations

from ...errors import ExportError
from ...kernels import attn
from ...log import logger
from .common import MS_DOMAIN
from .static_kv import FLOOR_PREFIXES

_UNSUPPORTED_ATTRS = ("softcap", "local_window_size", "smooth_softmax", "qk_output")


def to_own_attention(model):
    """``model`` (an ``onnx.ModelProto`` of the static KV flavour) with its GroupQueryAttention
    nodes in our operator where it takes them; returns the new proto (the input is not changed)."""
    import onnx_ir as ir
    from onnx_ir.passes.common import RemoveUnusedNodesPass

    m = ir.from_proto(model)
    g = m.graph
    gqas = [n for n in g if n.op_type == "GroupQueryAttention" and n.domain == MS_DOMAIN]
    if not gqas:
        raise ExportError("no GroupQueryAttention to put in our attention operator: not a static KV graph")
    done, kept = 0, []
    for gqa in gqas:
        why = _refusal(gqa)
        if why:
            kept.append(f"{gqa.name}: {why}")
            continue
        qkv, past_k, past_v = gqa.inputs[0], gqa.inputs[3], gqa.inputs[4]
        cos, sin, positions, bias = (gqa.inputs[i] for i in (7, 8, 9, 10))
        qkv = _unfloor_gather(qkv)
        heads = int(gqa.attributes["num_heads"].value)
        kv_heads = int(gqa.attributes["kv_num_heads"].value)
        scale = float(gqa.attributes["scale"].value)
        nd = ir.node(
            attn.OP,
            [qkv, past_k, past_v, cos, sin, _unfloor(positions), _unfloor(bias)],
            attributes={"num_heads": heads, "kv_num_heads": kv_heads, "scale": scale},
            domain=attn.DOMAIN,
            num_outputs=3,
            name=gqa.name.replace("GroupQueryAttention", "GroupAttention"),
        )
        g.insert_before(gqa, nd)
        for old, new in zip(gqa.outputs, nd.outputs):
            name, shape, typ = old.name, old.shape, old.type
            for i in [i for i, o in enumerate(g.outputs) if o is old]:
                g.outputs[i] = new
            old.replace_all_uses_with(new)
            old.name = f"{name}__gqa"
            new.name, new.shape, new.type = name, shape, typ
        g.remove(gqa, safe=True)
        done += 1
    if not done:  # nothing for our operator: the static graph as it was
        logger.info("  our attention operator: none of %d GroupQueryAttention (%s)", len(gqas), "; ".join(kept[:1]))
        return model
    m.opset_imports[attn.DOMAIN] = attn.OPSET
    RemoveUnusedNodesPass()(m)
    if not any(n.domain == MS_DOMAIN for n in g):
        m.opset_imports.pop(MS_DOMAIN, None)
    out = _finish(m)
    logger.info(
        "  our attention operator: %d of %d GroupQueryAttention replaced, no row floor, %d nodes%s",
        done,
        len(gqas),
        len(out.graph.node),
        "" if not kept else f" (kept: {'; '.join(kept)})",
    )
    return out


def _refusal(gqa) -> str | None:
    """Why our operator cannot take this GroupQueryAttention, or None."""
    a = gqa.attributes
    ins = list(gqa.inputs) + [None] * (11 - len(gqa.inputs))
    if ins[1] is not None or ins[2] is not None:
        return "q, k and v are not packed"
    if int(a["do_rotary"].value) != 1 if "do_rotary" in a else True:
        return "no rotary in the node"
    if "rotary_interleaved" in a and int(a["rotary_interleaved"].value):
        return "interleaved rotary"
    for name in _UNSUPPORTED_ATTRS:
        if name in a and float(a[name].value) not in (0.0, -1.0):
            return f"attribute {name}"
    if any(ins[i] is None for i in (3, 4, 7, 8, 9, 10)):
        return "no past buffers, rotary tables, positions or bias"
    shape = ins[3].shape
    d = shape[3] if shape is not None and len(shape) == 4 else None
    if d not in attn.HEAD_SIZES:
        return f"head size {d} (the operator takes {attn.HEAD_SIZES})"
    if "scale" not in a or not float(a["scale"].value) > 0:
        return "no scale"
    return None


def _is_floor(nd) -> bool:
    return nd is not None and nd.op_type == "Pad" and any(p in (nd.name or "") for p in FLOOR_PREFIXES)


def _unfloor(v):
    """``v`` before the floor's pads (static_kv._Floor): the rows and keys the step has."""
    while _is_floor(v.producer()):
        v = v.producer().inputs[0]
    return v


def _unfloor_gather(v):
    """The packed q/k/v of the step's slots: where a slot Gather reads through the floor's padded
    ``slot_rows``, a Gather of the unpadded ones (the padded index is shared by every layer's
    Gather; the last use removes it)."""
    v = _unfloor(v)
    nd = v.producer()
    if nd is not None and nd.op_type == "Gather" and len(nd.inputs) > 1 and _is_floor(nd.inputs[1].producer()):
        nd.replace_input_with(1, _unfloor(nd.inputs[1]))
    return v


def _finish(m):
    """The rewritten model as a proto, sorted, checked where the checker can serialise it (its
    layout and capacity records are the static graph's, carried in the metadata)."""
    import onnx
    import onnx_ir as ir
    from onnx_ir.passes.common import TopologicalSortPass

    from ..exporter import EXTERNAL_DATA_BYTES, tensor_bytes
    from .common import drop_unused_optional_outputs

    TopologicalSortPass()(m)
    out = ir.to_proto(m)
    del out.graph.value_info[:]
    drop_unused_optional_outputs(out.graph)
    if tensor_bytes(out) < EXTERNAL_DATA_BYTES:
        onnx.checker.check_model(out)
    return out
