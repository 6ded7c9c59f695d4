"""The static, in-place KV flavour of a decoder, as a graph pass over any of our variants.

Every layer's ``RotaryEmbedding -> Concat(past, new) -> Attention`` becomes one
``com.microsoft.GroupQueryAttention`` over a preallocated ``[1, kv_heads, capacity, head_dim]``
buffer that the runtime binds as both ``past`` and ``present`` (I/O binding): a step writes its
new rows only and never copies the cache. RoPE moves into the kernel (``do_rotary`` with cos/sin
tables evaluated from the graph's own rotary subgraph, so any RoPE scaling the exporter traced is
kept), and sibling projections of one input (q/k/v, gate/up) are fused into one MatMul: the
fused q/k/v output feeds GQA packed. That is the graph onnxruntime-genai runs, plus what trees
need: the caller's additive 4D bias and explicit ``position_ids``.

Why by hand: onnxruntime's optimizers rewrite neither standard ``Attention`` with an external
bias nor a concat KV cache into an in-place one (checked on 1.32), and the exporter cannot emit
a contrib op. The pass works on onnx-ir.

Rows and slots: the graph takes R token rows but attends over S slots. ``slot_rows [S]`` gives
the row each slot reads (pads: any row; its keys are masked) and ``row_slots [R]`` the slot of
each row. Projections, norms, MLPs and the lm-head run on the R rows; each GQA gathers its q/k/v
into the S slots and its output back to the rows. Why: an exact tree needs its branches at
period-aligned slots (runtime.tree.aligned_layout), and the pad slots between them then cost
attention only instead of a whole forward row each. A chain passes the identity.

Graph I/O after the pass (names unchanged):
    input_ids [1, R] | inputs_embeds [1, R, H]; logits, hidden_states [1, R, ...]
    slot_rows [S], row_slots [R]   int64, as above
    position_ids [1, S]
    attention_bias [1, 1, S, P+S]  still past+new wide: the past length P is read off its shape
    past_key_values.{i}.key|value  [1, KV, capacity, D]   (the shared buffer)
    present.{i}.key|value          [1, KV, capacity, D]   (the same buffer, bound in place)
GQA applies its own causal mask among the new rows on top of the bias, so tree nodes must come
in topological order (parents before children), which the runtime guarantees.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from .. import schema as S
from ..errors import ExportError
from ..log import logger
from .passes.row_guard import strip_row_guard

MS_DOMAIN = "com.microsoft"
KV_LAYOUT_STATIC = "static"
KV_LAYOUT_CONCAT = "concat"


def to_static_kv(model, capacity: int, *, fuse: bool = True):
    """Rewrite an ``onnx.ModelProto`` decoder of the concat flavour into the in-place flavour."""
    import onnx_ir as ir
    from onnx_ir.passes.common import RemoveUnusedNodesPass

    if capacity < 2:
        raise ExportError("--max-context must be at least 2")
    model = strip_row_guard(model)      # the pass rewrites the graph as exported; the guard comes last
    tables = _rotary_tables(model, capacity)
    m = ir.from_proto(model)
    g = m.graph
    inputs = {v.name: v for v in g.inputs}
    bias, position_ids = inputs.get(S.ATTENTION_BIAS), inputs.get(S.POSITION_IDS)
    if bias is None or position_ids is None:
        raise ExportError("the static KV flavour needs the attention_bias and position_ids inputs")
    attn_nodes = [n for n in g if n.op_type == "Attention" and n.domain in ("", "ai.onnx")]
    if not attn_nodes:
        raise ExportError("no ONNX Attention node to rewrite into the static KV flavour")
    if fuse:
        _fuse_siblings(g)
        _fuse_skip_norm(g)

    def new(op, ins, name, anchor, attrs=None, domain="", outs=1):
        return _insert(g, op, ins, name, anchor, attrs, domain, outs)

    # total = P + N from the bias's last dim; seqlens_k = total - 1 (int32), as GQA wants them.
    first = g.node(0)
    total64 = new("Shape", [bias], "/kv_static/Shape", first, {"start": 3, "end": 4}).outputs[0]
    total32 = new("Cast", [total64], "/kv_static/Cast", first, {"to": ir.DataType.INT32}).outputs[0]
    one = _initializer(g, "kv_static.one", np.array([1], np.int32))
    seqlens = new("Sub", [total32, one], "/kv_static/SeqlensK", first).outputs[0]
    axis0 = _initializer(g, "kv_static.axis0", np.array([0], np.int64))
    total = new("Squeeze", [total32, axis0], "/kv_static/Total", first).outputs[0]
    flat = _initializer(g, "kv_static.flat", np.array([0, 0, -1], np.int64))
    cos_sin: dict[tuple[bytes, bytes], tuple] = {}     # (cos, sin) bytes -> their initializers
    slot_gathers: list = []
    # Rows (tokens) and slots (attention positions) are decoupled: row-wise work runs on the real
    # rows only; each GQA gathers its q/k/v rows into the slot layout and gathers its output back.
    slot_rows = ir.Value(name=S.SLOT_ROWS, shape=ir.Shape(["slots"]), type=ir.TensorType(ir.DataType.INT64))
    row_slots = ir.Value(name=S.ROW_SLOTS, shape=ir.Shape(["rows"]), type=ir.TensorType(ir.DataType.INT64))
    g.inputs.extend([slot_rows, row_slots])

    for att in attn_nodes:
        q4 = att.inputs[0]
        att_bias = att.inputs[3] if len(att.inputs) > 3 else None
        if att_bias is None or (len(att.inputs) > 4 and any(x is not None for x in att.inputs[4:])):
            raise ExportError(f"{att.name}: unknown Attention form (no mask input, or past inputs of its own)")
        cat_k, cat_v = _concat_kv(att, inputs)
        past_k, k4 = cat_k.inputs[0], cat_k.inputs[1]
        past_v, v4 = cat_v.inputs[0], cat_v.inputs[1]
        kv_heads, head_dim = past_k.shape[1], past_k.shape[3]
        base = att.name.rsplit("/", 1)[0]
        rq, rk = q4.producer(), k4.producer()
        rotary = rq is not None and rq.op_type == "RotaryEmbedding" and rk is not None and rk.op_type == "RotaryEmbedding"
        attrs: dict = {"kv_num_heads": int(kv_heads)}
        if rotary:
            if len(rq.inputs) > 3 and rq.inputs[3] is not None:
                raise ExportError(f"{att.name}: RotaryEmbedding with position_ids of its own is not supported")
            if rq.attributes.get("rotary_embedding_dim") is not None and \
                    int(rq.attributes["rotary_embedding_dim"].value) not in (0, head_dim):
                raise ExportError(f"{att.name}: partial rotary embeddings are not supported by the static flavour")
            cq, sq = tables[rq.inputs[1].name], tables[rq.inputs[2].name]
            if not (np.array_equal(cq, tables[rk.inputs[1].name]) and np.array_equal(sq, tables[rk.inputs[2].name])):
                raise ExportError(f"{att.name}: q and k use different rotary tables")
            keys = (cq.tobytes(), sq.tobytes())      # one table per distinct content (layers share them)
            if keys not in cos_sin:
                i = len(cos_sin)
                cos_sin[keys] = (_initializer(g, f"kv_static.cos_cache.{i}", cq),
                                 _initializer(g, f"kv_static.sin_cache.{i}", sq))
            cos, sin = cos_sin[keys]
            attrs.update(do_rotary=1, rotary_interleaved=int(rq.attributes["interleaved"].value)
                         if "interleaved" in rq.attributes else 0)
            q4, k4 = rq.inputs[0], rk.inputs[0]
        else:
            cos = sin = None
        q3, k3, v3 = (_packed(g, x, flat, f"{base}/kv_static/{w}", att) for x, w in ((q4, "q"), (k4, "k"), (v4, "v")))
        heads = _heads(att, q3, head_dim)
        attrs["num_heads"] = heads
        for a in ("scale", "softcap"):
            if a in att.attributes and float(att.attributes[a].value):
                attrs[a] = float(att.attributes[a].value)
        attrs.setdefault("scale", float(1.0 / np.sqrt(head_dim)))
        qkv = _packed_qkv(g, q3, k3, v3) if fuse else None
        ins = [qkv, None, None] if qkv is not None else [q3, k3, v3]
        to_slots = [None if x is None else new("Gather", [x, slot_rows], f"{base}/kv_static/to_slots_{j}", att,
                                               {"axis": 1}) for j, x in enumerate(ins)]
        slot_gathers += [x for x in to_slots if x is not None]
        ins = [None if x is None else x.outputs[0] for x in to_slots]
        gqa = new("GroupQueryAttention", ins + [past_k, past_v, seqlens, total, cos, sin,
                                               position_ids if rotary else None, att_bias],
                  f"{base}/GroupQueryAttention", att, attrs, MS_DOMAIN, 3)
        gqa.outputs[0].name = f"{base}/gqa_out"
        to_rows = new("Gather", [gqa.outputs[0], row_slots], f"{base}/kv_static/to_rows", att, {"axis": 1})
        slot_gathers.append(to_rows)
        out3 = to_rows.outputs[0]
        out3.name = f"{base}/gqa_rows"
        # Attention gave [B, H, N, D]; its consumer is Transpose(0,2,1,3) + Reshape to [B, N, H*D],
        # which GQA's output already is.
        t_user = _only_user(att.outputs[0])
        r_user = _only_user(t_user.outputs[0]) if t_user is not None and t_user.op_type == "Transpose" and \
            list(t_user.attributes["perm"].value) == [0, 2, 1, 3] else None
        if r_user is not None and r_user.op_type == "Reshape":
            r_user.outputs[0].replace_all_uses_with(out3)
        else:
            shp = _initializer(g, f"{base}/kv_static/unpack", np.array([0, 0, heads, head_dim], np.int64))
            r = new("Reshape", [out3, shp], f"{base}/kv_static/out_R", att)
            t = new("Transpose", [r.outputs[0]], f"{base}/kv_static/out_T", att, {"perm": [0, 2, 1, 3]})
            att.outputs[0].replace_all_uses_with(t.outputs[0])
        _take_over_present(g, att, (cat_k, cat_v), gqa.outputs[1:3], ir.Shape([1, kv_heads, capacity, head_dim]))
    m.opset_imports[MS_DOMAIN] = 1
    RemoveUnusedNodesPass()(m)
    sparse = _slot_inputs_reach_attention_only(g, (bias, position_ids))
    if sparse:
        position_ids.shape = ir.Shape([1, "slots"])
        bias.shape = ir.Shape([1, 1, "slots", "total"])
        primary = inputs.get(S.INPUT_IDS) or inputs.get(S.INPUTS_EMBEDS)
        if primary is not None and primary.shape is not None:
            primary.shape = ir.Shape([1, "rows", *list(primary.shape)[2:]])
    else:
        _undo_slot_gathers(g, slot_gathers, (slot_rows, row_slots))
    out = _finish(m, KV_LAYOUT_STATIC, capacity)
    logger.info("  static KV flavour: %d GroupQueryAttention, capacity %d, %d nodes, tree pad slots %s",
                len(attn_nodes), capacity, len(out.graph.node),
                "cost attention only" if sparse else "are whole rows (the graph shapes a mask by the rows)")
    return out


def _insert(g, op: str, ins, name: str, anchor, attrs=None, domain: str = "", outs: int = 1):
    """A new node ``name`` inserted before ``anchor`` (the passes keep graph order, then re-sort)."""
    import onnx_ir as ir

    nd = ir.node(op, ins, attributes=attrs or {}, domain=domain, num_outputs=outs, name=name)
    g.insert_before(anchor, nd)
    return nd


def _concat_kv(att, inputs: dict):
    """The ``Concat(past, new)`` nodes feeding ``att``'s K and V, which both in-place passes replace."""
    cat_k, cat_v = att.inputs[1].producer(), att.inputs[2].producer()
    if (cat_k is None or cat_v is None or cat_k.op_type != "Concat" or cat_v.op_type != "Concat"
            or cat_k.inputs[0].name not in inputs or cat_v.inputs[0].name not in inputs):
        raise ExportError(f"{att.name}: K/V do not come from Concat(past, new): unknown attention pattern")
    return cat_k, cat_v


