"""One quantizer, parameterised by a plan: body bits, lm-head bits, embedding bits.

Every MatMul with a constant 2D weight becomes ``com.microsoft.MatMulNBits`` (symmetric,
round-to-nearest, blocks along K); the embedding Gather becomes ``GatherBlockQuantized``.
The lm-head and the embedding are found by name (``/lm_head/MatMul``,
``/model/embed_tokens/Gather``, set by the exporter), never by guessing.

Tied embeddings stay tied: when the lm-head reads the embedding table through a Transpose,
both ops read ONE 8-bit table ([V, H] rows quantized in blocks along H, which is exactly the
MatMulNBits layout for N=V, K=H). An untied model keeps two tables.
We never write ``QAttention`` or touch ONNX ``Attention`` (a trap of ``quantize_dynamic``).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ..errors import ExportError
from ..log import logger, progress

LM_HEAD_NODE = "/lm_head/MatMul"
EMBED_NODE = "/model/embed_tokens/Gather"
MS = "com.microsoft"


@dataclass(frozen=True)
class QuantPlan:
    body_bits: int = 4
    body_block: int = 32
    lm_head_bits: int = 8
    lm_head_block: int = 128
    embed_bits: int = 8
    accuracy_level: int = 4          # int8 activations inside MatMulNBits: faster on CPU

    def to_json(self) -> dict:
        return asdict(self)


PLANS: dict[str, QuantPlan] = {
    "int8": QuantPlan(body_bits=8, body_block=32, lm_head_bits=8, embed_bits=8),
    "int4": QuantPlan(body_bits=4, body_block=32, lm_head_bits=8, embed_bits=8),
}


def _quantize_rows(w_rows: np.ndarray, bits: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Quantize ``w_rows`` [N, K] in blocks of ``block`` along K. Returns (q uint8 [N, nb, block], scales [N, nb])."""
    n, k = w_rows.shape
    nb = k // block
    wb = w_rows.reshape(n, nb, block).astype(np.float32)
    qmax = 2 ** (bits - 1) - 1
    scales = np.abs(wb).max(axis=-1) / qmax
    scales[scales == 0] = 1.0
    q = np.clip(np.rint(wb / scales[..., None]), -qmax, qmax) + 2 ** (bits - 1)
    return q.astype(np.uint8), scales.astype(np.float32)


def fit_block(k: int, block: int) -> int | None:
    """The largest power-of-two block <= ``block`` (and >= 16) that divides ``k``; None if none does."""
    b = block
    while b >= 16:
        if k % b == 0:
            return b
        b //= 2
    return None


