"""The rowwise in-place KV flavour of a decoder, as a graph pass over any of our variants: every
query row attended on its own (one-row kernels whatever the step's row count), K/V written into a
bound buffer in place. See to_rowwise_kv for the graph it makes and why.
"""

from __future__ import annotations

import numpy as np

from ... import schema as S
from ...errors import ExportError
from ...log import logger
from .common import MS_DOMAIN, concat_kv, finish_layout, initializer, insert, query_heads, take_over_present
from .fusions import fuse_siblings, fuse_skip_norm
from .row_guard import strip_row_guard


def to_rowwise_kv(model, capacity: int, *, fuse: bool = True):
    """Rewrite a concat-flavour decoder into the rowwise flavour: in place, one-row arithmetic.

    Each layer's ``Concat(past, new) -> Attention`` becomes ``TensorScatter`` (the step's K/V slots
    written into the bound buffer at ``kv_write_index``, in place) and one ONNX ``Attention`` in
    which every query row is a head of its own: q ``[1, H, R, D]`` is reshaped to ``[1, H*R, 1, D]``
    (head ``h*R + r`` still maps onto kv head ``h // (H/KV)``) and the caller's bias ``[1, 1, R, L]``
    is expanded to one mask per (head, row). onnxruntime then runs every row through its one-row
    kernels, whatever R is, so a token's logits are bit-identical whether it is decoded alone or
    verified among others: plain decoding needs no pad row (the static flavour pays one), and the
    one-row kernels read K/V in place where GroupQueryAttention's multi-row path re-packs them.
    q is prescaled (exactly, by folding a power-of-two 1/sqrt(D) into its projection's scales or
    weights) so the kernel's alpha is 1, the condition for onnxruntime's one-row paths.

    Why by hand: no exporter or optimizer emits this form. Attention works over the whole bound
    buffer ``[1, KV, L, D]``, so the runtime grows it in tiles (L a multiple of the tile) and the
    bias masks what lies beyond the context.

    Graph I/O after the pass:
        input_ids [1, R] | inputs_embeds [1, R, H]; position_ids [1, R]; hidden_states [1, R, H]
        logits [1, R - logits_from, V]; logits_from [1]: the first row given logits (0: all; common.slice_logits)
        attention_bias [1, 1, R, L]   per row, over the L buffer positions (rows write past..past+R-1)
        kv_write_index [1]            the first position written (the past length)
        past_key_values.{i}.* / present.{i}.*  [1, KV, L, D], one buffer bound as both
    Graphs that shape a mask of their own (Gemma 3's sliding windows) are refused (ExportError).
    Trees: a tree node's keys cannot be grouped as in its chain by the one-row kernels (they block
    keys from key 0, with the past), so the runtime verifies chains on this flavour; the static
    flavour keeps exact trees. Hence no slot layout either: a step writes its rows' K/V in order.
    """
    import onnx_ir as ir
    from onnx_ir.passes.common import RemoveUnusedNodesPass

    if capacity < 2:
        raise ExportError("--max-context must be at least 2")
    model = strip_row_guard(model)  # the pass rewrites the graph as exported; the guard comes last
    m = ir.from_proto(model)
    g = m.graph
    inputs = {v.name: v for v in g.inputs}
    bias = inputs.get(S.ATTENTION_BIAS)
    if bias is None or S.POSITION_IDS not in inputs:
        raise ExportError("the rowwise KV flavour needs the attention_bias and position_ids inputs")
    attn_nodes = [n for n in g if n.op_type == "Attention" and n.domain in ("", "ai.onnx")]
    if not attn_nodes:
        raise ExportError("no ONNX Attention node to rewrite into the rowwise KV flavour")
    for att in attn_nodes:
        if len(att.inputs) < 4 or att.inputs[3] is not bias or any(x is not None for x in att.inputs[4:]):
            raise ExportError(
                f"{att.name}: attention does not take the caller's attention_bias as is (the graph "
                f"shapes a mask of its own): no rowwise flavour"
            )
    if fuse:
        fuse_siblings(g)
        fuse_skip_norm(g)
    write = ir.Value(name=S.KV_WRITE_INDEX, shape=ir.Shape([1]), type=ir.TensorType(ir.DataType.INT64))
    g.inputs.append(write)

    def new(op, ins, name, anchor, attrs=None, outs=1):
        return insert(g, op, ins, name, anchor, attrs, outs=outs)

    heads = {query_heads(att, att.inputs[0], att.inputs[1].producer().inputs[0].shape[3]) for att in attn_nodes}
    if len(heads) != 1:
        raise ExportError(f"layers differ in their query heads ({sorted(heads)}): no rowwise flavour")
    H = heads.pop()
    first = g.node(0)
    # one mask per (head, row), shared by all layers: [1,1,R,L] -> [1,H,R,L] -> [1,H*R,1,L]
    e = new(
        "Expand",
        [bias, initializer(g, "kv_rowwise.heads", np.array([1, H, 1, 1], np.int64))],
        "/kv_rowwise/mask_Expand",
        first,
    ).outputs[0]
    mask = new(
        "Reshape",
        [e, initializer(g, "kv_rowwise.mask_shape", np.array([1, -1, 1, 0], np.int64))],
        "/kv_rowwise/mask_Reshape",
        first,
    ).outputs[0]
    for att in attn_nodes:
        q4 = att.inputs[0]
        cat_k, cat_v = concat_kv(att, inputs)
        past_k, k4 = cat_k.inputs[0], cat_k.inputs[1]
        past_v, v4 = cat_v.inputs[0], cat_v.inputs[1]
        kv_heads, head_dim = past_k.shape[1], past_k.shape[3]
        base = att.name.rsplit("/", 1)[0]
        scale = (
            float(att.attributes["scale"].value)
            if "scale" in att.attributes and float(att.attributes["scale"].value)
            else float(1.0 / np.sqrt(head_dim))
        )
        q4, k4, v4, folded = _one_transpose_qkv(g, q4, k4, v4, H, kv_heads, head_dim, scale, base, att)
        if not folded:
            q4 = new(
                "Mul",
                [q4, initializer(g, f"{base}/kv_rowwise.scale", np.array(scale, np.float32))],
                f"{base}/kv_rowwise/q_scale",
                att,
            ).outputs[0]
        ks, vs = (
            new("TensorScatter", [p, x, write], f"{base}/kv_rowwise/{w}_write", att, {"axis": 2}).outputs[0]
            for p, x, w in ((past_k, k4, "k"), (past_v, v4, "v"))
        )
        q_rows = initializer(g, f"{base}/kv_rowwise.q_rows", np.array([1, -1, 1, head_dim], np.int64))
        qf = new("Reshape", [q4, q_rows], f"{base}/kv_rowwise/q_rows", att).outputs[0]
        attrs = {"scale": 1.0}
        if "softcap" in att.attributes and float(att.attributes["softcap"].value):
            attrs["softcap"] = float(att.attributes["softcap"].value)
        y = new("Attention", [qf, ks, vs, mask], f"{base}/kv_rowwise/Attention", att, attrs).outputs[0]
        y_heads = initializer(g, f"{base}/kv_rowwise.y_heads", np.array([1, H, -1, head_dim], np.int64))
        y4 = new("Reshape", [y, y_heads], f"{base}/kv_rowwise/y_heads", att).outputs[0]
        att.outputs[0].replace_all_uses_with(y4)
        take_over_present(g, att, (cat_k, cat_v), (ks, vs), ir.Shape([1, kv_heads, "kv_len", head_dim]))
    bias.shape = ir.Shape([1, 1, "rows", "kv_len"])
    m.opset_imports[""] = max(24, m.opset_imports.get("", 24))
    m.opset_imports[MS_DOMAIN] = 1
    RemoveUnusedNodesPass()(m)
    out = finish_layout(m, S.KV_ROWWISE, capacity)
    logger.info(
        "  rowwise KV flavour: %d attention layers, capacity %d, %d nodes",
        len(attn_nodes),
        capacity,
        len(out.graph.node),
    )
    return out