def _take_over_present(g, att, concats, writers, shape) -> None:
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
    _drop(g, [att, *concats])


def _finish(m, layout: str, capacity: int):
    """The rewritten model as a proto: unused initializers (the unfused weights) dropped, nodes
    sorted, layout and capacity recorded, checked where the checker can serialise it (< 2 GB)."""
    import onnx
    import onnx_ir as ir
    from onnx_ir.passes.common import TopologicalSortPass

    from .exporter import EXTERNAL_DATA_BYTES, tensor_bytes

    g = m.graph
    graph_outs = set(g.outputs)
    for name, v in list(g.initializers.items()):
        if not list(v.uses()) and v not in graph_outs:
            del g.initializers[name]
    TopologicalSortPass()(m)
    out = ir.to_proto(m)
    del out.graph.value_info[:]   # shapes of rewritten values are re-inferred by onnxruntime
    out.metadata_props.add(key=S.KV_LAYOUT_KEY, value=layout)
    out.metadata_props.add(key=S.KV_CAPACITY_KEY, value=str(capacity))
    if tensor_bytes(out) < EXTERNAL_DATA_BYTES:
        onnx.checker.check_model(out)
    return out

def _slot_inputs_reach_attention_only(g, slot_shaped) -> bool:
    """Rows may differ from slots only if the slot-shaped inputs (bias, positions) feed nothing
    but GroupQueryAttention and the bias's Shape: a graph that shapes its own mask from them
    (Gemma 3's sliding windows) mixes them with row-shaped tensors, and keeps rows = slots."""
    for v in slot_shaped:
        for use in v.uses():
            nd = use.node
            if not (nd.op_type == "GroupQueryAttention" or nd.name == "/kv_static/Shape"):
                return False
    return True


