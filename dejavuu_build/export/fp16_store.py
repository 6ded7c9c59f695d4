"""fp32 weights stored as fp16 where that loses nothing: the file shrinks, the session does not change.

A GGUF carries its scales and block minima as fp16; in our int4/int8 decoders they are fp32
initializers (MatMulNBits scales, the offset term's minima, the 8-bit table's scales) whose values
are all fp16 numbers. ``pack`` stores each such tensor as fp16 behind a ``Cast(to=FLOAT)``, which
onnxruntime's constant folding turns back into the same fp32 initializer at session load: the
optimized graph, the prepacked weights and every output stay bit-identical (measured on
SmolLM2-135M: ~14 MB less per int4 file, docs/quantization.md). ``unpack`` undoes it for code that
rewrites or reads a saved graph's initializers (the graph passes, the quantizer, the probe):
every saved file is packed (exporter.save_model), every reader loads through ``load_unpacked``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

MIN_ELEMENTS = 4096  # below this a tensor saves < 8 KB; not worth a node
PREFIX = "fp16_store/"  # the Cast nodes' names: "fp16_store/<initializer>/Cast"
FP16_SUFFIX = ".fp16"  # the fp16 initializer of "<name>" is "<name>.fp16"


def fp16_exact(arr: np.ndarray) -> bool:
    """Whether every value of an fp32 array is an fp16 number, bit for bit (-0.0 included): no
    overflow, no rounding, and no value in fp16's subnormal range (left to fp32 rather than
    trusting every Cast kernel to keep subnormals)."""
    if arr.dtype != np.float32:
        return False
    with np.errstate(over="ignore"):
        half = arr.astype(np.float16)
    if not np.array_equal(half.astype(np.float32).view(np.uint32), arr.view(np.uint32)):
        return False
    mag = np.abs(half)
    return not bool(np.any((mag > 0) & (mag < np.finfo(np.float16).smallest_normal)))


def _cast_name(name: str) -> str:
    return f"{PREFIX}{name}/Cast"


def pack(proto, min_elements: int | None = None) -> int:
    """Store each fp32 initializer of ``proto`` (in place) with at least ``min_elements`` values
    (default MIN_ELEMENTS), all fp16-exact, as an fp16 initializer ``<name>.fp16`` (same place in
    the initializer list) read by a Cast node ``fp16_store/<name>/Cast`` whose output keeps the
    name (Cast nodes first, in initializer order: deterministic). Other tensors are left as they
    are. Returns the bytes saved."""
    from onnx import TensorProto, helper, numpy_helper
    from onnx.external_data_helper import uses_external_data

    limit = MIN_ELEMENTS if min_elements is None else min_elements
    g = proto.graph
    taken = {t.name for t in g.initializer} | {o for nd in g.node for o in nd.output} | {x.name for x in g.input}
    inputs = {x.name for x in g.input}  # an initializer that is also an input (a default) stays
    casts, saved = [], 0
    for i, t in enumerate(g.initializer):
        if t.data_type != TensorProto.FLOAT or uses_external_data(t) or int(np.prod(t.dims)) < limit:
            continue
        if t.name in inputs or t.name + FP16_SUFFIX in taken:
            continue
        arr = numpy_helper.to_array(t)
        if not fp16_exact(arr):
            continue
        half = numpy_helper.from_array(arr.astype(np.float16), t.name + FP16_SUFFIX)
        casts.append(helper.make_node("Cast", [half.name], [t.name], name=_cast_name(t.name), to=TensorProto.FLOAT))
        saved += arr.nbytes - arr.nbytes // 2
        g.initializer[i].CopyFrom(half)
    if casts:
        nodes = casts + list(g.node)
        del g.node[:]
        g.node.extend(nodes)
    return saved


def packed_source(node) -> str | None:
    """The fp16 initializer's name where ``node`` is one of pack's Cast nodes, else None."""
    if (
        node.op_type == "Cast"
        and len(node.input) == 1
        and len(node.output) == 1
        and node.name == _cast_name(node.output[0])
        and node.input[0] == node.output[0] + FP16_SUFFIX
    ):
        return node.input[0]
    return None


def unpack(proto) -> int:
    """Fold pack's Cast nodes back (in place): each fp16 initializer becomes the fp32 one it
    stands for, at its place. Returns how many were folded."""
    from onnx import TensorProto, numpy_helper

    g = proto.graph
    inits = {t.name: i for i, t in enumerate(g.initializer)}
    folded = set()
    for k, nd in enumerate(g.node):
        src = packed_source(nd)
        if src is not None and src in inits:
            half = g.initializer[inits[src]]
            assert half.data_type == TensorProto.FLOAT16, f"{half.name} is not fp16"
            half.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(half).astype(np.float32), nd.output[0]))
            folded.add(k)
    if folded:
        nodes = [nd for k, nd in enumerate(g.node) if k not in folded]
        del g.node[:]
        g.node.extend(nodes)
    return len(folded)


def load_unpacked(path: str | Path, **kwargs):
    """``onnx.load`` of a saved graph with pack undone: what the graph passes and probes read."""
    import onnx

    proto = onnx.load(str(path), **kwargs)
    unpack(proto)
    return proto
