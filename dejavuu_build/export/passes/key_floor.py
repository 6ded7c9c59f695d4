"""The key floor: attention at a head size above 128 never runs over fewer than KEY_FLOOR keys.

Why (measured, onnxruntime 1.32, docs/exactness.md "Attention at head size 256 near 64 keys"):
the CPU ``Attention`` and ``GroupQueryAttention`` kernels compute the scores Q·Kᵀ with MLAS's
SGEMM, one call per head, ``M`` = query rows, ``N`` = keys in the call, ``K`` = head size.
``MlasSgemmOperation`` chooses its panel strides from N and K: with ``N < K`` it halves the N
stride (128) while ``N`` still fits in half of it and doubles the K stride for each halving. At
head size 256 the reduction over the head therefore runs in one pass when the call has at most
64 keys and in two passes of 128 (the first stored to the output, the second added to it) above:
a query row's scores, hence its softmax and output, get other bits when the same row is computed
in a call over 60 keys (a lone step at past 58) than in one over 70 (a verify of 8 rows at the same
past). Head sizes up to 128 never split (SmolLM2's 64 is untouched); above 256 the edges are 32
and 64 keys, and above 64 keys every head size runs passes of 128. The second product (probs · V,
``K`` = keys) is chunked from key 0 and a masked key adds an exact zero, so it does not depend on
the key count.

So a decoder with a head size above 128 feeds its attention at least KEY_FLOOR = 65 keys: the
concat flavour pads K and V with zero keys and the mask with masked columns (``floor_keys``, this
module; the masked keys' probabilities are exactly zero); the static flavour, whose
GroupQueryAttention writes its rows in place at ``total - rows``, adds zero query rows after the
step's own instead (export.passes.static_kv), cut off its output. Either way a step of any row
count runs the same passes, for every past, and costs more only while the context is under 65.

The concat flavour's floor nodes are named like the row guard's (``<node>/row_guard/...``,
initializers ``row_guard.*``), so ``strip_row_guard`` removes them with it: the in-place passes
and the quantizer rewrite the graph as exported, and the floor and the guard are applied last.
"""

from __future__ import annotations

import numpy as np

KEY_FLOOR = 65  # above 64 keys the head-size reduction runs in the same passes for every key count
SPLIT_HEAD = 128  # MLAS's SGEMM K stride: head sizes above it are reduced in passes chosen by N
NEG = np.float32(np.finfo(np.float32).min)  # runtime.tree.NEG: a masked key's additive bias


def needs_key_floor(head_dim: int) -> bool:
    """Whether attention at this head size gives a row other bits over fewer than KEY_FLOOR keys."""
    return head_dim > SPLIT_HEAD


def floor_keys(model, head_dim: int):
    """``model`` (an onnx ModelProto of the concat flavour, changed in place and returned) with every
    ONNX ``Attention`` that takes a mask fed at least KEY_FLOOR keys: K and V padded with zero keys
    and the mask with masked columns (NEG) when the step has fewer. Unchanged at head sizes up to
    SPLIT_HEAD."""
    from onnx import helper, numpy_helper

    if not needs_key_floor(head_dim):
        return model
    g = model.graph
    attn = [n for n in g.node if n.op_type == "Attention" and n.domain in ("", "ai.onnx")]
    if any("/row_guard/key_floor" in n.name for n in g.node):
        return model
    inits = {t.name for t in g.initializer}

    def const(name, arr):
        if name not in inits:
            g.initializer.append(numpy_helper.from_array(np.asarray(arr), name))
            inits.add(name)
        return name

    floor = const("row_guard.key_floor", np.array([KEY_FLOOR], np.int64))
    zero = const("row_guard.key_floor.zero", np.array([0], np.int64))
    neg = const("row_guard.key_floor.neg", np.array(NEG, np.float32))
    axis2 = const("row_guard.key_floor.axis2", np.array([2], np.int64))
    axis3 = const("row_guard.key_floor.axis3", np.array([3], np.int64))
    out = []
    for n in g.node:
        if n not in attn or len(n.input) < 4 or not n.input[3] or any(n.input[4:]):
            out.append(n)
            continue
        b = f"{n.name}/row_guard/key_floor"
        k, v, mask = n.input[1], n.input[2], n.input[3]
        out += [
            helper.make_node("Shape", [k], [f"{b}/T"], name=f"{b}/Shape", start=2, end=3),
            helper.make_node("Sub", [floor, f"{b}/T"], [f"{b}/short"], name=f"{b}/Sub"),
            helper.make_node("Max", [f"{b}/short", zero], [f"{b}/extra"], name=f"{b}/Max"),
            helper.make_node("Concat", [zero, f"{b}/extra"], [f"{b}/pads"], name=f"{b}/Concat", axis=0),
            # "/row_guard/Pad_" in the names: strip_row_guard maps their outputs back to their inputs
            helper.make_node("Pad", [k, f"{b}/pads", "", axis2], [f"{b}/k"], name=f"{b}/row_guard/Pad_k"),
            helper.make_node("Pad", [v, f"{b}/pads", "", axis2], [f"{b}/v"], name=f"{b}/row_guard/Pad_v"),
            helper.make_node("Pad", [mask, f"{b}/pads", neg, axis3], [f"{b}/mask"], name=f"{b}/row_guard/Pad_mask"),
        ]
        n.input[1], n.input[2], n.input[3] = f"{b}/k", f"{b}/v", f"{b}/mask"
        out.append(n)
    del g.node[:]
    g.node.extend(out)
    return model


def unfloored_inputs(model, node) -> list[str]:
    """``node``'s first four inputs (q, k, v, mask) as the graph computes them before the key floor:
    what the per-op probe feeds, so that it measures the node with its floor."""
    producers = {o: n for n in model.graph.node for o in n.output}
    ins = list(node.input[:4])
    for j in (1, 2, 3):
        p = producers.get(ins[j])
        if p is not None and p.op_type == "Pad" and "/row_guard/key_floor/row_guard/Pad_" in p.name:
            ins[j] = p.input[0]
    return ins