def _pack(q: np.ndarray, bits: int) -> np.ndarray:
    if bits == 8:
        return q
    if bits == 4:
        return (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
    raise ValueError(f"unsupported bit width {bits}")


def quantize_model(src: Path, dst: Path, plan: QuantPlan, *, tied: bool | None = None) -> dict:
    """Quantize the fp32 decoder at ``src`` into ``dst`` following ``plan``; returns a report."""
    import onnx
    from onnx import helper, numpy_helper

    from ..export.exporter import save_model

    t0 = time.perf_counter()
    model = onnx.load(str(src))
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    producers = {o: nd for nd in g.node for o in nd.output}
    by_name = {nd.name: nd for nd in g.node}
    lm = by_name.get(LM_HEAD_NODE)
    emb = by_name.get(EMBED_NODE)
    if lm is None:
        raise ExportError(f"{src.name}: no {LM_HEAD_NODE} node; re-export with this version of dejavuu-build")
    new_inits: list = []
    replaced: dict[int, list] = {}     # id(node) -> replacement nodes
    drop_nodes: set[int] = set()
    report: dict = {"plan": plan.to_json(), "nodes": {}}
    fp_bytes = q_bytes = 0

    def add_init(arr: np.ndarray, name: str):
        nonlocal q_bytes
        new_inits.append(numpy_helper.from_array(arr, name))
        q_bytes += arr.nbytes
        return name

    def matmul_nbits(node, w_kn: np.ndarray, bits: int, block: int, prefix: str,
                     shared: tuple[str, str] | None = None) -> list:
        k, n = w_kn.shape
        nb = k // block
        if shared is None:
            q, s = _quantize_rows(w_kn.T, bits, block)
            b_name = add_init(_pack(q, bits), prefix + f".q{bits}")
            s_name = add_init(s, prefix + f".q{bits}_scales")
            extra: list = []
        else:  # the tied table: [V, H] uint8 + [V, nb] scales, viewed as MatMulNBits' [N, nb, block]
            data, s_name = shared
            shape = add_init(np.array([n, nb, block], dtype=np.int64), prefix + ".q_shape")
            b_name = prefix + ".q8_view"
            extra = [helper.make_node("Reshape", [data, shape], [b_name], name=node.name + "_ViewTied")]
        mm = helper.make_node("MatMulNBits", [node.input[0], b_name, s_name], list(node.output),
                              name=node.name + "NBits", domain=MS, K=k, N=n, bits=bits, block_size=block,
                              accuracy_level=plan.accuracy_level)
        return extra + [mm]

    lm_w = lm.input[1]
    lm_tied = False
    if emb is not None:  # an inputs_embeds decoder has no embedding inside the graph
        table_name = emb.input[0]
        if table_name not in inits:
            raise ExportError(f"{EMBED_NODE} does not read a constant table")
        table = numpy_helper.to_array(inits[table_name])
        lm_tied = lm_w not in inits and lm_w in producers and producers[lm_w].op_type == "Transpose" \
            and producers[lm_w].input[0] == table_name
        eb = plan.lm_head_bits if lm_tied else plan.embed_bits
        eblock = fit_block(table.shape[1], plan.lm_head_block if lm_tied else plan.body_block)
        if eb != 8 or eblock is None:
            raise ExportError("embedding tables are quantized at 8 bits in blocks of 16..128 dividing the hidden size")
        q, s = _quantize_rows(table, 8, eblock)
        data_name = add_init(q.reshape(table.shape), "model.embed_tokens.q8")
        s_name = add_init(s, "model.embed_tokens.q8_scales")
        fp_bytes += table.nbytes
        replaced[id(emb)] = [helper.make_node("GatherBlockQuantized", [data_name, emb.input[1], s_name],
                                              list(emb.output), name=EMBED_NODE + "BlockQuantized", domain=MS,
                                              bits=8, block_size=eblock, gather_axis=0, quantize_axis=1)]
        report["nodes"][EMBED_NODE] = f"float32 {list(table.shape)} --> q8 bs{eblock}"
        if lm_tied:
            replaced[id(lm)] = matmul_nbits(lm, table.T, 8, eblock, "lm_head", shared=(data_name, s_name))
            drop_nodes.add(id(producers[lm_w]))
            report["nodes"][LM_HEAD_NODE] = f"tied to the embedding table --> q8 bs{eblock} (one shared table)"
    if tied is not None and tied != lm_tied and emb is not None:
        raise ExportError(f"manifest says tied={tied} but the graph's lm-head tied={lm_tied}")
    report["tied_embeddings"] = bool(lm_tied)

    def const_weight(nd) -> np.ndarray | None:
        """The [K, N] constant weight of a MatMul, seen through a Transpose of an initializer
        (a tied lm-head whose embedding lives outside the graph, in inputs_embeds decoders)."""
        x = nd.input[1]
        if x in inits and len(inits[x].dims) == 2:
            return numpy_helper.to_array(inits[x])
        t = producers.get(x)
        if t is not None and t.op_type == "Transpose" and t.input[0] in inits and len(inits[t.input[0]].dims) == 2:
            drop_nodes.add(id(t))
            return numpy_helper.to_array(inits[t.input[0]]).T
        return None

    # Every other MatMul with a constant weight (lm-head untied included).
    todo = [(nd, w) for nd in g.node if nd.op_type == "MatMul" and id(nd) not in replaced
            and len(nd.input) == 2 and (w := const_weight(nd)) is not None]
    for nd, w in progress(todo, desc="quantize"):
        is_head = nd.name == LM_HEAD_NODE
        bits = plan.lm_head_bits if is_head else plan.body_bits
        block = fit_block(w.shape[0], plan.lm_head_block if is_head else plan.body_block)
        if block is None:
            report["nodes"][nd.name] = f"float32 {list(w.shape)} kept (no block size divides K)"
            continue
        fp_bytes += w.nbytes
        replaced[id(nd)] = matmul_nbits(nd, w, bits, block, nd.input[1].removesuffix(".weight_T") or nd.name)
        report["nodes"][nd.name] = f"float32 {list(w.shape)} --> q{bits} bs{block}"
        logger.debug("  %s: float32 %s --> q%d bs%d", nd.name, list(w.shape), bits, block)

    nodes = []
    for nd in g.node:
        if id(nd) in drop_nodes:
            continue
        nodes.extend(replaced.get(id(nd), [nd]))
    del g.node[:]
    g.node.extend(nodes)
    used = {x for nd in g.node for x in nd.input}
    keep = [i for i in g.initializer if i.name in used]
    del g.initializer[:]
    g.initializer.extend(keep + new_inits)
    if not any(o.domain == MS for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS, 1))
    save_model(model, dst)
    report.update(seconds=round(time.perf_counter() - t0, 2), quantized_nodes=len(report["nodes"]),
                  float_weight_bytes=int(fp_bytes), quantized_weight_bytes=int(q_bytes))
    return report