def _undo_slot_gathers(g, gathers, inputs) -> None:
    for nd in gathers:
        nd.outputs[0].replace_all_uses_with(nd.inputs[0])
    _drop(g, gathers)
    for v in inputs:
        g.inputs.remove(v)


def _initializer(g, name: str, arr: np.ndarray):
    """Register ``arr`` as a graph initializer named ``name``; returns its value."""
    import onnx_ir as ir

    v = ir.Value(name=name, const_value=ir.tensor(arr, name=name), shape=ir.Shape(arr.shape),
                 type=ir.TensorType(ir.DataType.from_numpy(arr.dtype)))
    g.register_initializer(v)
    return v


def _drop(g, nodes) -> None:
    """Remove nodes whose outputs are no longer used, detaching their inputs (so the producers
    become dead too and RemoveUnusedNodesPass can drop them)."""
    for nd in nodes:
        for i in range(len(nd.inputs)):
            nd.replace_input_with(i, None)
    g.remove(nodes, safe=False)


def _only_user(v):
    uses = list(v.uses())
    return uses[0].node if len(uses) == 1 else None


def _heads(att, q3, head_dim: int) -> int:
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


def _packed(g, x4, flat, name, anchor):
    """[B, heads, N, D] -> [B, N, heads*D]: reuse the 3D tensor the exporter reshaped and
    transposed (``Transpose(Reshape(y3))``), or reshape what is there."""
    import onnx_ir as ir

    t = x4.producer()
    if t is not None and t.op_type == "Transpose" and list(t.attributes["perm"].value) == [0, 2, 1, 3]:
        y4 = t.inputs[0]
        r = y4.producer()
        if r is not None and r.op_type == "Reshape" and r.inputs[0].shape is not None and len(r.inputs[0].shape) == 3:
            return r.inputs[0]
        nd = ir.node("Reshape", [y4, flat], name=f"{name}_R")
        g.insert_before(anchor, nd)
        return nd.outputs[0]
    tn = ir.node("Transpose", [x4], attributes={"perm": [0, 2, 1, 3]}, name=f"{name}_T")
    rn = ir.node("Reshape", [tn.outputs[0], flat], name=f"{name}_R")
    g.insert_before(anchor, tn)
    g.insert_before(anchor, rn)
    return rn.outputs[0]