def _one_transpose_qkv(g, q4, k4, v4, H: int, kv_heads: int, head_dim: int, scale: float, base: str, anchor):
    """(q4, k4, v4, scale folded) with q/k/v cut from ONE transpose of the fused projection.

    The exporter gives each of q, k, v its own Reshape + Transpose (+ RotaryEmbedding); when they
    are the three outputs of one fused projection's Split, reshape that output to heads, transpose
    once and split the heads: two nodes fewer per layer. The attention scale is folded into the q
    columns of the projection when that is exact (a power of two; MatMulNBits scales or float
    weights)."""

    def strip(x4):
        """(rotary node or None, the 3D projection output under Transpose(Reshape(.)))."""
        rot = x4.producer() if x4.producer() is not None and x4.producer().op_type == "RotaryEmbedding" else None
        t = (rot.inputs[0] if rot is not None else x4).producer()
        if t is None or t.op_type != "Transpose" or list(t.attributes["perm"].value) != [0, 2, 1, 3]:
            return rot, None
        r = t.inputs[0].producer()
        return rot, (r.inputs[0] if r is not None and r.op_type == "Reshape" else None)

    (rq, q3), (rk, k3), (rv, v3) = strip(q4), strip(k4), strip(v4)
    sp = q3.producer() if q3 is not None else None
    if (
        sp is None
        or sp.op_type != "Split"
        or rv is not None
        or (rq is None) != (rk is None)
        or k3 is None
        or v3 is None
        or list(sp.outputs) != [q3, k3, v3]
    ):
        return q4, k4, v4, False
    folded = _fold_q_scale(g, sp, H * head_dim, scale, base)

    def new(op, ins, name, attrs=None, outs=1):
        return insert(g, op, ins, name, anchor, attrs, outs=outs)

    to_heads = initializer(g, f"{base}/kv_rowwise.qkv_heads", np.array([0, 0, -1, head_dim], np.int64))
    r = new("Reshape", [sp.inputs[0], to_heads], f"{base}/kv_rowwise/qkv_heads")
    t = new("Transpose", [r.outputs[0]], f"{base}/kv_rowwise/qkv_T", {"perm": [0, 2, 1, 3]})
    s = new(
        "Split",
        [t.outputs[0], initializer(g, f"{base}/kv_rowwise.qkv_split", np.array([H, kv_heads, kv_heads], np.int64))],
        f"{base}/kv_rowwise/qkv_Split",
        {"axis": 1},
        outs=3,
    )
    q, k, v = s.outputs
    if rq is not None:
        attrs = {a: x.value for a, x in rq.attributes.items()}
        q = new("RotaryEmbedding", [q, *rq.inputs[1:]], f"{base}/kv_rowwise/q_rotary", attrs).outputs[0]
        attrs = {a: x.value for a, x in rk.attributes.items()}
        k = new("RotaryEmbedding", [k, *rk.inputs[1:]], f"{base}/kv_rowwise/k_rotary", attrs).outputs[0]
    return q, k, v, folded


