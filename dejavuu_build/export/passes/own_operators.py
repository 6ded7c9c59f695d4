"""The static graph of an operator precision (int4op) on our own operators beyond the matmuls:

- each ``GroupQueryAttention`` of the static KV graph (export.passes.static_kv) becomes
  ``dejavuu.attn.GroupAttention`` (kernels/attn.cpp) on the same packed q/k/v, buffers, rotary
  tables, positions and bias, and the two-row floor that GroupQueryAttention needed goes: our
  operator gives a row the same bits alone as among any number of rows, so a lone token runs one
  attention row. Where q, k and v come apart (a per-head norm between the projection and the
  rotary, as Gemma 3's) one Concat packs them: a copy of a few KB a layer, where the separate
  GroupQueryAttention with its key floor cost Gemma-3-270M 1.3x our operator's step;
- per-head q/k RMS norms between the projections and the packing Concat (Gemma 3's q_norm and
  k_norm) become the operator's ``q_norm`` / ``k_norm`` inputs, and the Concat of a fused
  projection's Split outputs the projection itself (_norms_into_operator: a layer's 7-9 layout
  nodes go);
- a sliding window's mask that the graph shapes from its inputs (Gemma 3's local layers) becomes
  the operator's ``window``, once evaluating the mask proves it is that window (_Windows); where
  every mask is then the operator's, rows come apart from slots (_slot_inputs) as static_kv does
  for a graph without such masks;
- each MLP's ``Split -> Sigmoid -> Mul -> Mul`` after its fused gate/up projection becomes one
  ``dejavuu.q41.SwiGLU`` (four nodes a layer: one; elementwise, so row-invariant), and each
  ``Split -> Gelu(approximate="tanh") -> Mul`` (Gemma's) one ``dejavuu.q41.GeGLU`` (three: one).

Why a pass after static_kv and not a flavour of it: everything else about the in-place graph
(slots, fused projections, the buffer binding, the runtime's driver) is the static layout's
unchanged. Applied to the variants of a precision that runs our operators
(precisions.Precision.operators names kernels.attn.DOMAIN): one library holds them all
(kernels.q41.SOURCES). A GroupQueryAttention our operator cannot take (no or interleaved rotary,
a softcap or onnxruntime's own local_window_size, another head size) stays as it was, and the log
says so; so do a mask it cannot prove a window and an MLP of another shape.
"""

from __future__ import annotations

from ... import schema as S
from ...errors import ExportError
from ...kernels import attn, q41
from ...log import logger
from .common import MS_DOMAIN
from .static_kv import FLOOR_PREFIXES, add_slot_inputs, shape_rows_apart

_UNSUPPORTED_ATTRS = ("softcap", "local_window_size", "smooth_softmax", "qk_output")


