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
    input_ids [1, R] | inputs_embeds [1, R, H]; logits [1, R - logits_from, V], hidden_states [1, R, H]
    logits_from [1]                int64, the first row given logits (0: all; common.slice_logits)
    slot_rows [S], row_slots [R]   int64, as above
    position_ids [1, S]
    attention_bias [1, 1, S, P+S]  still past+new wide: the past length P is read off its shape
    past_key_values.{i}.key|value  [1, KV, capacity, D]   (the shared buffer)
    present.{i}.key|value          [1, KV, capacity, D]   (the same buffer, bound in place)
GQA applies its own causal mask among the new rows on top of the bias, so tree nodes must come
in topological order (parents before children), which the runtime guarantees.

A lone token is one graph row: GroupQueryAttention's one-row kernel gives other bits than its
multi-row one, so the graph gives every GQA at least ``schema.GQA_MIN_ROWS`` query rows itself (a
second slot after a lone one, reading its row again through ``slot_rows``, its output never read:
``_Floor``), and only the attention pays for it. Measured on SmolLM2-135M int4 (Intel Xeon,
AVX-512 + AMX, 2 threads, past 256, quiet, 7 interleaved rounds): a one-token step 1.01x the
rowwise flavour's, 2/4/8 rows 0.94/0.89/0.88x; before the floor a lone token ran every op on two
rows (the runtime's pad row: 1.17-1.20x rowwise's one-token step, loaded runs).
"""

from __future__ import annotations

import numpy as np

from ... import schema as S
from ...errors import ExportError
from ...log import logger
from .common import MS_DOMAIN, concat_kv, drop, finish_layout, initializer, insert, query_heads, take_over_present
from .fusions import fuse_siblings, fuse_skip_norm
from .key_floor import KEY_FLOOR, NEG, needs_key_floor
from .row_guard import strip_row_guard


def to_static_kv(model, capacity: int, *, fuse: bool = True):
    """Rewrite an ``onnx.ModelProto`` decoder of the concat flavour into the in-place flavour."""
    import onnx_ir as ir
    from onnx_ir.passes.common import RemoveUnusedNodesPass

    if capacity < 2:
        raise ExportError("--max-context must be at least 2")
    model = strip_row_guard(model)  # the pass rewrites the graph as exported; the guard comes last
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
        fuse_siblings(g)
        fuse_skip_norm(g)

    def new(op, ins, name, anchor, attrs=None, domain="", outs=1):
        return insert(g, op, ins, name, anchor, attrs, domain, outs)

    # total = P + N from the bias's last dim; seqlens_k = total - 1 (int32), as GQA wants them.
    first = g.node(0)
    total64 = new("Shape", [bias], "/kv_static/Shape", first, {"start": 3, "end": 4}).outputs[0]
    head_dims = {int(concat_kv(att, inputs)[0].inputs[0].shape[3]) for att in attn_nodes}
    floor = _Floor(g, bias, total64, first, keys=capacity >= KEY_FLOOR and any(map(needs_key_floor, head_dims)))
    total64 = floor.total
    total32 = new("Cast", [total64], "/kv_static/Cast", first, {"to": ir.DataType.INT32}).outputs[0]
    one = initializer(g, "kv_static.one", np.array([1], np.int32))
    seqlens = new("Sub", [total32, one], "/kv_static/SeqlensK", first).outputs[0]
    axis0 = initializer(g, "kv_static.axis0", np.array([0], np.int64))
    total = new("Squeeze", [total32, axis0], "/kv_static/Total", first).outputs[0]
    flat = initializer(g, "kv_static.flat", np.array([0, 0, -1], np.int64))
    cos_sin: dict[tuple[bytes, bytes], tuple] = {}  # (cos, sin) bytes -> their initializers
    slot_gathers: list = []
    # Rows (tokens) and slots (attention positions) are decoupled: row-wise work runs on the real
    # rows only; each GQA gathers its q/k/v rows into the slot layout and gathers its output back.
    slot_rows, row_slots = add_slot_inputs(g)

    for att in attn_nodes:
        q4 = att.inputs[0]
        att_bias = att.inputs[3] if len(att.inputs) > 3 else None
        if att_bias is None or (len(att.inputs) > 4 and any(x is not None for x in att.inputs[4:])):
            raise ExportError(f"{att.name}: unknown Attention form (no mask input, or past inputs of its own)")
        cat_k, cat_v = concat_kv(att, inputs)
        past_k, k4 = cat_k.inputs[0], cat_k.inputs[1]
        past_v, v4 = cat_v.inputs[0], cat_v.inputs[1]
        kv_heads, head_dim = past_k.shape[1], past_k.shape[3]
        base = att.name.rsplit("/", 1)[0]
        rq, rk = q4.producer(), k4.producer()
        rotary = (
            rq is not None and rq.op_type == "RotaryEmbedding" and rk is not None and rk.op_type == "RotaryEmbedding"
        )
        attrs: dict = {"kv_num_heads": int(kv_heads)}
        if rotary:
            if len(rq.inputs) > 3 and rq.inputs[3] is not None:
                raise ExportError(f"{att.name}: RotaryEmbedding with position_ids of its own is not supported")
            if rq.attributes.get("rotary_embedding_dim") is not None and int(
                rq.attributes["rotary_embedding_dim"].value
            ) not in (0, head_dim):
                raise ExportError(f"{att.name}: partial rotary embeddings are not supported by the static flavour")
            cq, sq = tables[rq.inputs[1].name], tables[rq.inputs[2].name]
            if not (np.array_equal(cq, tables[rk.inputs[1].name]) and np.array_equal(sq, tables[rk.inputs[2].name])):
                raise ExportError(f"{att.name}: q and k use different rotary tables")
            keys = (cq.tobytes(), sq.tobytes())  # one table per distinct content (layers share them)
            if keys not in cos_sin:
                i = len(cos_sin)
                cos_sin[keys] = (
                    initializer(g, f"kv_static.cos_cache.{i}", cq),
                    initializer(g, f"kv_static.sin_cache.{i}", sq),
                )
            cos, sin = cos_sin[keys]
            attrs.update(
                do_rotary=1,
                rotary_interleaved=int(rq.attributes["interleaved"].value) if "interleaved" in rq.attributes else 0,
            )
            q4, k4 = rq.inputs[0], rk.inputs[0]
        else:
            cos = sin = None
        q3, k3, v3 = (_packed(g, x, flat, f"{base}/kv_static/{w}", att) for x, w in ((q4, "q"), (k4, "k"), (v4, "v")))
        heads = query_heads(att, q3, head_dim)
        attrs["num_heads"] = heads
        for a in ("scale", "softcap"):
            if a in att.attributes and float(att.attributes[a].value):
                attrs[a] = float(att.attributes[a].value)
        attrs.setdefault("scale", float(1.0 / np.sqrt(head_dim)))
        qkv = _packed_qkv(g, q3, k3, v3) if fuse else None
        ins = [qkv, None, None] if qkv is not None else [q3, k3, v3]
        to_slots = [
            None if x is None else new("Gather", [x, slot_rows], f"{base}/kv_static/to_slots_{j}", att, {"axis": 1})
            for j, x in enumerate(ins)
        ]
        slot_gathers += [x for x in to_slots if x is not None]
        ins = [None if x is None else x.outputs[0] for x in to_slots]
        positions = position_ids if rotary else None
        # extra query rows after the step's own: GQA runs S.GQA_MIN_ROWS rows at least (and KEY_FLOOR keys)
        ins = [None if x is None else floor.rows(x, f"{base}/{floor.prefix}{w}", att) for x, w in zip(ins, "qkv")]
        positions = None if positions is None else floor.rows(positions, f"/{floor.prefix}positions", att)
        att_bias = floor.bias(att_bias, att)
        gqa = new(
            "GroupQueryAttention",
            ins + [past_k, past_v, seqlens, total, cos, sin, positions, att_bias],
            f"{base}/GroupQueryAttention",
            att,
            attrs,
            MS_DOMAIN,
            3,
        )
        gqa.outputs[0].name = f"{base}/gqa_out"
        gqa_out = floor.cut(gqa.outputs[0], f"{base}/{floor.prefix}out", att)
        to_rows = new("Gather", [gqa_out, row_slots], f"{base}/kv_static/to_rows", att, {"axis": 1})
        slot_gathers.append(to_rows)
        out3 = to_rows.outputs[0]
        out3.name = f"{base}/gqa_rows"
        # Attention gave [B, H, N, D]; its consumer is Transpose(0,2,1,3) + Reshape to [B, N, H*D],
        # which GQA's output already is.
        t_user = _only_user(att.outputs[0])
        r_user = (
            _only_user(t_user.outputs[0])
            if t_user is not None
            and t_user.op_type == "Transpose"
            and list(t_user.attributes["perm"].value) == [0, 2, 1, 3]
            else None
        )
        if r_user is not None and r_user.op_type == "Reshape":
            r_user.outputs[0].replace_all_uses_with(out3)
        else:
            shp = initializer(g, f"{base}/kv_static/unpack", np.array([0, 0, heads, head_dim], np.int64))
            r = new("Reshape", [out3, shp], f"{base}/kv_static/out_R", att)
            t = new("Transpose", [r.outputs[0]], f"{base}/kv_static/out_T", att, {"perm": [0, 2, 1, 3]})
            att.outputs[0].replace_all_uses_with(t.outputs[0])
        take_over_present(g, att, (cat_k, cat_v), gqa.outputs[1:3], ir.Shape([1, kv_heads, capacity, head_dim]))
    m.opset_imports[MS_DOMAIN] = 1
    RemoveUnusedNodesPass()(m)
    sparse = _slot_inputs_reach_attention_only(g, (bias, position_ids))
    if sparse:
        shape_rows_apart(inputs)
        floor.fold_into_slots(slot_rows, slot_gathers)
    else:
        _undo_slot_gathers(g, slot_gathers, (slot_rows, row_slots))
    out = finish_layout(m, S.KV_STATIC, capacity)
    logger.info(
        "  static KV flavour: %d GroupQueryAttention, capacity %d, %d nodes, tree pad slots %s",
        len(attn_nodes),
        capacity,
        len(out.graph.node),
        "cost attention only" if sparse else "are whole rows (the graph shapes a mask by the rows)",
    )
    return out


def add_slot_inputs(g):
    """The two index inputs that decouple rows from slots (schema.SLOT_ROWS, ROW_SLOTS), added."""
    import onnx_ir as ir

    slot_rows = ir.Value(name=S.SLOT_ROWS, shape=ir.Shape(["slots"]), type=ir.TensorType(ir.DataType.INT64))
    row_slots = ir.Value(name=S.ROW_SLOTS, shape=ir.Shape(["rows"]), type=ir.TensorType(ir.DataType.INT64))
    g.inputs.extend([slot_rows, row_slots])
    return slot_rows, row_slots


def shape_rows_apart(inputs: dict) -> None:
    """A graph with rows apart from slots: positions and bias per slot, its primary input per row."""
    import onnx_ir as ir

    inputs[S.POSITION_IDS].shape = ir.Shape([1, "slots"])
    inputs[S.ATTENTION_BIAS].shape = ir.Shape([1, 1, "slots", "total"])
    primary = inputs.get(S.INPUT_IDS) or inputs.get(S.INPUTS_EMBEDS)
    if primary is not None and primary.shape is not None:
        primary.shape = ir.Shape([1, "rows", *list(primary.shape)[2:]])


def _slot_inputs_reach_attention_only(g, slot_shaped) -> bool:
    """Rows may differ from slots only if the slot-shaped inputs (bias, positions) feed nothing
    but GroupQueryAttention and the bias's Shape: a graph that shapes its own mask from them
    (Gemma 3's sliding windows) mixes them with row-shaped tensors, and keeps rows = slots."""
    for v in slot_shaped:
        for use in v.uses():
            nd = use.node
            if not (nd.op_type == "GroupQueryAttention" or nd.name == "/kv_static/Shape" or _floor_node(nd, v)):
                return False
    return True


def _floor_node(nd, v) -> bool:
    """Whether ``nd`` is the floor's (it pads ``v`` to GroupQueryAttention, or reads its shape)."""
    if not any(p in (nd.name or "") for p in FLOOR_PREFIXES):
        return False
    return nd.op_type == "Shape" or all(
        u.node.op_type == "GroupQueryAttention" or _floor_node(u.node, u.node.outputs[0]) for u in nd.outputs[0].uses()
    )


KEY_FLOOR_PREFIX = "kv_static/key_floor/"  # a floor on keys too (head size > 128): serve_batch refuses it
ROW_FLOOR_PREFIX = "kv_static/row_floor/"  # a floor on rows only: serve_batch strips it (its driver pads)
FLOOR_PREFIXES = (KEY_FLOOR_PREFIX, ROW_FLOOR_PREFIX)


class _Floor:
    """GroupQueryAttention over at least schema.GQA_MIN_ROWS query rows and, with ``keys``,
    KEY_FLOOR keys (export.passes.key_floor): while a step has fewer rows, or its past + rows is
    short of the key floor, ``extra`` query rows follow the step's own (zeros; in a sparse graph
    the first slot's row again: fold_into_slots), so the kernel runs its multi-row path and its
    total (past + rows + extra) reaches the key floor, while its write position (total - rows -
    extra) is still the past. The extra rows attend causally after every real row, whose scores
    therefore see nothing of them but the key count; their K/V land beyond the context (ignored,
    then overwritten; the runtime keeps one position of room: layouts.static) and their output is
    cut off. Costs attention rows only: a lone token's step, and steps while the context is under
    the key floor."""

    def __init__(self, g, bias, total64, anchor, *, keys: bool):
        import onnx_ir as ir

        self.g = g
        self.prefix = KEY_FLOOR_PREFIX if keys else ROW_FLOOR_PREFIX
        one = (1,)
        zero = initializer(g, "kv_static.key_floor.zero", np.zeros(one, np.int64))
        self.neg = initializer(g, "kv_static.key_floor.neg", np.array(NEG, np.float32))
        self.axis = {a: initializer(g, f"kv_static.key_floor.axis{a}", np.array([a], np.int64)) for a in (1, 2, 3)}
        self.zero = zero
        self.slots = self._new("Shape", [bias], "Slots", anchor, {"start": 2, "end": 3})
        rows = initializer(g, "kv_static.row_floor", np.array([S.GQA_MIN_ROWS], np.int64))
        short = self._new("Sub", [rows, self.slots], "RowsShort", anchor)
        if keys:
            f = initializer(g, "kv_static.key_floor", np.array([KEY_FLOOR], np.int64))
            keys_short = self._new("Sub", [f, total64], "Sub", anchor)
            short = self._new("Max", [keys_short, short], "Short", anchor)
        extra = self._new("Max", [short, zero], "Max", anchor)
        self.total = self._new("Add", [total64, extra], "Total", anchor)
        after = initializer(g, "kv_static.key_floor.after", np.array([0, 1], np.int64))
        self.pads = self._new("Mul", [extra, after], "Pads", anchor)  # [0, extra]: rows after the step's own
        self._done: dict[ir.Value, ir.Value] = {}  # a value -> its padded twin
        self._cuts: list = []  # the Slice nodes cutting the extra rows off each GQA's output

    def _new(self, op, ins, name, anchor, attrs=None):
        name = name if name.startswith("/") else f"/{self.prefix}{name}"
        return insert(self.g, op, ins, name, anchor, attrs).outputs[0]

    def rows(self, x, name: str, anchor):
        """``x`` ([1, slots, ...]) with the extra rows (zeros) after its own."""
        if x not in self._done:
            self._done[x] = self._new("Pad", [x, self.pads, None, self.axis[1]], name, anchor)
        return self._done[x]

    def bias(self, b, anchor):
        """``b`` ([., ., slots, total]) with the extra keys masked for every row and the extra rows
        after (zero: they attend causally)."""
        if b not in self._done:
            i = len(self._done)
            cols = self._new("Pad", [b, self.pads, self.neg, self.axis[3]], f"bias_{i}_keys", anchor)
            self._done[b] = self._new("Pad", [cols, self.pads, None, self.axis[2]], f"bias_{i}_rows", anchor)
        return self._done[b]

    def cut(self, y, name: str, anchor):
        """GroupQueryAttention's output ``y`` without the extra rows."""
        out = self._new("Slice", [y, self.zero, self.slots, self.axis[1]], name, anchor)
        self._cuts.append(out.producer())
        return out

    def fold_into_slots(self, slot_rows, gathers) -> None:
        """Where every GQA reads its q/k/v through the slot Gathers (a sparse graph), the extra
        rows come from ONE padded ``slot_rows`` (the extra slots read row 0, whose K/V they write
        past the context as a zero row would) instead of a Pad per layer, and each GQA's output
        goes straight to its ``row_slots`` Gather, which picks the real rows, instead of a Slice:
        two nodes per layer fewer (SmolLM2: 60 of 856)."""
        axis0 = initializer(self.g, "kv_static.key_floor.axis0", np.array([0], np.int64))
        padded = self._new("Pad", [slot_rows, self.pads, None, axis0], "slot_rows", self.g.node(0))
        for nd in gathers:
            if nd.inputs[1] is not slot_rows:
                continue  # the output Gathers (row_slots)
            nd.replace_input_with(1, padded)
            twin = self._done.pop(nd.outputs[0], None)
            if twin is not None:
                pad = twin.producer()
                twin.replace_all_uses_with(nd.outputs[0])
                self.g.remove(pad, safe=True)
        for cut in self._cuts:
            cut.outputs[0].replace_all_uses_with(cut.inputs[0])
            self.g.remove(cut, safe=True)
        self._cuts = []


def _undo_slot_gathers(g, gathers, inputs) -> None:
    for nd in gathers:
        nd.outputs[0].replace_all_uses_with(nd.inputs[0])
    drop(g, gathers)
    for v in inputs:
        g.inputs.remove(v)


def _only_user(v):
    uses = list(v.uses())
    return uses[0].node if len(uses) == 1 else None


def _packed(g, x4, flat, name, anchor):
    """[B, heads, N, D] -> [B, N, heads*D]: reuse the 3D tensor the exporter reshaped and
    transposed (``Transpose(Reshape(y3))``), or reshape what is there."""
    import onnx_ir as ir

    normed = _norm_before_heads_major(g, x4, name, anchor)
    if normed is not None:
        nd = ir.node("Reshape", [normed, flat], name=f"{name}_R")
        g.insert_before(anchor, nd)
        return nd.outputs[0]
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


def _norm_before_heads_major(g, x4, name, anchor):
    """Where ``x4`` is a per-head norm over the last axis of a heads-major ``Transpose(0,2,1,3)``
    (Gemma 3's q_norm and k_norm before the rotary), the same norm on the tokens-major tensor
    before that Transpose ([B, N, heads, D]): each vector of D normalised alone, so the same bits,
    and neither that Transpose nor the one back to [B, N, heads*D] runs (4 a layer). None where
    the pattern is not there."""
    import onnx_ir as ir

    nd = x4.producer()
    if nd is None or nd.op_type != "RMSNormalization" or nd.domain not in ("", "ai.onnx"):
        return None
    axis = int(nd.attributes["axis"].value) if "axis" in nd.attributes else -1
    scale = nd.inputs[1] if len(nd.inputs) > 1 else None
    if axis not in (-1, 3) or scale is None or scale.shape is None or len(scale.shape) != 1:
        return None
    t = nd.inputs[0].producer()
    if t is None or t.op_type != "Transpose" or list(t.attributes["perm"].value) != [0, 2, 1, 3]:
        return None
    twin = ir.node(
        "RMSNormalization",
        [t.inputs[0], scale],
        attributes={k: a.value for k, a in nd.attributes.items()},
        name=f"{name}_norm",
    )
    g.insert_before(anchor, twin)
    twin.outputs[0].name = f"{name}_normed"
    return twin.outputs[0]


def _packed_qkv(g, q3, k3, v3):
    """If q, k and v are the three outputs of one fused projection's Split, the fused output."""
    sp = q3.producer()
    if sp is None or sp.op_type != "Split" or k3.producer() is not sp or v3.producer() is not sp:
        return None
    if list(sp.outputs) != [q3, k3, v3]:
        return None
    return sp.inputs[0]


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
        onnx.helper.make_graph(
            keep,
            "rotary_tables",
            [pos_in],
            [onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None) for n in names],
            [i for i in model.graph.initializer if i.name in used],
        ),
        opset_imports=list(model.opset_import),
        ir_version=model.ir_version,
    )
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(sub.SerializeToString(), so, providers=["CPUExecutionProvider"])
    outs = sess.run(names, {S.POSITION_IDS: np.arange(capacity, dtype=np.int64)[None]})
    return {n: np.ascontiguousarray(o.reshape(capacity, -1), dtype=np.float32) for n, o in zip(names, outs)}