def _fold_q_scale(g, split, n_q: int, scale: float, base: str) -> bool:
    """Multiply the first ``n_q`` output columns (q) of the projection feeding ``split`` by
    ``scale``, in its constants, if that is exact (power of two) and the projection is a
    MatMulNBits (scales) or a MatMul (float weights) used by this split alone."""
    mant, _ = np.frexp(scale)
    proj = split.inputs[0].producer()
    if mant != 0.5 or proj is None or len(list(split.inputs[0].uses())) != 1:
        return False
    if proj.op_type == "Add":  # a GGUF carry's offset term: MatMulNBits + blocksums @ C, both scaled
        nbits, off = (x.producer() if x is not None else None for x in proj.inputs)
        c = off.inputs[1] if off is not None and off.op_type == "MatMul" else None
        if (
            nbits is None
            or off is None
            or c is None
            or c.const_value is None
            or len(c.const_value.shape) != 2
            or any(len(list(x.uses())) != 1 for x in proj.inputs if x is not None)
            or len(list(c.uses())) != 1
            or not _fold_q_scale_into(g, nbits, n_q, scale, base)
        ):
            return False
        cm = c.const_value.numpy().copy()
        cm[:, :n_q] *= np.asarray(scale, cm.dtype)
        off.replace_input_with(1, initializer(g, f"{base}/kv_rowwise.qkv_offset", cm))
        return True
    return _fold_q_scale_into(g, proj, n_q, scale, base)


def _fold_q_scale_into(g, proj, n_q: int, scale: float, base: str) -> bool:
    """Scale the first ``n_q`` output columns of the MatMulNBits or MatMul ``proj`` (exact: a power of two)."""
    if (
        proj.op_type == "MatMulNBits"
        and proj.domain == MS_DOMAIN
        and len(proj.inputs) <= 5
        and proj.inputs[2] is not None
        and proj.inputs[2].const_value is not None
    ):
        n = int(proj.attributes["N"].value)
        sc = proj.inputs[2].const_value.numpy()
        new = sc.reshape(n, -1).copy()
        new[:n_q] *= np.asarray(scale, new.dtype)
        proj.replace_input_with(2, initializer(g, f"{base}/kv_rowwise.qkv_scales", new.reshape(sc.shape)))
        return True
    w_in = proj.inputs[1] if proj.op_type == "MatMul" else None
    if w_in is not None and w_in.const_value is not None and len(w_in.const_value.shape) == 2:
        w = proj.inputs[1].const_value.numpy().copy()
        w[:, :n_q] *= np.asarray(scale, w.dtype)
        proj.replace_input_with(1, initializer(g, f"{base}/kv_rowwise.qkv_weight", w))
        return True
    return False