def to_own_operators(model):
    """``model`` (an ``onnx.ModelProto`` of the static KV flavour) with its GroupQueryAttention
    nodes and SwiGLU activations in our operators where they take them; returns the new proto (the
    input is not changed), or ``model`` itself where nothing was for them."""
    import onnx_ir as ir
    from onnx_ir.passes.common import RemoveUnusedNodesPass

    m = ir.from_proto(model)
    g = m.graph
    gqas = [n for n in g if n.op_type == "GroupQueryAttention" and n.domain == MS_DOMAIN]
    if not gqas:
        raise ExportError("no GroupQueryAttention to put in our attention operator: not a static KV graph")
    done, kept = 0, []
    windows = _Windows(model, g)
    for gqa in gqas:
        why = _refusal(gqa)
        if why:
            kept.append(f"{gqa.name}: {why}")
            continue
        qkv, past_k, past_v = _pack_qkv(g, gqa), gqa.inputs[3], gqa.inputs[4]
        cos, sin, positions, bias = (gqa.inputs[i] for i in (7, 8, 9, 10))
        qkv = _unfloor_gather(qkv)
        heads = int(gqa.attributes["num_heads"].value)
        kv_heads = int(gqa.attributes["kv_num_heads"].value)
        scale = float(gqa.attributes["scale"].value)
        bias, window = windows.of(_unfloor(bias))
        ins = [qkv, past_k, past_v, cos, sin, _unfloor(positions), bias]  # attn.IN_QKV .. IN_BIAS
        # rows decoupled from slots (static_kv): the operator reads its slots' rows and writes its
        # rows' outputs itself, in place of the two Gathers around it (and computes no pad slot's
        # query: pad slots only write their keys)
        to_slots, to_rows = qkv.producer(), _sole_user(gqa.outputs[0], "Gather")
        slotted = (
            _gather_of(to_slots, S.SLOT_ROWS)
            and to_rows is not None
            and len(list(gqa.outputs[0].uses())) == 1
            and to_rows.inputs[0] is gqa.outputs[0]
            and _gather_of(to_rows, S.ROW_SLOTS)
        )
        if slotted:  # + attn.IN_SLOT_ROWS, IN_ROW_SLOTS
            ins = [to_slots.inputs[0], *ins[1:], to_slots.inputs[1], to_rows.inputs[1]]
        assert len(ins) == (attn.IN_ROW_SLOTS if slotted else attn.IN_BIAS) + 1
        nd = ir.node(
            attn.OP,
            ins,
            attributes={"num_heads": heads, "kv_num_heads": kv_heads, "scale": scale}
            | ({"window": window} if window else {}),
            domain=attn.DOMAIN,
            num_outputs=3,
            name=(gqa.name or "/GroupQueryAttention").replace("GroupQueryAttention", "GroupAttention"),
        )
        g.insert_before(gqa, nd)
        outs = list(gqa.outputs)
        # the floor's cut of its extra rows (static_kv._Floor.cut) goes too: ours computes none
        cut = None if slotted else _sole_user(gqa.outputs[0], "Slice")
        cut = cut if cut is not None and _is_floor_cut(cut, gqa.outputs[0]) else None
        if slotted:  # the output Gather's value is ours now
            outs[0] = to_rows.outputs[0]
        elif cut is not None:
            outs[0] = cut.outputs[0]
        for old, new in zip(outs, nd.outputs):
            name, shape, typ = old.name, old.shape, old.type
            for i in [i for i, o in enumerate(g.outputs) if o is old]:
                g.outputs[i] = new
            old.replace_all_uses_with(new)
            old.name = f"{name}__gqa"
            new.name, new.shape, new.type = name, shape, typ
        if slotted:
            g.remove(to_rows, safe=True)
        elif cut is not None:
            g.remove(cut, safe=True)
        g.remove(gqa, safe=True)
        done += 1
    if not done:  # nothing for our operator: the static graph as it was
        logger.info("  our attention operator: none of %d GroupQueryAttention (%s)", len(gqas), "; ".join(kept[:1]))
        return model
    m.opset_imports[attn.DOMAIN] = attn.OPSET
    RemoveUnusedNodesPass()(m)  # the windows' masks, where every layer now windows itself
    slotted = done == len(gqas) and _slot_inputs(g)
    normed = _norms_into_operator(g)
    act = _fuse_swiglu(g)
    geglu = _fuse_geglu(g)
    if act or geglu:
        m.opset_imports.setdefault(q41.DOMAIN, q41.OPSET)
    RemoveUnusedNodesPass()(m)
    if not any(n.domain == MS_DOMAIN for n in g):
        m.opset_imports.pop(MS_DOMAIN, None)
    out = _finish(m)
    logger.info(
        "  our attention operator: %d of %d GroupQueryAttention replaced, no row floor%s%s%s; %d SwiGLU, %d GeGLU; "
        "%d nodes%s",
        done,
        len(gqas),
        f", {windows.found} with the sliding window in the operator" if windows.found else "",
        ", rows decoupled from slots (pad slots cost attention only)" if slotted else "",
        f", {normed} with the per-head q/k norms in the operator" if normed else "",
        act,
        geglu,
        len(out.graph.node),
        "" if not kept else f" (kept: {'; '.join(kept)})",
    )
    return out


