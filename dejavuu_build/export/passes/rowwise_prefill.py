"""A rowwise decoder's prefill graph: the same graph with each layer's attention taking the prompt
chunk's rows as rows (q ``[1, H, R, D]``, the caller's ``[1, 1, R, L]`` bias) instead of one head
per row, over the same bound buffer.

Why: the rowwise flavour (export.passes.rowwise_kv) runs every query row as a head of its own, so
a token's bits are the same alone or among drafts, but a prompt chunk then pays one one-row
attention per row: its prefill took 1.11x / 1.16x the static flavour's at 256 / 1024 prompt tokens,
and this graph 1.05x / 1.04x (docs/speed.md, twentieth session). A prefill needs no row invariance
-- plain and speculative decoding share it, chunk for chunk (schema.PREFILL_CHUNK), so
decoding stays lossless whatever its bits -- so its rows may take onnxruntime's multi-row kernels.
Everything else (weights, inputs, outputs, the K/V written in place at ``kv_write_index``) is the
rowwise graph's: the runtime binds the same buffer to both sessions (layouts.rowwise).

The edit removes nodes only (each layer's ``q_rows`` Reshape and the shared mask Expand/Reshape),
so every remaining node keeps its name; the graph is saved by reference to the variant's weights
(export.shared_weights). On the graph alone (onnx, no torch).
"""

from __future__ import annotations

import json

from ... import schema as S
from ...errors import ContractError

ATTENTION_SUFFIX = "/kv_rowwise/Attention"
Q_ROWS_SUFFIX = "/kv_rowwise/q_rows"


def to_rowwise_prefill(m, source: str = "the decoder"):
    """Rewrite the rowwise decoder ``m`` (an onnx ModelProto, changed in place and returned) into its
    prefill graph; ``source`` names it in errors and in the graph's metadata (S.PREFILL_KEY).
    ContractError where the graph is not a rowwise one made by export.passes.rowwise_kv."""
    g = m.graph
    meta = {p.key: p.value for p in m.metadata_props}
    if meta.get(S.KV_LAYOUT_KEY) != S.KV_ROWWISE:
        raise ContractError(f"{source} is not a rowwise-KV graph (its layout: {meta.get(S.KV_LAYOUT_KEY)!r})")
    if S.ATTENTION_BIAS not in {i.name for i in g.input}:
        raise ContractError(f"{source} takes no {S.ATTENTION_BIAS}: no prefill graph")
    producer = {o: n for n in g.node for o in n.output}
    layers = 0
    for n in g.node:
        if n.op_type != "Attention" or not n.name.endswith(ATTENTION_SUFFIX):
            continue
        rows = producer.get(n.input[0])
        if rows is None or rows.op_type != "Reshape" or not rows.name.endswith(Q_ROWS_SUFFIX):
            raise ContractError(f"{source}: {n.name} does not read its query through a rows-as-heads Reshape")
        n.input[0] = rows.input[0]  # q [1, H, R, D]: the chunk's rows as rows
        n.input[3] = S.ATTENTION_BIAS  # [1, 1, R, L], broadcast over the heads
        layers += 1
    if not layers:
        raise ContractError(f"{source} has no rowwise attention ({ATTENTION_SUFFIX}) to rewrite")
    _drop_dead(g)
    entry = m.metadata_props.add()
    entry.key, entry.value = S.PREFILL_KEY, json.dumps({"of": source, "layers": layers})
    return m


def _drop_dead(g) -> None:
    """Remove nodes none of whose outputs is read (the rows-as-heads Reshapes and the mask's)."""
    outputs = {o.name for o in g.output}
    nodes = list(g.node)
    while True:
        read = {i for n in nodes for i in n.input} | outputs
        kept = [n for n in nodes if any(o in read for o in n.output)]
        if len(kept) == len(nodes):
            break
        nodes = kept
    if len(nodes) != len(g.node):
        del g.node[:]
        g.node.extend(nodes)
    used = {i for n in g.node for i in n.input}
    dead = [t for t in g.initializer if t.name not in used]
    for t in dead:
        g.initializer.remove(t)