def _packed_qkv(g, q3, k3, v3):
    """If q, k and v are the three outputs of one fused projection's Split, the fused output."""
    sp = q3.producer()
    if sp is None or sp.op_type != "Split" or k3.producer() is not sp or v3.producer() is not sp:
        return None
    if list(sp.outputs) != [q3, k3, v3]:
        return None
    return sp.inputs[0]


def _fuse_siblings(g) -> None:
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
            groups[("nbits", nd.inputs[0].name, tuple(sorted(a.items())),
                    tuple(None if x is None else str(x.const_value.dtype) for x in nd.inputs[1:]))].append(nd)
        elif nd.op_type == "MatMul" and nd.inputs[1].const_value is not None and \
                len(nd.inputs[1].const_value.shape) == 2:
            groups[("matmul", nd.inputs[0].name, nd.inputs[1].const_value.shape[0])].append(nd)
    for key, nodes in groups.items():
        if len(nodes) < 2:
            continue
        nodes.sort(key=lambda n: _order(n.name))
        anchor = nodes[0]
        name = anchor.name.rsplit("/", 2)[0] + "/" + "_".join(n.name.rsplit("/", 2)[-2] for n in nodes)
        if key[0] == "nbits":
            ns = [int(n.attributes["N"].value) for n in nodes]
            ws: list = []       # the fused inputs (onnx_ir values; None for an absent optional input)
            for j in range(1, len(nodes[0].inputs)):
                if nodes[0].inputs[j] is None:
                    ws.append(None)
                    continue
                arr = np.concatenate([n.inputs[j].const_value.numpy() for n in nodes], axis=0)
                ws.append(_initializer(g, f"{name}.w{j}", arr))
            attrs = {k: v.value for k, v in anchor.attributes.items()}
            attrs["N"] = int(sum(ns))
            fused = ir.node("MatMulNBits", [anchor.inputs[0], *ws], attributes=attrs, domain=MS_DOMAIN,
                            name=f"{name}/MatMulNBits")
        else:
            arrs = [n.inputs[1].const_value.numpy() for n in nodes]
            ns = [a.shape[1] for a in arrs]
            arr = np.concatenate(arrs, axis=1)
            fused = ir.node("MatMul", [anchor.inputs[0], _initializer(g, f"{name}.weight_T", arr)],
                            name=f"{name}/MatMul")
        g.insert_before(anchor, fused)
        sizes = _initializer(g, f"{name}.split", np.array(ns, np.int64))
        split = ir.node("Split", [fused.outputs[0], sizes], attributes={"axis": -1}, num_outputs=len(nodes),
                        name=f"{name}/Split")
        g.insert_before(anchor, split)
        for n, o in zip(nodes, split.outputs):
            o.name = n.outputs[0].name + "_fused"
            o.shape, o.type = n.outputs[0].shape, n.outputs[0].type
            n.outputs[0].replace_all_uses_with(o)
        _drop(g, nodes)


