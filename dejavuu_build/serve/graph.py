"""The batched flavour of a static-KV decoder: several requests' verify rows in one forward.

The static graph (export/inplace.py) has batch 1 and derives GroupQueryAttention's ``seqlens_k``
from the bias's width, so it can only run one request. This pass, on the graph alone (onnx, no
torch), gives every GQA node a batch of requests: ``seqlens_k`` and ``query_seqlens``
(onnxruntime >= 1.32) from new inputs, each batch entry one request with its own KV buffer row,
its rows right-padded to the step's longest request. Padding rows never enter the
cache and real rows never attend to them; ``query_seqlens = 0`` leaves an idle entry untouched.

Everything else (MatMulNBits, norms, the lm-head) works row by row, and rows are bit-identical
for any row count >= 2, which is what keeps each request's tokens equal to decoding it alone
(checked per machine by serve.batch.check_exact, and by the tests).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import numpy as np

from ..errors import ContractError
from ..log import logger
from ..schema import ROW_SLOTS, SLOT_ROWS

SEQLENS_K = "seqlens_k"            # [B] int32: tokens in each entry's cache after this step, minus one
QUERY_SEQLENS = "query_seqlens"    # [B] int32: valid (unpadded) rows of each entry this step
PAD_INDEX = "pad_index"            # [B, S] int64: packed row of each padded row (pads: any valid row)
UNPAD_INDEX = "unpad_index"        # [1, T] int64: padded row (b * S + s) of each packed row
GQA_POSITIONS = "padded_position_ids"   # [B, S] int64: positions in the padded layout
_GQA_SEQLENS, _GQA_POSITIONS, _GQA_BIAS, _GQA_QUERY_SEQLENS = 5, 9, 10, 16
_BATCH = "batch"
GRAPH_VERSION = 3                  # part of the cache key: bump when the pass changes
RECORD = "batched.json"            # beside the graph: its sha256 and size, written after it
TMP_MARK = ".tmp"                  # a graph or record being written (a dead writer's, once the lock is held)


def batched_graph(src: Path, dst: Path) -> None:
    """Write the batched flavour of the static decoder ``src`` to ``dst`` (atomically).

    Rows stay packed ``[1, T]`` (T = all requests' rows) through every row-wise op, so the
    projections, norms and lm-head cost the real rows only; each GroupQueryAttention gathers its
    q/k/v rows into the padded ``[B, S]`` layout it needs (``pad_index``), and its output is
    gathered back (``unpad_index``). The bias becomes ``[B, 1, S, W]``, one block per request."""
    import onnx
    from onnx import TensorProto, helper

    m = onnx.load(str(src))
    g = m.graph
    gqa = [n for n in g.node if n.op_type == "GroupQueryAttention" and n.domain == "com.microsoft"]
    if not gqa:
        raise ContractError(f"{src.name} has no GroupQueryAttention: batched serving needs a static-KV variant "
                            f"(`--kv-layouts static`)")
    names = {i.name for i in g.input}
    new_inputs = (SEQLENS_K, QUERY_SEQLENS, PAD_INDEX, UNPAD_INDEX, GQA_POSITIONS)
    if any(n in names for n in new_inputs):
        raise ContractError(f"{src.name} already has batched inputs")
    bias = next((i for i in g.input if i.name == "attention_bias"), None)
    if bias is None:
        raise ContractError(f"{src.name} has no attention_bias input")
    for v in [bias] + [i for i in g.input if i.name.startswith("past_")] + \
            [o for o in g.output if o.name.startswith("present")]:
        d0 = v.type.tensor_type.shape.dim[0]
        d0.ClearField("dim_value")
        d0.dim_param = _BATCH
    del g.value_info[:]                      # shapes inferred at batch 1 would contradict the new layout
    g.input.extend([helper.make_tensor_value_info(SEQLENS_K, TensorProto.INT32, [_BATCH]),
                    helper.make_tensor_value_info(QUERY_SEQLENS, TensorProto.INT32, [_BATCH]),
                    helper.make_tensor_value_info(PAD_INDEX, TensorProto.INT64, [_BATCH, "S"]),
                    helper.make_tensor_value_info(UNPAD_INDEX, TensorProto.INT64, [1, "N"]),
                    helper.make_tensor_value_info(GQA_POSITIONS, TensorProto.INT64, [_BATCH, "S"])])
    g.initializer.append(onnx.numpy_helper.from_array(np.array([0], np.int64), "batched.axis0"))
    shapes = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in g.input}
    row_shapes: dict[int, str] = {}
    # The static graph's own row/slot gathers (export.inplace) do for one request what pad_index /
    # unpad_index do for the batch: they are bypassed and the batched gathers take their place.
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
        ins = list(n.input) + [""] * max(0, _GQA_QUERY_SEQLENS + 1 - len(n.input))
        for j in (0, 1, 2):
            feeder = producer.get(ins[j])
            if feeder is not None and feeder.op_type == "Gather" and feeder.input[1] == SLOT_ROWS:
                ins[j] = feeder.input[0]
        back = users.get(n.output[0], [])
        if len(back) == 1 and back[0].op_type == "Gather" and back[0].input[1] == ROW_SLOTS:
            slot_gathers.add(id(back[0]))
            n.output[0] = back[0].output[0]
        if ins[_GQA_QUERY_SEQLENS]:
            raise ContractError(f"{n.name} already takes query_seqlens")
        for j in (0, 1, 2):                   # packed qkv, or separate q, k, v: [1, T, d] -> [B, S, d]
            if ins[j]:
                flat, padded = f"{n.name}/batched/flat{j}", f"{n.name}/batched/padded{j}"
                body.append(helper.make_node("Squeeze", [ins[j], "batched.axis0"], [flat], name=flat))
                body.append(helper.make_node("Gather", [flat, PAD_INDEX], [padded], name=padded, axis=0))
                ins[j] = padded
        ins[_GQA_SEQLENS], ins[_GQA_POSITIONS], ins[_GQA_QUERY_SEQLENS] = SEQLENS_K, GQA_POSITIONS, QUERY_SEQLENS
        if ins[_GQA_BIAS] != "attention_bias":
            raise ContractError(f"{n.name} takes a bias other than the attention_bias input")
        del n.input[:]
        n.input.extend(ins)
        out = n.output[0]
        padded_out = f"{n.name}/batched/out"
        n.output[0] = padded_out
        width = _attr(n, "num_heads") * shapes[ins[3]][3]      # query heads x head_dim (from past_key)
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
    used = {i for nd in g.node for i in nd.input}
    for v in [i for i in g.input if i.name not in used]:   # e.g. position_ids, now read by GQA only
        g.input.remove(v)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f"{dst.name}{TMP_MARK}{os.getpid()}")
    try:
        onnx.save(m, str(tmp))
        with open(tmp, "rb+") as f:      # on disk before it is renamed into place
            os.fsync(f.fileno())
        os.replace(tmp, dst)
    except BaseException:
        tmp.unlink(missing_ok=True)      # a full disk leaves no half file behind
        raise


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


def batched_path(src: Path, cache: Path) -> Path:
    """Where the batched flavour of ``src`` lives: keyed by the source graph's bytes, so a rebuilt
    decoder gets a new one and a stale one is never used."""
    h = hashlib.sha256(f"batched-graph-v{GRAPH_VERSION}".encode())
    with open(src, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return cache / h.hexdigest()[:24] / "decoder_batched.onnx"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _intact(path: Path) -> bool:
    """The graph at ``path`` is the one its record describes (size and sha256): not truncated by a
    kill or a full disk, not edited since it was written."""
    try:
        rec = json.loads((path.parent / RECORD).read_text())
        return (isinstance(rec, dict) and rec.get("version") == GRAPH_VERSION and path.is_file()
                and path.stat().st_size == rec.get("bytes") and _sha256(path) == rec.get("sha256"))
    except (OSError, ValueError):
        return False


def _locked(folder: Path, wait_s: float = 600.0):
    """An exclusive lock on ``folder`` (one writer of a batched graph at a time, across servers)."""
    from contextlib import contextmanager

    from ..cache import _try_lock, _unlock

    @contextmanager
    def hold():
        with open(folder / ".lock", "a+") as fh:
            deadline = time.monotonic() + wait_s
            while not _try_lock(fh):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"another server kept {folder} locked for {wait_s:.0f} s")
                time.sleep(0.05)
            try:
                yield
            finally:
                _unlock(fh)
    return hold()


def _sweep(folder: Path) -> None:
    """Remove a killed writer's temp files beside a good graph, if no writer holds the lock now
    (best effort: a read-only cache keeps them, and they are never read)."""
    from ..cache import _try_lock, _unlock

    try:
        temps = [p for p in folder.iterdir() if TMP_MARK in p.name]
        if not temps:
            return
        with open(folder / ".lock", "a+") as fh:
            if _try_lock(fh):
                try:
                    for p in temps:
                        p.unlink(missing_ok=True)
                finally:
                    _unlock(fh)
    except OSError:
        pass


def ensure_batched(src: Path, cache: Path) -> Path:
    """The batched flavour of ``src`` under ``cache``, checked against its record (sha256, size) on
    every use and rewritten when missing or wrong, atomically, under a lock; a dead writer's temp
    files are removed. Raises OSError when it cannot be written (a read-only or full cache)."""
    path = batched_path(src, cache)
    if _intact(path):          # the common case reads only: a read-only cache with a good graph serves batched
        _sweep(path.parent)
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path.parent):
        for p in path.parent.iterdir():        # no other writer holds the lock: these are a killed one's
            if TMP_MARK in p.name:
                p.unlink(missing_ok=True)
        if _intact(path):                      # written by another server while we waited
            return path
        (path.parent / RECORD).unlink(missing_ok=True)
        logger.info("writing the batched flavour of %s to %s", src.name, path)
        batched_graph(src, path)
        rec = {"version": GRAPH_VERSION, "sha256": _sha256(path), "bytes": path.stat().st_size, "source": src.name}
        tmp = path.parent / f"{RECORD}{TMP_MARK}{os.getpid()}"
        try:
            tmp.write_text(json.dumps(rec, indent=2) + "\n")
            os.replace(tmp, path.parent / RECORD)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    return path
