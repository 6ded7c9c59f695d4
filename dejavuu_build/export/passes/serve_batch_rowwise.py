"""The serving batch graph of a rowwise decoder: the rowwise graph (export.passes.rowwise_kv) taking
a batch of B requests, one KV buffer row each, so the server verifies several requests' rows in
one forward and every row keeps the bits decoding its request alone gives (serve.batch).

Why it can: the rowwise graph already runs every query row as a head of its own (one-row attention
kernels whatever the step's rows), and everything around attention works row by row (MatMulNBits,
norms, RoPE, the lm-head), with a row guard (export.passes.row_guard) where an op's lone row would
differ. A batch adds a leading axis and nothing that mixes requests:

    input_ids [B, R] | inputs_embeds [B, R, H]; position_ids [B, R]; logits, hidden_states [B, R, ...]
    attention_bias [B, 1, R, L]   each request's rows over its own buffer row
    kv_write_index [B]            each request's past length (TensorScatter-24 writes per batch entry)
    past_key_values.{i}.* / present.{i}.*  [B, KV, L, D], one buffer bound as both

A request with fewer rows than the step's longest is right-padded: its pad rows are real graph
rows whose K/V land past the request's length (masked for its real rows, overwritten by its next
step), so they never count. L is shared by the batch; a row's bits do not depend on L as long as
it is a multiple of the buffer's tile (layouts.rowwise.TILE), which the gate checks
(serve.batch.measure_exact: requests alone at their own L, side by side at a larger one).

The rewrite itself: every batch-1 dimension of the graph's I/O becomes ``batch``, and every
Reshape of the forward's values whose constant target shape starts with the batch's 1 copies
dim 0 instead (0, ``allowzero`` off). A graph whose row-guard record says it is not
length-invariant on the machine that measured it is refused: its rows would get other bits side
by side than alone. On the graph alone (onnx, no torch).
"""

from __future__ import annotations

import json

import numpy as np

from ... import schema as S
from ...errors import ContractError
from .common import drop_logits_slice

BATCH_DIM = "batch"
BATCH_INPUTS = (S.INPUT_IDS, S.INPUTS_EMBEDS, S.POSITION_IDS, S.ATTENTION_BIAS, S.KV_WRITE_INDEX)
SERVE_BATCH_KEY = "dejavuu.serve_batch"  # metadata: the pass's record (the layout it batched)


def to_serve_batch_rowwise(m, source: str = "the decoder"):
    """Rewrite the rowwise decoder ``m`` (an onnx ModelProto, changed in place and returned) into
    its batched flavour; ``source`` names it in errors (ContractError: the pass does not apply)."""
    from onnx import numpy_helper

    g = m.graph
    drop_logits_slice(g)  # every request's rows get logits
    meta = {p.key: p.value for p in m.metadata_props}
    if meta.get(S.KV_LAYOUT_KEY) != S.KV_ROWWISE:
        raise ContractError(f"{source} is not a rowwise-KV graph (its layout: {meta.get(S.KV_LAYOUT_KEY)!r})")
    guard = S.row_guard_info(meta)
    if guard.get("length_invariant") is not True:
        raise ContractError(
            f"{source} is not length-invariant on the machine that measured it (row guard: "
            f"{guard.get('not_exact') or guard or 'none recorded'}): side by side its rows would get other bits"
        )
    names = {i.name for i in g.input}
    if S.KV_WRITE_INDEX not in names or S.ATTENTION_BIAS not in names:
        raise ContractError(f"{source} has no {S.KV_WRITE_INDEX} / {S.ATTENTION_BIAS} input: not a rowwise graph")
    if any(n.op_type == "GroupQueryAttention" for n in g.node):
        raise ContractError(f"{source} has GroupQueryAttention: not a rowwise graph")
    kv_in = [i for i in g.input if i.name.startswith("past_")]
    batched_io = [i for i in g.input if i.name in BATCH_INPUTS] + kv_in + list(g.output)
    for v in batched_io:
        dims = v.type.tensor_type.shape.dim
        if not dims or (dims[0].HasField("dim_value") and dims[0].dim_value != 1):
            raise ContractError(f"{source}: {v.name} has no batch-1 leading dimension")
        dims[0].ClearField("dim_value")
        dims[0].dim_param = BATCH_DIM
    del g.value_info[:]  # shapes inferred at batch 1 would contradict the batch

    consts = {t.name: t for t in g.initializer}
    for n in g.node:
        if n.op_type == "Constant" and n.domain in ("", "ai.onnx"):
            for a in n.attribute:
                if a.name == "value":
                    consts[n.output[0]] = a.t
    # the forward's values: everything computed from a graph input (constants folded at export are not)
    live = {i.name for i in g.input}
    for n in g.node:
        if any(x in live for x in n.input if x):
            live.update(y for y in n.output if y)
    shapes: dict[str, str] = {}  # old shape constant -> its batched twin (shared like the original)
    rewritten = 0
    for n in g.node:
        if n.op_type != "Reshape" or n.input[0] not in live:
            continue
        target = n.input[1]
        if target in live:  # computed from the forward's own shapes: it follows the batch already
            continue
        if target not in consts:
            raise ContractError(f"{source}: {n.name} reshapes to a shape that is neither constant nor computed")
        shape = numpy_helper.to_array(consts[target])
        allowzero = next((a.i for a in n.attribute if a.name == "allowzero"), 0)
        if shape.ndim != 1 or not len(shape):
            raise ContractError(f"{source}: {n.name} reshapes to a scalar shape")
        if shape[0] == 0 and not allowzero:
            continue  # copies dim 0 already
        if shape[0] != 1 or (allowzero and (shape[1:] == 0).any()):
            raise ContractError(
                f"{source}: {n.name} reshapes the forward's values to {shape.tolist()}: no batch axis to keep"
            )
        if target not in shapes:
            new = shape.copy()
            new[0] = 0
            shapes[target] = f"{target}/batched"
            g.initializer.append(numpy_helper.from_array(new.astype(shape.dtype), shapes[target]))
        n.input[1] = shapes[target]
        for a in list(n.attribute):
            if a.name == "allowzero":
                n.attribute.remove(a)
        rewritten += 1
    used = {x for nd in g.node for x in nd.input}
    keep = [t for t in g.initializer if t.name in used or t.name in {o.name for o in g.output}]
    del g.initializer[:]
    g.initializer.extend(keep)
    for p in list(m.metadata_props):
        if p.key == SERVE_BATCH_KEY:
            m.metadata_props.remove(p)
    m.metadata_props.add(
        key=SERVE_BATCH_KEY,
        value=json.dumps({"layout": S.KV_ROWWISE, "reshapes": rewritten}, sort_keys=True),
    )
    return m


def batch_one_reshapes(m) -> list[str]:
    """The Reshapes of ``m``'s forward values whose constant target shape still pins dim 0 to 1
    (what the pass rewrites; a test's check that none is left)."""
    from onnx import numpy_helper

    g = m.graph
    consts = {t.name: numpy_helper.to_array(t) for t in g.initializer}
    live = {i.name for i in g.input}
    for n in g.node:
        if any(x in live for x in n.input if x):
            live.update(y for y in n.output if y)
    return [
        n.name
        for n in g.node
        if n.op_type == "Reshape"
        and n.input[0] in live
        and n.input[1] in consts
        and np.asarray(consts[n.input[1]]).ravel()[:1].tolist() == [1]
    ]