def _fuse_skip_norm(g) -> None:
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
        if a is None or b is None or a.const_value is not None or b.const_value is not None \
                or a.shape is None or b.shape is None or list(a.shape) != list(b.shape):
            continue
        eps = float(nd.attributes["epsilon"].value) if "epsilon" in nd.attributes else 1e-5
        fused = ir.node("SkipSimplifiedLayerNormalization", [a, b, nd.inputs[1]], attributes={"epsilon": eps},
                        domain=MS_DOMAIN, num_outputs=4, name=nd.name.rsplit("/", 1)[0] + "/SkipSimplifiedLayerNorm")
        g.insert_before(add, fused)
        y, _, _, total = fused.outputs
        y.name, total.name = nd.outputs[0].name + "_skipnorm", add.outputs[0].name + "_skipsum"
        y.shape = total.shape = add.outputs[0].shape
        y.type = total.type = add.outputs[0].type
        outs = set(g.outputs)
        for old, new_v in ((nd.outputs[0], y), (add.outputs[0], total)):
            name, was_output = old.name, old in outs
            old.replace_all_uses_with(new_v, replace_graph_outputs=True)
            if was_output:                       # keep graph output names (hidden_states)
                old.name, new_v.name = name + "__unfused", name
        _drop(g, [nd, add])


_PROJ_ORDER = {"q_proj": 0, "k_proj": 1, "v_proj": 2, "gate_proj": 0, "up_proj": 1}


def _order(name: str) -> tuple:
    parts = name.split("/")
    return (_PROJ_ORDER.get(parts[-2] if len(parts) > 1 else "", 9), name)


