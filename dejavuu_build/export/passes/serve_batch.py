"""The serving batch graph: a static-KV decoder whose GroupQueryAttention nodes take a batch of
requests. Why: the server verifies several requests' rows in one forward (serve.batch), and each
request's rows still get the bits decoding it alone gives. The build writes it for the static
variant `serve` loads and gates it (build.pipeline); its input names live in schema.

The static graph (export.passes.static_kv) has batch 1 and derives GroupQueryAttention's
``seqlens_k`` from the bias's width, so it can only run one request. This pass, on the graph
alone (onnx, no torch), gives every GQA node a batch of requests: ``seqlens_k`` and
``query_seqlens`` (onnxruntime >= 1.32) from new inputs, each batch entry one request with its
own KV buffer row, its rows right-padded to the step's longest request. Padding rows never enter
the cache and real rows never attend to them; ``query_seqlens = 0`` leaves an idle entry untouched.

Everything else (MatMulNBits, norms, the lm-head) works row by row, and rows are bit-identical
for any row count >= 2, which is what keeps each request's tokens equal to decoding it alone
(gated at build and checked per serving machine by serve.batch.check_exact, and by the tests).

A graph on our attention operator (export.passes.own_operators: the int4op default) gets the same
inputs, but the operator takes the batch itself (kernels/attn.cpp: per-request buffers, positions,
bias block and lengths; slot_rows = pad_index, row_slots = unpad_index), so no gathers are added
and q/k/v stay packed: _batch_own_attention.
"""

from __future__ import annotations

import numpy as np

from ...errors import ContractError
from ...kernels import attn
from ...schema import (
    ATTENTION_BIAS,
    GQA_POSITIONS,
    PAD_INDEX,
    QUERY_SEQLENS,
    ROW_SLOTS,
    SEQLENS_K,
    SLOT_ROWS,
    UNPAD_INDEX,
)
from .common import drop_logits_slice
from .static_kv import KEY_FLOOR_PREFIX, ROW_FLOOR_PREFIX

# com.microsoft.GroupQueryAttention's inputs, by position
QKV_INPUTS = (0, 1, 2)  # query (or packed q/k/v), key, value
PAST_KEY_INPUT = 3  # [B, kv_heads, capacity, head_dim]
SEQLENS_K_INPUT = 5
POSITION_IDS_INPUT = 9
BIAS_INPUT = 10  # attention_bias
QUERY_SEQLENS_INPUT = 16  # onnxruntime >= 1.32

BATCH_DIM = "batch"
# schema.BATCHED_GRAPH_VERSION is recorded with the graph (Manifest.batched): bump it when this pass changes


