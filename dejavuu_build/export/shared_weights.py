"""Save a graph whose weights another saved graph already holds, by reference to that file's bytes.

The serving batch graph (build.serve_graph) has the same initializers as the variant it follows,
byte for byte; stored again it doubled that variant's share of the entry (int8-static: 152 MB
more on SmolLM2-135M, the entry 1.15 GB instead of 1.0). ONNX external data names a file, an offset
and a length per tensor, and a tensor's ``raw_data`` sits contiguously in the serialized source
graph, so the batched graph points its shared tensors at their bytes inside the source ``.onnx``
(or at the source's own ``.data`` where the source is itself external). onnxruntime and onnx read
them as any external data, relative to the graph's folder. No library offers "offsets of tensors
inside a serialized ModelProto" (protobuf's Python API gives none), so ``tensor_spans`` walks
the wire format (export.wire, as quantize.stream does). The source's sha256 (recorded beside the batched
graph's: Manifest.batched.source_sha256) pins the bytes the references read.
"""

from __future__ import annotations

import mmap
from contextlib import ExitStack
from pathlib import Path

from .wire import (
    GRAPH_INITIALIZER,
    LEN,
    MODEL_GRAPH,
    TENSOR_DATA_LOCATION,
    TENSOR_NAME,
    TENSOR_RAW_DATA,
    fields,
    varint,
)

MIN_SHARED = 1024  # smaller tensors stay inline (onnx's own external-data threshold)


def tensor_spans(path: Path) -> dict[str, tuple[str, int, int]]:
    """name -> (file, offset, length) of each initializer's bytes: inside ``path`` for an inline
    tensor's raw_data, or where the source's own external data entry says."""
    import onnx

    spans: dict[str, tuple[str, int, int]] = {}
    external = False
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        for number, wire, _, a, b in fields(buf, 0, len(buf)):
            if number != MODEL_GRAPH or wire != LEN:
                continue
            for n2, w2, _, c, d in fields(buf, a, b):
                if n2 != GRAPH_INITIALIZER or w2 != LEN:
                    continue
                name, raw = None, None
                for n3, w3, _, e, g in fields(buf, c, d):
                    if n3 == TENSOR_NAME and w3 == LEN:
                        name = bytes(buf[e:g]).decode()
                    elif n3 == TENSOR_RAW_DATA and w3 == LEN:
                        raw = (e, g - e)
                    elif n3 == TENSOR_DATA_LOCATION and w3 == 0:
                        external = external or varint(buf, e)[0] == 1  # TensorProto.EXTERNAL
                if name is not None and raw is not None:
                    spans[name] = (path.name, *raw)
    if external:  # a source past 2 GB keeps its weights in its own .data: read where they are
        model = onnx.load(str(path), load_external_data=False)
        for t in model.graph.initializer:
            ext = {e.key: e.value for e in t.external_data}
            if t.data_location == onnx.TensorProto.EXTERNAL and "location" in ext:
                spans[t.name] = (ext["location"], int(ext.get("offset", 0)), int(ext["length"]))
    return spans


def save_sharing(proto, path: Path, source: Path) -> int:
    """Save ``proto`` at ``path`` as exporter.save_model would (fp16-exact weights packed:
    export.fp16_store), each initializer whose bytes ``source`` (a saved graph in the same folder)
    holds identically stored as a reference to them. Returns the bytes shared. Tensors ``source``
    does not hold byte for byte stay inline."""
    import onnx

    from .fp16_store import pack

    pack(proto)
    path, source = Path(path), Path(source)
    if path.parent.resolve() != source.parent.resolve():
        raise ValueError(f"{path.name} can share the weights of a graph in its own folder only, not {source}")
    spans = tensor_spans(source)
    shared = 0
    with ExitStack() as stack:
        files: dict[str, mmap.mmap] = {}
        for t in proto.graph.initializer:
            span = spans.get(t.name)
            if span is None or len(t.raw_data) < MIN_SHARED or len(t.raw_data) != span[2]:
                continue
            loc, off, length = span
            if loc not in files:
                f = stack.enter_context(open(path.parent / loc, "rb"))
                files[loc] = stack.enter_context(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
            if files[loc][off : off + length] != t.raw_data:
                continue
            t.ClearField("raw_data")
            t.data_location = onnx.TensorProto.EXTERNAL
            del t.external_data[:]
            for key, value in (("location", loc), ("offset", str(off)), ("length", str(length))):
                entry = t.external_data.add()
                entry.key, entry.value = key, value
            shared += length
    path.with_name(path.name + ".data").unlink(missing_ok=True)  # a stale one of an earlier save_model
    path.write_bytes(proto.SerializeToString())  # as is: onnx.save would resolve external tensors
    return shared