def _rotary_tables(model, capacity: int) -> dict[str, np.ndarray]:
    """cos/sin tables [capacity, rotary_dim/2] of every RotaryEmbedding, evaluated by running the
    graph's own subgraph from ``position_ids`` for positions 0..capacity-1 (so frequency scaling,
    attention scaling and whatever else the exporter traced is kept exactly)."""
    import onnx
    import onnxruntime as ort

    names = sorted({x for nd in model.graph.node if nd.op_type == "RotaryEmbedding" for x in nd.input[1:3] if x})
    if not names:
        return {}
    inits = {i.name for i in model.graph.initializer}
    producers = {o: nd for nd in model.graph.node for o in nd.output}
    keep, stack = [], list(names)
    seen: set[str] = set()
    while stack:
        v = stack.pop()
        if v in seen or v in inits or v not in producers:
            if v not in inits and v not in producers and v != S.POSITION_IDS:
                raise ExportError(f"rotary table {v} depends on {v}, not only on position_ids")
            seen.add(v)
            continue
        seen.add(v)
        nd = producers[v]
        keep.append(nd)
        stack.extend(x for x in nd.input if x)
    order = {id(nd): i for i, nd in enumerate(model.graph.node)}
    keep = sorted({id(n): n for n in keep}.values(), key=lambda n: order[id(n)])
    used = {x for nd in keep for x in nd.input}
    pos_in = next(i for i in model.graph.input if i.name == S.POSITION_IDS)
    sub = onnx.helper.make_model(
        onnx.helper.make_graph(keep, "rotary_tables", [pos_in],
                               [onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None) for n in names],
                               [i for i in model.graph.initializer if i.name in used]),
        opset_imports=list(model.opset_import), ir_version=model.ir_version)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(sub.SerializeToString(), so, providers=["CPUExecutionProvider"])
    outs = sess.run(names, {S.POSITION_IDS: np.arange(capacity, dtype=np.int64)[None]})
    return {n: np.ascontiguousarray(o.reshape(capacity, -1), dtype=np.float32) for n, o in zip(names, outs)}