class _Windows:
    """A sliding window's mask, proved and moved into the operator. Gemma 3's export shapes its
    local layers' bias in the graph: ``Where(q - k >= W, fill, attention_bias)`` from the positions
    (export.wrapper.DecoderWrapper._sliding_bias). Where a GroupQueryAttention reads such a bias,
    the operator takes ``attention_bias`` itself and ``window`` W (attn.cpp masks the same keys
    with the same fill: the same bits). What proves it is evaluation, not the pattern's shape: the
    subgraph from (position_ids, attention_bias) to the Where, cut out of the model and run in
    onnxruntime over chains and a tree, past and short of the window, must equal the rule
    exactly; anything else stays the bias it was."""

    def __init__(self, model, g):
        self.model = model
        self.found = 0
        self._seen: dict = {}
        inputs = {v.name: v for v in g.inputs}
        self.bias, self.positions = inputs.get(S.ATTENTION_BIAS), inputs.get(S.POSITION_IDS)

    def of(self, bias):
        """(the bias the operator reads, its window or 0)."""
        if bias is self.bias or self.bias is None or self.positions is None:
            return bias, 0
        if bias not in self._seen:
            self._seen[bias] = self._prove(bias)
        w = self._seen[bias]
        if not w:
            return bias, 0
        self.found += 1
        return self.bias, w

    def _prove(self, bias) -> int:
        nd = bias.producer()
        if nd is None or nd.op_type != "Where" or len(nd.inputs) != 3 or nd.inputs[2] is not self.bias:
            return 0
        ge = [x for x in _upstream(nd.inputs[0]) if x.op_type == "GreaterOrEqual"]
        w = ge[0].inputs[1].const_value if len(ge) == 1 and ge[0].inputs[1] is not None else None
        if w is None or w.numpy().size != 1 or int(w.numpy().reshape(())) <= 0:
            return 0
        window = int(w.numpy().reshape(()))
        try:
            return window if _window_rule_holds(self.model, bias, window) else 0
        except Exception as e:  # noqa: BLE001 -- anything the check cannot run is not proved
            logger.debug("  sliding window of %s not proved: %s", bias.name, e)
            return 0


def _upstream(v, limit: int = 64) -> list:
    """The nodes ``v`` is computed from (breadth first, at most ``limit``)."""
    out: list = []
    todo, seen = [v], set()
    while todo and len(out) < limit:
        x = todo.pop(0)
        nd = x.producer() if x is not None else None
        if nd is None or id(nd) in seen:
            continue
        seen.add(id(nd))
        out.append(nd)
        todo.extend(i for i in nd.inputs if i is not None)
    return out