def to_serve_batch(m, source: str = "the decoder"):
    """Rewrite the static decoder ``m`` (an onnx ModelProto, changed in place and returned) into
    its batched flavour; ``source`` names it in errors.

    Rows stay packed ``[1, T]`` (T = all requests' rows) through every row-wise op, so the
    projections, norms and lm-head cost the real rows only; each GroupQueryAttention gathers its
    q/k/v rows into the padded ``[B, S]`` layout it needs (``pad_index``), and its output is
    gathered back (``unpad_index``). The bias becomes ``[B, 1, S, W]``, one block per request."""
    import onnx
    from onnx import helper

    g = m.graph
    drop_logits_slice(g)  # every request's rows get logits
    gqa = [n for n in g.node if n.op_type == "GroupQueryAttention" and n.domain == "com.microsoft"]
    own = [n for n in g.node if n.op_type == attn.OP and n.domain == attn.DOMAIN]
    if own and gqa:
        raise ContractError(f"{source} mixes GroupQueryAttention and our attention operator: no batched form")
    if own:
        return _batch_own_attention(m, own, source)
    if not gqa:
        raise ContractError(
            f"{source} has no GroupQueryAttention: batched serving needs a static-KV variant (`--kv-layouts static`)"
        )
    if any(KEY_FLOOR_PREFIX in n.name for n in g.node):
        raise ContractError(
            f"{source} feeds its GroupQueryAttention a key floor (head size above 128: export.passes.key_floor), "
            f"which the batched serving graph does not carry over per request"
        )
    _strip_row_floor(g)
    _batched_inputs(g, source)
    shapes = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in g.input}
    row_shapes: dict[int, str] = {}
    # The static graph's own row/slot gathers (export.passes.static_kv) do for one request what
    # pad_index / unpad_index do for the batch: they are bypassed and the batched gathers take their place.
    producer = {o: nd for nd in g.node for o in nd.output}
    users: dict[str, list] = {}
    for nd in g.node:
        for i in nd.input:
            users.setdefault(i, []).append(nd)
    slot_gathers = set()
    body = []
    for n in g.node:
        if id(n) in slot_gathers:
            continue
        if n not in gqa:
            body.append(n)
            continue
        ins = list(n.input) + [""] * max(0, QUERY_SEQLENS_INPUT + 1 - len(n.input))
        for j in QKV_INPUTS:
            feeder = producer.get(ins[j])
            if feeder is not None and feeder.op_type == "Gather" and feeder.input[1] == SLOT_ROWS:
                ins[j] = feeder.input[0]
        back = users.get(n.output[0], [])
        if len(back) == 1 and back[0].op_type == "Gather" and back[0].input[1] == ROW_SLOTS:
            slot_gathers.add(id(back[0]))
            n.output[0] = back[0].output[0]
        if ins[QUERY_SEQLENS_INPUT]:
            raise ContractError(f"{n.name} already takes query_seqlens")
        for j in QKV_INPUTS:  # packed qkv, or separate q, k, v: [1, T, d] -> [B, S, d]
            if ins[j]:
                flat, padded = f"{n.name}/batched/flat{j}", f"{n.name}/batched/padded{j}"
                body.append(helper.make_node("Squeeze", [ins[j], "batched.axis0"], [flat], name=flat))
                body.append(helper.make_node("Gather", [flat, PAD_INDEX], [padded], name=padded, axis=0))
                ins[j] = padded
        ins[SEQLENS_K_INPUT], ins[POSITION_IDS_INPUT], ins[QUERY_SEQLENS_INPUT] = (
            SEQLENS_K,
            GQA_POSITIONS,
            QUERY_SEQLENS,
        )
        if ins[BIAS_INPUT] != ATTENTION_BIAS:
            raise ContractError(f"{n.name} takes a bias other than the {ATTENTION_BIAS} input")
        del n.input[:]
        n.input.extend(ins)
        out = n.output[0]
        padded_out = f"{n.name}/batched/out"
        n.output[0] = padded_out
        width = _attr(n, "num_heads") * shapes[ins[PAST_KEY_INPUT]][3]  # query heads x head_dim (from past_key)
        if width not in row_shapes:
            row_shapes[width] = f"batched.rows.{width}"
            g.initializer.append(onnx.numpy_helper.from_array(np.array([-1, width], np.int64), row_shapes[width]))
        rows = f"{n.name}/batched/rows"
        body.append(n)
        body.append(helper.make_node("Reshape", [padded_out, row_shapes[width]], [rows], name=rows))
        body.append(helper.make_node("Gather", [rows, UNPAD_INDEX], [out], name=f"{n.name}/batched/unpad", axis=0))
    del g.node[:]
    g.node.extend(body)
    _prune(g)
    _drop_unused_inputs(g)  # e.g. position_ids, now read by GQA only
    return m


def _batched_inputs(g, source: str) -> None:
    """The batch's inputs (the same for both attention forms: one driver, layouts.static.StaticBatch,
    feeds them) and a batch dimension on the bias, the pasts and the presents."""
    import onnx
    from onnx import TensorProto, helper

    names = {i.name for i in g.input}
    new_inputs = (SEQLENS_K, QUERY_SEQLENS, PAD_INDEX, UNPAD_INDEX, GQA_POSITIONS)
    if any(n in names for n in new_inputs):
        raise ContractError(f"{source} already has batched inputs")
    bias = next((i for i in g.input if i.name == ATTENTION_BIAS), None)
    if bias is None:
        raise ContractError(f"{source} has no {ATTENTION_BIAS} input")
    for v in (
        [bias]
        + [i for i in g.input if i.name.startswith("past_")]
        + [o for o in g.output if o.name.startswith("present")]
    ):
        d0 = v.type.tensor_type.shape.dim[0]
        d0.ClearField("dim_value")
        d0.dim_param = BATCH_DIM
    del g.value_info[:]  # shapes inferred at batch 1 would contradict the new layout
    g.input.extend(
        [
            helper.make_tensor_value_info(SEQLENS_K, TensorProto.INT32, [BATCH_DIM]),
            helper.make_tensor_value_info(QUERY_SEQLENS, TensorProto.INT32, [BATCH_DIM]),
            helper.make_tensor_value_info(PAD_INDEX, TensorProto.INT64, [BATCH_DIM, "S"]),
            helper.make_tensor_value_info(UNPAD_INDEX, TensorProto.INT64, [1, "N"]),
            helper.make_tensor_value_info(GQA_POSITIONS, TensorProto.INT64, [BATCH_DIM, "S"]),
        ]
    )
    g.initializer.append(onnx.numpy_helper.from_array(np.array([0], np.int64), "batched.axis0"))


