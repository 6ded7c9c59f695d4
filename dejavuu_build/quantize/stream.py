"""An ONNX file's graph without its weights, and its initializers read one at a time.

``onnx.load`` holds every fp32 weight at once, and with the upb protobuf runtime a cleared field
keeps its arena bytes until the whole model goes: quantizing that way peaks at a multiple of the
fp32 size (measured: docs/quantization.md, Memory). Here the protobuf wire format is walked once:
every field of the model and of its graph is kept except the initializers, whose byte ranges (and
name, dims, type) are recorded; each is read from the file (``pread``, not through the map, so its
pages do not stay resident) only when asked for and freed with its array.
Initializers whose data lies in a ``.data`` file (models over 2 GB) are read from it the same way.
A weight the file stores as fp16 behind a Cast (export.fp16_store.pack) is read as the fp32 one it
stands for, its Cast dropped: the graph is the one that was packed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..export.fp16_store import packed_source
from ..export.wire import (
    GRAPH_INITIALIZER,
    LEN,
    MODEL_GRAPH,
    TENSOR_DATA_TYPE,
    TENSOR_DIMS,
    TENSOR_NAME,
    fields,
    varint,
)


@dataclass(frozen=True)
class _Init:
    name: str
    dims: tuple[int, ...]
    data_type: int
    start: int
    end: int


class StreamedModel:
    """``model``: the ModelProto with an empty initializer list; ``dims`` / ``array`` / ``proto``
    read one initializer by name."""

    def __init__(self, path: str | Path):
        import mmap

        import onnx

        self.path = Path(path)
        self._fd = os.open(self.path, os.O_RDONLY)
        self._map = mmap.mmap(self._fd, 0, access=mmap.ACCESS_READ)
        buf = self._map
        top, graph = [], []
        self._inits: dict[str, _Init] = {}
        for field, wire, first, at, nxt in fields(buf, 0, len(buf)):
            if field != MODEL_GRAPH or wire != LEN:
                top.append(bytes(buf[first:nxt]))
                continue
            for gf, gw, gfirst, gat, gnxt in fields(buf, at, nxt):
                if gf == GRAPH_INITIALIZER and gw == LEN:
                    t = self._header(buf, gat, gnxt)
                    self._inits[t.name] = t
                else:
                    graph.append(bytes(buf[gfirst:gnxt]))
        self.model = onnx.ModelProto.FromString(b"".join(top))
        self.model.graph.CopyFrom(onnx.GraphProto.FromString(b"".join(graph)))
        self._fp16: dict[str, str] = {}  # fp32 name -> the fp16 initializer it is stored as
        nodes = self.model.graph.node
        for k in reversed(range(len(nodes))):
            src = packed_source(nodes[k])
            if src is not None and src in self._inits and self._inits[src].data_type == onnx.TensorProto.FLOAT16:
                self._fp16[nodes[k].output[0]] = src
                del nodes[k]
        self._stored = {v: k for k, v in self._fp16.items()}  # the fp16 initializer -> its fp32 name
        self.names = [self._stored.get(n, n) for n in self._inits]  # file order, to write them back in it

    @staticmethod
    def _header(buf, start: int, end: int) -> _Init:
        dims: list[int] = []
        name, dtype = "", 0
        for field, wire, _, at, nxt in fields(buf, start, end):
            if field == TENSOR_DIMS:
                if wire == LEN:  # packed
                    while at < nxt:
                        d, at = varint(buf, at)
                        dims.append(d)
                else:
                    dims.append(varint(buf, at)[0])
            elif field == TENSOR_DATA_TYPE:
                dtype = varint(buf, at)[0]
            elif field == TENSOR_NAME:
                name = bytes(buf[at:nxt]).decode()
        return _Init(name, tuple(dims), dtype, start, end)

    def __contains__(self, name: str) -> bool:
        return name in self._fp16 or (name in self._inits and name not in self._stored)

    def dims(self, name: str) -> tuple[int, ...]:
        return self._inits[self._fp16.get(name, name)].dims

    def proto(self, name: str):
        """The TensorProto, its data loaded (from the ``.data`` file where it lies there); fp32 where
        the file stores it as fp16 (export.fp16_store)."""
        import onnx
        from onnx import numpy_helper
        from onnx.external_data_helper import load_external_data_for_tensor, uses_external_data

        if name in self._fp16:
            half = numpy_helper.to_array(self.proto(self._fp16[name]))
            return numpy_helper.from_array(half.astype(np.float32), name)
        t = self._inits[name]
        tp = onnx.TensorProto.FromString(os.pread(self._fd, t.end - t.start, t.start))
        if uses_external_data(tp):
            load_external_data_for_tensor(tp, str(self.path.parent))
            tp.data_location = onnx.TensorProto.DEFAULT
            del tp.external_data[:]
        return tp

    def array(self, name: str) -> np.ndarray:
        from onnx import numpy_helper

        return numpy_helper.to_array(self.proto(name))

    def close(self) -> None:
        self._map.close()
        os.close(self._fd)