KV_LAYOUT_ROWWISE = "rowwise"


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
        input_ids [1, R] | inputs_embeds [1, R, H]; position_ids [1, R]; logits, hidden_states [1, R, ...]
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
    model = strip_row_guard(model)      # the pass rewrites the graph as exported; the guard comes last
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
            raise ExportError(f"{att.name}: attention does not take the caller's attention_bias as is (the graph "
                              f"shapes a mask of its own): no rowwise flavour")
    if fuse:
        _fuse_siblings(g)
        _fuse_skip_norm(g)
    write = ir.Value(name=S.KV_WRITE_INDEX, shape=ir.Shape([1]), type=ir.TensorType(ir.DataType.INT64))
    g.inputs.append(write)

    def new(op, ins, name, anchor, attrs=None, outs=1):
        return _insert(g, op, ins, name, anchor, attrs, outs=outs)

    heads = {_heads(att, att.inputs[0], att.inputs[1].producer().inputs[0].shape[3]) for att in attn_nodes}
    if len(heads) != 1:
        raise ExportError(f"layers differ in their query heads ({sorted(heads)}): no rowwise flavour")
    H = heads.pop()
    first = g.node(0)
    # one mask per (head, row), shared by all layers: [1,1,R,L] -> [1,H,R,L] -> [1,H*R,1,L]
    e = new("Expand", [bias, _initializer(g, "kv_rowwise.heads", np.array([1, H, 1, 1], np.int64))],
            "/kv_rowwise/mask_Expand", first).outputs[0]
    mask = new("Reshape", [e, _initializer(g, "kv_rowwise.mask_shape", np.array([1, -1, 1, 0], np.int64))],
               "/kv_rowwise/mask_Reshape", first).outputs[0]
    for att in attn_nodes:
        q4 = att.inputs[0]
        cat_k, cat_v = _concat_kv(att, inputs)
        past_k, k4 = cat_k.inputs[0], cat_k.inputs[1]
        past_v, v4 = cat_v.inputs[0], cat_v.inputs[1]
        kv_heads, head_dim = past_k.shape[1], past_k.shape[3]
        base = att.name.rsplit("/", 1)[0]
        scale = float(att.attributes["scale"].value) if "scale" in att.attributes and \
            float(att.attributes["scale"].value) else float(1.0 / np.sqrt(head_dim))
        q4, k4, v4, folded = _one_transpose_qkv(g, q4, k4, v4, H, kv_heads, head_dim, scale, base, att)
        if not folded:
            q4 = new("Mul", [q4, _initializer(g, f"{base}/kv_rowwise.scale", np.array(scale, np.float32))],
                     f"{base}/kv_rowwise/q_scale", att).outputs[0]
        ks, vs = (new("TensorScatter", [p, x, write], f"{base}/kv_rowwise/{w}_write", att, {"axis": 2}).outputs[0]
                  for p, x, w in ((past_k, k4, "k"), (past_v, v4, "v")))
        q_rows = _initializer(g, f"{base}/kv_rowwise.q_rows", np.array([1, -1, 1, head_dim], np.int64))
        qf = new("Reshape", [q4, q_rows], f"{base}/kv_rowwise/q_rows", att).outputs[0]
        attrs = {"scale": 1.0}
        if "softcap" in att.attributes and float(att.attributes["softcap"].value):
            attrs["softcap"] = float(att.attributes["softcap"].value)
        y = new("Attention", [qf, ks, vs, mask], f"{base}/kv_rowwise/Attention", att, attrs).outputs[0]
        y_heads = _initializer(g, f"{base}/kv_rowwise.y_heads", np.array([1, H, -1, head_dim], np.int64))
        y4 = new("Reshape", [y, y_heads], f"{base}/kv_rowwise/y_heads", att).outputs[0]
        att.outputs[0].replace_all_uses_with(y4)
        _take_over_present(g, att, (cat_k, cat_v), (ks, vs), ir.Shape([1, kv_heads, "kv_len", head_dim]))
    bias.shape = ir.Shape([1, 1, "rows", "kv_len"])
    m.opset_imports[""] = max(24, m.opset_imports.get("", 24))
    m.opset_imports[MS_DOMAIN] = 1
    RemoveUnusedNodesPass()(m)
    out = _finish(m, KV_LAYOUT_ROWWISE, capacity)
    logger.info("  rowwise KV flavour: %d attention layers, capacity %d, %d nodes", len(attn_nodes), capacity,
                len(out.graph.node))
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
    if sp is None or sp.op_type != "Split" or rv is not None or (rq is None) != (rk is None) \
            or k3 is None or v3 is None or list(sp.outputs) != [q3, k3, v3]:
        return q4, k4, v4, False
    folded = _fold_q_scale(g, sp, H * head_dim, scale, base)

    def new(op, ins, name, attrs=None, outs=1):
        return _insert(g, op, ins, name, anchor, attrs, outs=outs)

    to_heads = _initializer(g, f"{base}/kv_rowwise.qkv_heads", np.array([0, 0, -1, head_dim], np.int64))
    r = new("Reshape", [sp.inputs[0], to_heads], f"{base}/kv_rowwise/qkv_heads")
    t = new("Transpose", [r.outputs[0]], f"{base}/kv_rowwise/qkv_T", {"perm": [0, 2, 1, 3]})
    s = new("Split", [t.outputs[0], _initializer(g, f"{base}/kv_rowwise.qkv_split",
                                                 np.array([H, kv_heads, kv_heads], np.int64))],
            f"{base}/kv_rowwise/qkv_Split", {"axis": 1}, outs=3)
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
    if proj.op_type == "MatMulNBits" and proj.domain == MS_DOMAIN and len(proj.inputs) <= 5 \
            and proj.inputs[2] is not None and proj.inputs[2].const_value is not None:
        n = int(proj.attributes["N"].value)
        sc = proj.inputs[2].const_value.numpy()
        new = sc.reshape(n, -1).copy()
        new[:n_q] *= np.asarray(scale, new.dtype)
        proj.replace_input_with(2, _initializer(g, f"{base}/kv_rowwise.qkv_scales", new.reshape(sc.shape)))
        return True
    w_in = proj.inputs[1] if proj.op_type == "MatMul" else None
    if w_in is not None and w_in.const_value is not None and len(w_in.const_value.shape) == 2:
        w = proj.inputs[1].const_value.numpy().copy()
        w[:, :n_q] *= np.asarray(scale, w.dtype)
        proj.replace_input_with(1, _initializer(g, f"{base}/kv_rowwise.qkv_weight", w))
        return True
    return False