def _drop_unused_inputs(g) -> None:
    used = {i for nd in g.node for i in nd.input}
    for v in [i for i in g.input if i.name not in used]:
        g.input.remove(v)


def _batch_own_attention(m, nodes: list, source: str):
    """The batched flavour of a graph on our attention operator: the operator takes the batch
    itself (kernels/attn.cpp: seqlens_k and query_seqlens per request, buffers, positions and bias
    per request, slot_rows = pad_index, row_slots = unpad_index), so q/k/v stay packed ``[1, T]``
    and its output is already in row order: no gathers around it. A request's rows get the bits
    they get alone (the operator computes every row alone, in one order)."""
    from onnx import helper

    g = m.graph
    _batched_inputs(g, source)
    rows = "batched/unpad_rows"  # unpad_index [1, T] as the operator's row_slots [T]
    g.node.insert(0, helper.make_node("Squeeze", [UNPAD_INDEX, "batched.axis0"], [rows], name=rows))
    for n in nodes:
        ins = list(n.input)
        normed = len(ins) == attn.IN_K_NORM + 1 and ins[attn.IN_SEQLENS_K] == ins[attn.IN_QUERY_SEQLENS] == ""
        if (
            (len(ins) != attn.IN_ROW_SLOTS + 1 and not normed)
            or ins[attn.IN_SLOT_ROWS] != SLOT_ROWS
            or ins[attn.IN_ROW_SLOTS] != ROW_SLOTS
        ):
            raise ContractError(
                f"{n.name} does not read its slots' rows itself (slot_rows, row_slots): no batched form"
            )
        if ins[attn.IN_BIAS] != ATTENTION_BIAS:
            raise ContractError(f"{n.name} takes a bias other than the {ATTENTION_BIAS} input")
        ins[attn.IN_POSITIONS], ins[attn.IN_SLOT_ROWS], ins[attn.IN_ROW_SLOTS] = GQA_POSITIONS, PAD_INDEX, rows
        ins += [""] * (attn.IN_QUERY_SEQLENS + 1 - len(ins))  # per-head norms (Gemma's), where there, stay
        ins[attn.IN_SEQLENS_K], ins[attn.IN_QUERY_SEQLENS] = SEQLENS_K, QUERY_SEQLENS
        del n.input[:]
        n.input.extend(ins)
    _prune(g)
    _drop_unused_inputs(g)  # position_ids, slot_rows, row_slots
    return m


def _strip_row_floor(g) -> None:
    """Bypass the static graph's row floor (static_kv._Floor): the batch driver feeds every request
    at least two attention slots itself (layouts.static.StaticBatch), so a request's rows meet the
    same kernel path as when the single graph pads a lone row; the floor's rows would be padding
    per batch, not per request. Its Pad/Slice nodes are bypassed and removed, the rest of it (the
    row count it adds, zero here) is left to _prune."""
    floor = [n for n in g.node if ROW_FLOOR_PREFIX in n.name and n.op_type in ("Pad", "Slice")]
    bypass = {n.output[0]: n.input[0] for n in floor}
    for n in floor:
        g.node.remove(n)
    for n in g.node:
        for j, x in enumerate(n.input):
            while x in bypass:
                x = bypass[x]
            n.input[j] = x


def _attr(node, name: str) -> int:
    for a in node.attribute:
        if a.name == name:
            return int(a.i)
    raise ContractError(f"{node.name} has no {name} attribute")


def _prune(g) -> None:
    """Drop the nodes whose outputs nothing reads any more (the old seqlens_k computation)."""
    while True:
        used = {i for n in g.node for i in n.input} | {o.name for o in g.output}
        dead = [n for n in g.node if not any(o in used for o in n.output)]
        if not dead:
            return
        for n in dead:
            g.node.remove(n)
