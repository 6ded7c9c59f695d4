"""Reading the protobuf wire format of an ONNX file in place: the byte ranges of its fields.

protobuf's Python API parses whole messages and gives no offsets, so the two readers that need
byte positions inside a saved ModelProto walk it here: quantize.stream (the graph without its
weights, each initializer read alone) and export.shared_weights (a graph pointing at another's
tensor bytes)."""

from __future__ import annotations

# field numbers of onnx.proto's messages read here
MODEL_GRAPH = 7  # ModelProto.graph
GRAPH_INITIALIZER = 5  # GraphProto.initializer
TENSOR_DIMS, TENSOR_DATA_TYPE, TENSOR_NAME, TENSOR_RAW_DATA, TENSOR_DATA_LOCATION = 1, 2, 8, 9, 14
LEN = 2  # the wire type of strings, bytes and sub-messages


def varint(buf, at: int) -> tuple[int, int]:
    """(value, position after it) of the varint at ``buf[at]``."""
    shift = value = 0
    while True:
        b = buf[at]
        at += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return value, at


def fields(buf, start: int, end: int):
    """(field number, wire type, field start, payload start, field end) over buf[start:end]."""
    at = start
    while at < end:
        first = at
        key, at = varint(buf, at)
        field, wire = key >> 3, key & 7
        if wire == 0:
            _, nxt = varint(buf, at)
        elif wire == 1:
            nxt = at + 8
        elif wire == 5:
            nxt = at + 4
        elif wire == LEN:
            n, at = varint(buf, at)
            nxt = at + n
        else:
            raise ValueError(f"protobuf wire type {wire} (groups) in an ONNX file")
        yield field, wire, first, at, nxt
        at = nxt