def _window_rule_holds(model, bias, window: int) -> bool:
    """Whether ``bias``, computed from position_ids and attention_bias alone, equals
    ``Where(q - k >= window, fill, attention_bias)`` with the float32 minimum as fill (attn.cpp's
    kFill; past keys at their index, the step's keys at their positions) over chains and a tree,
    each side of the window. Its nodes are cut out of ``model`` (the proto) by name."""
    import numpy as np
    import onnx
    import onnxruntime as ort

    ups = _upstream(bias, limit=256)
    names = {n.name for n in ups}
    if len(names) != len(ups) or "" in names or None in names:
        return False
    nodes = [n for n in model.graph.node if n.name in names]
    used = {x for n in nodes for x in n.input}
    # the mask reads the step's length off its primary input too (rows = slots here): fed zeros
    ins = [i for i in model.graph.input if i.name in used]
    if any(i.name not in (S.POSITION_IDS, S.ATTENTION_BIAS, S.INPUT_IDS, S.INPUTS_EMBEDS) for i in ins):
        return False
    graph = onnx.helper.make_graph(
        nodes,
        "window",
        ins,
        [onnx.helper.make_tensor_value_info(bias.name, onnx.TensorProto.FLOAT, None)],
        [t for t in model.graph.initializer if t.name in used],
    )
    sub = onnx.helper.make_model(graph, opset_imports=model.opset_import, ir_version=model.ir_version)
    sess = ort.InferenceSession(sub.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    fill = None
    for past, depths in ((0, range(5)), (window + 37, range(3)), (2 * window + 5, [0, 1, 1, 2, 2, 3]), (3, [0])):
        pos = past + np.asarray(list(depths), np.int64)
        n = len(pos)
        bias = rng.standard_normal((1, 1, n, past + n)).astype(np.float32)
        feeds = {S.POSITION_IDS: pos[None], S.ATTENTION_BIAS: bias}
        for i in ins:
            if i.name in (S.INPUT_IDS, S.INPUTS_EMBEDS):
                rest = [d.dim_value for d in i.type.tensor_type.shape.dim[2:]]
                kind = np.int64 if i.name == S.INPUT_IDS else np.float32
                feeds[i.name] = np.zeros([1, n, *rest], kind)
        got = sess.run(None, {k: v for k, v in feeds.items() if any(i.name == k for i in ins)})[0]
        keys = np.concatenate([np.arange(past), pos])
        far = pos[:, None] - keys[None, :] >= window
        if got.shape != bias.shape or not np.array_equal(got[0, 0][~far], bias[0, 0][~far]):
            return False
        if far.any():
            vals = np.unique(got[0, 0][far])
            if len(vals) != 1 or not vals[0] <= attn.UNSEEN or (fill is not None and vals[0] != fill):
                return False
            fill = vals[0]
    return fill is not None and fill == np.finfo(np.float32).min  # the operator's fill (attn.cpp kFill)


def _slot_inputs(g) -> bool:
    """Rows decoupled from slots after the fact: where static_kv kept rows = slots because the
    graph shaped its own mask from the slot-shaped inputs (Gemma 3's windows) and every window is
    now the operator's, position_ids and attention_bias reach nothing but our operators, so each
    operator reads its slots' rows (``slot_rows``) and writes its rows (``row_slots``) itself, as
    in a sparse static graph: a tree's pad slots cost attention only, and the batched serving
    graph applies. Returns whether it did."""

    names = {v.name for v in g.inputs}
    if S.SLOT_ROWS in names or S.POSITION_IDS not in names or S.ATTENTION_BIAS not in names:
        return False
    inputs = {v.name: v for v in g.inputs}
    ops = [n for n in g if n.op_type == attn.OP and n.domain == attn.DOMAIN]
    for name in (S.POSITION_IDS, S.ATTENTION_BIAS):
        if any(u.node not in ops for u in inputs[name].uses()) or inputs[name] in g.outputs:
            return False
    if any(len(n.inputs) != attn.IN_BIAS + 1 for n in ops):
        return False
    slot_rows, row_slots = add_slot_inputs(g)
    for n in ops:
        n.resize_inputs(attn.IN_ROW_SLOTS + 1)
        n.replace_input_with(attn.IN_SLOT_ROWS, slot_rows)
        n.replace_input_with(attn.IN_ROW_SLOTS, row_slots)
    shape_rows_apart(inputs)
    return True


def _norms_into_operator(g) -> int:
    """Per-head RMS norms of q and k (``Reshape -> RMSNormalization -> Reshape`` into our
    operator's packing Concat, Gemma 3's q_norm / k_norm) as the operator's ``q_norm`` / ``k_norm``
    inputs, where both are there with one epsilon and a scale of the head size; then the Concat's
    run of a Split's outputs (the fused projection's, in order) is the Split's input, and a Concat
    of one input goes. Returns how many operators took their norms."""
    done = 0
    for op in [n for n in g if n.op_type == attn.OP and n.domain == attn.DOMAIN]:
        cat = op.inputs[attn.IN_QKV].producer()
        if cat is None or cat.op_type != "Concat" or len(cat.inputs) != 3 or len(op.inputs) > attn.IN_ROW_SLOTS + 1:
            continue
        heads = int(op.attributes["num_heads"].value)
        kv_heads = int(op.attributes["kv_num_heads"].value)
        q, k = (_head_norm(cat.inputs[i], n) for i, n in ((0, heads), (1, kv_heads)))
        if q is None or k is None or q[2] != k[2] or q[1].shape != k[1].shape:
            continue
        parts = [q[0], k[0], cat.inputs[2]]
        sp = parts[0].producer()
        if sp is not None and sp.op_type == "Split" and _last_axis(sp) and list(sp.outputs) == parts[: len(sp.outputs)]:
            parts = [sp.inputs[0], *parts[len(sp.outputs) :]]
        if len(parts) == 1:
            op.replace_input_with(attn.IN_QKV, parts[0])
        else:
            for i, v in enumerate(parts):
                cat.replace_input_with(i, v)
            cat.resize_inputs(len(parts))
        op.resize_inputs(attn.IN_K_NORM + 1)
        op.replace_input_with(attn.IN_Q_NORM, q[1])
        op.replace_input_with(attn.IN_K_NORM, k[1])
        op.attributes[attn.NORM_EPSILON] = _float_attr(attn.NORM_EPSILON, q[2])
        done += 1
    return done


def _head_norm(v, heads: int):
    """(the projection's flat output, the norm's scale, its epsilon) where ``v`` is
    ``Reshape(RMSNormalization(Reshape(x, [1, -1, heads, D]), scale [D], axis -1), [0, 0, -1])``
    (the exporter's per-head norm of a [1, n, heads * D] projection: the two Reshapes undo each
    other), else None."""
    flat = v.producer()
    if flat is None or flat.op_type != "Reshape" or len(list(v.uses())) != 1:
        return None
    norm = flat.inputs[0].producer()
    if norm is None or norm.op_type != "RMSNormalization" or len(norm.inputs) != 2:
        return None
    axis = norm.attributes.get("axis")  # absent: ONNX's default, -1
    if axis is not None and int(axis.value) != -1:
        return None
    if "stash_type" in norm.attributes and int(norm.attributes["stash_type"].value) != 1:
        return None
    view = norm.inputs[0].producer()
    if view is None or view.op_type != "Reshape":
        return None
    to_heads, to_flat = (_ints(r.inputs[1]) for r in (view, flat))
    if to_heads is None or to_flat is None or len(to_heads) != 4 or to_heads[:2] != [1, -1] or to_heads[2] != heads:
        return None
    d = to_heads[3]
    allowzero = int(flat.attributes["allowzero"].value) if "allowzero" in flat.attributes else 0
    if d <= 0 or to_flat not in ([0, 0, -1], [0, 0, heads * d]) or allowzero:
        return None
    scale = norm.inputs[1]
    if scale.shape is not None and list(scale.shape) != [d]:
        return None
    eps = float(norm.attributes["epsilon"].value) if "epsilon" in norm.attributes else 1e-5
    return view.inputs[0], scale, eps


def _ints(v) -> list[int] | None:
    """A constant int64 input's values, or None."""
    c = v.const_value if v is not None else None
    return None if c is None else [int(x) for x in c.numpy().reshape(-1)]


def _last_axis(sp) -> bool:
    """Whether Split ``sp`` cuts its input's last axis."""
    axis = int(sp.attributes["axis"].value) if "axis" in sp.attributes else 0
    return axis == -1 or (sp.inputs[0].shape is not None and axis == len(sp.inputs[0].shape) - 1)


def _float_attr(name: str, value: float):
    import onnx_ir as ir

    return ir.AttrFloat32(name, value)


def _fuse_swiglu(g) -> int:
    """Each ``Split(fused gate|up) -> Sigmoid(gate) -> Mul(gate, sigmoid) -> Mul(silu, up)`` as one
    SwiGLU over the fused output (gate first; the Split's two halves equal); returns how many."""
    n = 0
    for sp in [nd for nd in g if nd.op_type == "Split" and len(nd.outputs) == 2]:
        gate, up = sp.outputs
        sig = _sole_user(gate, "Sigmoid")
        if sig is None:
            continue
        muls = [u.node for u in gate.uses() if u.node.op_type == "Mul"]
        if len(muls) != 1 or len(list(gate.uses())) != 2 or set(muls[0].inputs) != {gate, sig.outputs[0]}:
            continue
        silu = muls[0]
        out = _sole_user(silu.outputs[0], "Mul")
        if out is None or set(out.inputs) != {silu.outputs[0], up} or len(list(up.uses())) != 1:
            continue
        inner = (sig.outputs[0], silu.outputs[0], gate, up)  # all go: each read by the pattern alone
        if any(v in g.outputs for v in inner) or len(list(sig.outputs[0].uses())) != 1:
            continue
        if len(list(silu.outputs[0].uses())) != 1:
            continue
        if not _halves(sp):
            continue
        _gated(g, sp, out, q41.SWIGLU_OP, (out, silu, sig, sp))
        n += 1
    return n


def _fuse_geglu(g) -> int:
    """Each ``Split(fused gate|up) -> Gelu(gate, approximate="tanh") -> Mul(gelu, up)`` as one
    GeGLU over the fused output (gate first; the Split's two halves equal); returns how many."""
    n = 0
    for sp in [nd for nd in g if nd.op_type == "Split" and len(nd.outputs) == 2]:
        gate, up = sp.outputs
        gelu = _sole_user(gate, "Gelu")
        if gelu is None or len(list(gate.uses())) != 1 or "approximate" not in gelu.attributes:
            continue
        if gelu.attributes["approximate"].value != "tanh" or len(list(gelu.outputs[0].uses())) != 1:
            continue
        out = _sole_user(gelu.outputs[0], "Mul")
        if out is None or set(out.inputs) != {gelu.outputs[0], up} or len(list(up.uses())) != 1:
            continue
        if any(v in g.outputs for v in (gate, up, gelu.outputs[0])) or not _halves(sp):
            continue
        _gated(g, sp, out, q41.GEGLU_OP, (out, gelu, sp))
        n += 1
    return n


def _halves(sp) -> bool:
    """Whether Split ``sp`` cuts its input's last axis into two equal constant halves."""
    const = sp.inputs[1].const_value if len(sp.inputs) > 1 and sp.inputs[1] is not None else None
    sizes = const.numpy() if const is not None else None
    return sizes is not None and len(sizes) == 2 and sizes[0] == sizes[1] and _last_axis(sp)


def _gated(g, sp, out, op: str, dead: tuple) -> None:
    """One ``op`` (a gated activation of q41's domain) over ``sp``'s input in place of the
    nodes ``dead``, ``out`` (the last of them) giving its output name to the new node's."""
    import onnx_ir as ir

    nd = ir.node(op, [sp.inputs[0]], domain=q41.DOMAIN, name=sp.name.rsplit("/", 2)[0] + "/" + op)
    g.insert_before(sp, nd)
    out.outputs[0].replace_all_uses_with(nd.outputs[0])
    name = out.outputs[0].name
    out.outputs[0].name = f"{name}__mul"
    nd.outputs[0].name = name
    for d in dead:
        g.remove(d, safe=True)


def _gather_of(nd, index: str) -> bool:
    """Whether ``nd`` is a Gather along axis 1 by the graph input named ``index``."""
    return (
        nd is not None
        and nd.op_type == "Gather"
        and len(nd.inputs) > 1
        and nd.inputs[1] is not None
        and nd.inputs[1].name == index
        and ("axis" in nd.attributes and int(nd.attributes["axis"].value) == 1)
    )


def _sole_user(v, op: str):
    uses = [u.node for u in v.uses() if u.node.op_type == op]
    return uses[0] if len(uses) == 1 else None


def _refusal(gqa) -> str | None:
    """Why our operator cannot take this GroupQueryAttention, or None."""
    a = gqa.attributes
    ins = list(gqa.inputs) + [None] * (11 - len(gqa.inputs))
    if (ins[1] is None) != (ins[2] is None):
        return "k without v or v without k"
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


def _pack_qkv(g, gqa):
    """The step's packed q/k/v for our operator: GroupQueryAttention's first input where it is
    packed, else one ``Concat`` of q, k and v before the floor's pads (the layout the fused
    projection gives: q's heads, then k's, then v's, along the last axis). Where each reads the
    slots through its own Gather by the same index, the Concat takes the three rows-shaped inputs
    and one Gather follows it, so the slotted form below applies as for a packed projection."""
    import onnx_ir as ir

    if gqa.inputs[1] is None:
        return gqa.inputs[0]
    parts = [_unfloor(gqa.inputs[i]) for i in range(3)]
    gathers = [p.producer() for p in parts]
    idx = gathers[0].inputs[1] if gathers[0] is not None and gathers[0].op_type == "Gather" else None
    slotted = idx is not None and all(
        nd is not None
        and nd.op_type == "Gather"
        and nd.inputs[1] is idx
        and "axis" in nd.attributes
        and int(nd.attributes["axis"].value) == 1
        for nd in gathers
    )
    base = (gqa.name or "/GroupQueryAttention").rsplit("/", 1)[0]
    head = int(gqa.inputs[3].shape[3])
    heads = int(gqa.attributes["num_heads"].value) + 2 * int(gqa.attributes["kv_num_heads"].value)
    ins = [nd.inputs[0] for nd in gathers] if slotted else parts
    cat = ir.node("Concat", ins, attributes={"axis": -1}, name=f"{base}/own_attn/pack_qkv")
    g.insert_before(gqa, cat)
    cat.outputs[0].name, cat.outputs[0].type = f"{base}/own_attn/qkv", parts[0].type
    cat.outputs[0].shape = _widened(ins[0].shape, heads * head)
    if not slotted:
        return cat.outputs[0]
    take = ir.node("Gather", [cat.outputs[0], idx], attributes={"axis": 1}, name=f"{base}/own_attn/to_slots")
    g.insert_before(gqa, take)
    take.outputs[0].name, take.outputs[0].type = f"{base}/own_attn/qkv_slots", parts[0].type
    take.outputs[0].shape = _widened(parts[0].shape, heads * head)
    return take.outputs[0]


def _widened(shape, width: int):
    """``shape`` ([1, n, d]) with the last axis ``width`` wide, or None where it is not known."""
    import onnx_ir as ir

    return None if shape is None or len(shape) != 3 else ir.Shape([*list(shape)[:2], width])


def _floor_named(nd) -> bool:
    return any(p in (nd.name or "") for p in FLOOR_PREFIXES)


def _is_floor(nd) -> bool:
    return nd is not None and nd.op_type == "Pad" and _floor_named(nd)


def _is_floor_cut(nd, y) -> bool:
    """Whether ``nd`` is the floor's Slice of GroupQueryAttention's output ``y`` (its only use)."""
    return (
        nd.op_type == "Slice"
        and _floor_named(nd)
        and nd.inputs[0] is y
        and len(list(y.uses())) == 1
        and y not in nd.graph.outputs
    )


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
